"""The ``reference`` backend: the spec's step written as a plain loop, one parameter at a time.

This is the oracle every faster backend is measured against, so it is deliberately
naive: it materialises ``F`` for every factored parameter on every step (as the
authors' code does) and spells the update with the same tensor operations, in the
same order, as the authors' code, so its rounding is theirs.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from .base import StepBackend, StepBatch, StepHyper


def _found_inf(found_inf: Optional[Tensor]) -> bool:
    return found_inf is not None and bool(found_inf.item() != 0)


class ReferenceBackend(StepBackend):
    name = "reference"

    @torch.no_grad()
    def step(
        self,
        batch: StepBatch,
        hyper: StepHyper,
        grad_scale: Optional[Tensor] = None,
        found_inf: Optional[Tensor] = None,
        prepared: Any = None,
    ) -> None:
        if _found_inf(found_inf):
            return
        beta, lr, wd = hyper.beta, float(hyper.lr), hyper.weight_decay
        for p, g, m, k, view in zip(batch.params, batch.grads, batch.exp_avgs, batch.steps, batch.views):
            if grad_scale is not None:
                g = g / grad_scale.to(g.dtype)
            k += 1
            bc = 1 - beta ** float(k.item())
            F = torch.ones_like(p) if view is None else view.fisher(hyper.Lambda, p.shape)
            if hyper.decoupled:
                m.mul_(beta).add_(g, alpha=1 - beta)
                p.sub_(lr * (m / bc / F + wd * p))
            else:
                if wd != 0:
                    g = g.add(p, alpha=wd)
                m.mul_(beta).add_(g, alpha=1 - beta)
                p.addcdiv_(m, F, value=-(lr / bc))
