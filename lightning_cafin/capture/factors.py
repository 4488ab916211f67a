"""Turning a capture step's statistics into the stored factors.

Runs only on capture steps (every ``TCov`` optimizer steps), once per captured layer:
combine the pending partial sums, finalise them into ``H_raw`` / ``S_raw``, map
infinities as the reference does, min-max normalise, and fold into the stored factor
with the reference's (non-convex) averaging.  A statistic holding NaN never reaches
the factors: that layer keeps its previous factors for this capture.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from .hooks import LayerCapture

NORM_EPS = 1e-6


def normalise_(v: Tensor) -> Tensor:
    """In place: ``+inf -> 1``, ``-inf -> 0``, then ``(v - min) / (max - min + 1e-6)``."""
    v.masked_fill_(v == math.inf, 1.0).masked_fill_(v == -math.inf, 0.0)
    lo, hi = v.min(), v.max()
    return v.sub_(lo).div_(hi - lo + NORM_EPS)


def fold_(stored: Tensor, v_hat: Tensor, gamma: float) -> Tensor:
    """In place: ``stored <- (0.1*gamma) * stored + (0.01*gamma) * v_hat``."""
    return stored.mul_(0.1 * gamma).add_(v_hat * (0.01 * gamma))


@dataclass
class CaptureReport:
    """What one capture step did, for health counters and warnings."""

    updated: list[str]
    not_fired: list[str]
    non_finite: list[str]


def update_factors(
    captures: list[LayerCapture],
    gamma: float,
    grad_scale: Optional[float] = None,
) -> CaptureReport:
    """Consume every capture's pending statistics and update its factors.

    ``grad_scale``: the loss scale the output gradients were multiplied by (``None`` when
    they were not scaled); it is divided out so factors come from true gradients.
    """
    report = CaptureReport([], [], [])
    for cap in captures:
        pending = cap.take_pending()
        if pending.calls == 0:
            report.not_fired.append(cap.name)
            continue
        s = pending.s
        if grad_scale is not None and grad_scale != 1.0:
            s = s / grad_scale**cap.rule.s_scale_power
        H_raw, S_raw = cap.rule.finalize(cap.module, pending.h, pending.hn, s, pending.sn)
        if torch.isnan(H_raw).any() or torch.isnan(S_raw).any():
            report.non_finite.append(cap.name)
            continue
        device = cap.device
        H_hat = normalise_(H_raw.to(device=device, dtype=torch.float32 if H_raw.dtype != torch.float64 else H_raw.dtype))
        S_hat = normalise_(S_raw.to(device=device, dtype=H_hat.dtype))
        if cap.H is None or cap.H.shape != H_hat.shape or cap.S.shape != S_hat.shape or cap.H.dtype != H_hat.dtype:
            cap.H = torch.ones_like(H_hat)
            cap.S = torch.ones_like(S_hat)
        fold_(cap.H, H_hat, gamma)
        fold_(cap.S, S_hat, gamma)
        report.updated.append(cap.name)
    return report

