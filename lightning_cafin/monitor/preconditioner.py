"""The preconditioner's health: what ``F = S*H + Lambda`` looks like after each capture.

For one layer with factors ``S`` (length m) and ``H`` (length n) the preconditioned
elements have ``F[i, j] = S[i] * H[j] + Lambda``.  Without ever forming the m x n
matrix this module reports, per layer and aggregated per layer type and over the model:

* ``F_min`` / ``F_max``: the range of ``F`` (the extremes of an outer product are
  products of the vectors' extremes);
* ``lambda_dominated``: the share of elements where ``S*H < Lambda``, i.e. where the
  damping outweighs the curvature term (counted with a sorted ``H`` and one
  ``searchsorted`` per row);
* ``factor_change``: ``||S H^T - S0 H0^T||_F / ||S0 H0^T||_F`` against the previous
  capture (from four dot products).

Cost: on a capture step the factor vectors are copied into two flat device buffers
(two ``cat`` kernels, no host read).  The statistics are computed on the device and read
with one transfer on logging steps only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from .tags import ALL_LAYERS

KEYS = ("F_min", "F_max", "lambda_dominated", "factor_change")


@dataclass(frozen=True)
class _Layout:
    names: tuple[str, ...]
    types: tuple[str, ...]
    s_len: tuple[int, ...]
    h_len: tuple[int, ...]


@dataclass
class FactorSnapshot:
    """Copies of every layer's factors taken right after one capture step."""

    layout: _Layout
    S: Tensor  # every layer's S, concatenated (float64)
    H: Tensor

    def layer(self, i: int) -> tuple[Tensor, Tensor]:
        s0 = sum(self.layout.s_len[:i])
        h0 = sum(self.layout.h_len[:i])
        return self.S[s0 : s0 + self.layout.s_len[i]], self.H[h0 : h0 + self.layout.h_len[i]]


def take_factor_snapshot(factors: dict) -> Optional[FactorSnapshot]:
    """Flat copies of ``optimizer.factors()`` (``None`` when no layer has factors yet)."""
    items = [factors[name] for name in sorted(factors)]
    if not items:
        return None
    device = items[0].S.device
    layout = _Layout(
        tuple(f.name for f in items), tuple(f.layer_type for f in items),
        tuple(f.S.numel() for f in items), tuple(f.H.numel() for f in items),
    )
    with torch.no_grad():
        S = torch.cat([f.S.detach().reshape(-1).to(device, torch.float64) for f in items])
        H = torch.cat([f.H.detach().reshape(-1).to(device, torch.float64) for f in items])
    return FactorSnapshot(layout, S, H)


def _layer_stats(S: Tensor, H: Tensor, Lambda: float, prev: Optional[tuple[Tensor, Tensor]]) -> Tensor:
    """``[sh_min, sh_max, dominated_count, change]`` of one layer, on the device (float64)."""
    ext = torch.stack([S.min() * H.min(), S.min() * H.max(), S.max() * H.min(), S.max() * H.max()])
    h_sorted = H.sort().values
    n = H.numel()
    # S[i]*H[j] < Lambda  <=>  H[j] < Lambda/S[i] for S[i] > 0;  H[j] > Lambda/S[i] for S[i] < 0
    safe = torch.where(S == 0, torch.ones_like(S), S)
    threshold = Lambda / safe
    below = torch.searchsorted(h_sorted, threshold, side="left")
    above = n - torch.searchsorted(h_sorted, threshold, side="right")
    per_row = torch.where(S > 0, below, torch.where(S < 0, above, torch.full_like(below, n if Lambda > 0 else 0)))
    count = per_row.sum().to(torch.float64)
    if prev is None or prev[0].shape != S.shape or prev[1].shape != H.shape:
        change = torch.full((), float("nan"), dtype=torch.float64, device=S.device)
    else:
        S0, H0 = prev
        new_sq = S.dot(S) * H.dot(H)
        old_sq = S0.dot(S0) * H0.dot(H0)
        cross = S.dot(S0) * H.dot(H0)
        diff = (new_sq - 2 * cross + old_sq).clamp_min(0).sqrt()
        change = torch.where(old_sq > 0, diff / old_sq.sqrt(), torch.zeros_like(diff))
    return torch.stack([ext.min(), ext.max(), count, change])


class PreconditionerHealth:
    """Snapshots on capture steps, statistics on logging steps.

    Args:
        histogram_layers: how many layers (the first, by name) or which layer names get
            ``S`` / ``H`` histograms.
    """

    def __init__(self, histogram_layers: Union[int, Sequence[str]] = 3) -> None:
        self.histogram_layers = histogram_layers
        self._latest: Optional[FactorSnapshot] = None
        self._previous: Optional[FactorSnapshot] = None
        self._hist_source: Optional[FactorSnapshot] = None  # the last read capture, until its histograms are taken

    def on_capture(self, factors: dict) -> None:
        """Called right after a capture step's factor update: keep copies, read nothing."""
        snap = take_factor_snapshot(factors)
        if snap is None:
            return
        if self._latest is not None:
            self._previous = self._latest
        self._latest = snap

    @property
    def pending(self) -> bool:
        return self._latest is not None

    def read(self, Lambda: float) -> dict[str, dict[str, float]]:
        """Statistics of the latest capture (one host read), by series then key; clears it.

        Series are ``ALL_LAYERS`` (the whole model) and each layer type (``Conv2d``, ...).
        ``F_min`` / ``F_max`` are reported in units of ``Lambda``; ``factor_change`` is
        absent after the first capture (nothing to compare with).
        """
        snap, self._latest = self._latest, None
        if snap is None:
            return {}
        prev = self._previous if self._previous is not None and self._previous.layout == snap.layout else None
        with torch.no_grad():
            rows = [
                _layer_stats(*snap.layer(i), Lambda, prev.layer(i) if prev is not None else None)
                for i in range(len(snap.layout.names))
            ]
            values = torch.stack(rows).tolist()  # the one host read
        self._previous = snap
        self._hist_source = snap
        return aggregate(snap.layout.types, snap.layout.s_len, snap.layout.h_len, values, Lambda)

    def histograms(self) -> dict[str, tuple[Tensor, Tensor]]:
        """``{layer name: (S, H)}`` host copies of the last read capture for the chosen layers."""
        snap, self._hist_source = self._hist_source, None
        if snap is None:
            return {}
        names = snap.layout.names
        chosen = names[: self.histogram_layers] if isinstance(self.histogram_layers, int) else [
            n for n in self.histogram_layers if n in names
        ]
        out = {}
        for name in chosen:
            S, H = snap.layer(names.index(name))
            out[name] = (S.float().cpu(), H.float().cpu())
        return out


def aggregate(types: Sequence[str], s_len: Sequence[int], h_len: Sequence[int], values: list[list[float]],
              Lambda: float) -> dict[str, dict[str, float]]:
    """Per-layer ``[sh_min, sh_max, count, change]`` rows -> per-series statistics."""
    groups: dict[str, list[int]] = {ALL_LAYERS: list(range(len(types)))}
    for i, t in enumerate(types):
        groups.setdefault(t, []).append(i)
    out: dict[str, dict[str, float]] = {}
    for series, idx in groups.items():
        elements = sum(s_len[i] * h_len[i] for i in idx)
        stats = {
            "F_min": (min(values[i][0] for i in idx) + Lambda) / Lambda,
            "F_max": (max(values[i][1] for i in idx) + Lambda) / Lambda,
            "lambda_dominated": sum(values[i][2] for i in idx) / elements,
        }
        changes = [values[i][3] for i in idx if values[i][3] == values[i][3]]  # NaN: no previous capture
        if changes:
            stats["factor_change"] = max(changes)
        out[series] = stats
    return out
