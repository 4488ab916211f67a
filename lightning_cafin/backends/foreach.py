"""The ``foreach`` backend: the update vectorised with ``torch._foreach_*``, on any device.

A handful of multi-tensor operations per (device, dtype) group instead of a Python
loop per parameter.  ``F`` only changes on capture steps (or when ``Lambda`` does),
so it is cached per parameter and rebuilt in place, one layer at a time, only then;
between captures a step reads it like Adam reads its second moment.  The element
operations are the oracle's, in the oracle's order.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from .base import FactorView, StepBackend, StepBatch, StepHyper, group_by_device_and_dtype


class FisherCache:
    """Each factored parameter's materialised ``F``, rebuilt in place when the factors or
    ``Lambda`` change (kept by the dispatcher with the batch, see ``prepare``)."""

    def __init__(self, previous: Optional["FisherCache"] = None, params: Optional[list[Tensor]] = None) -> None:
        # id(param) -> (factors_version, Lambda, F); the parameter is kept so its id stays its own.
        # Only the entries of ``params`` (the batch now) carry over: a sharded parameter's local
        # tensor is a new object at each plan, and an entry per object would pile up.
        keep = None if params is None else {id(p) for p in params}
        self._entries: dict[int, tuple[int, float, Tensor, Tensor]] = {} if previous is None else {
            k: e for k, e in previous._entries.items() if keep is None or k in keep}

    def fisher(self, p: Tensor, view: FactorView, Lambda: float, version: int) -> Tensor:
        entry = self._entries.get(id(p))
        if entry is not None and entry[0] == version and entry[1] == Lambda and entry[2].shape == p.shape:
            return entry[2]
        buf = entry[2] if entry is not None and entry[2].shape == p.shape and entry[2].dtype == p.dtype else None
        if buf is None:
            buf = torch.empty_like(p, memory_format=torch.contiguous_format)
        cols = view.H[view.col_offset : view.col_offset + view.ncols]
        torch.mul(view.S[:, None], cols[None, :], out=buf.view(view.S.shape[0], view.ncols))
        buf.add_(Lambda)
        self._entries[id(p)] = (version, Lambda, buf, p)
        return buf

    def nbytes(self) -> int:
        return sum(e[2].numel() * e[2].element_size() for e in self._entries.values())


class ForeachBackend(StepBackend):
    name = "foreach"

    def prepare(self, batch: StepBatch, previous: Any = None) -> FisherCache:
        return FisherCache(previous if isinstance(previous, FisherCache) else None, batch.params)

    @torch.no_grad()
    def step(
        self,
        batch: StepBatch,
        hyper: StepHyper,
        grad_scale: Optional[Tensor] = None,
        found_inf: Optional[Tensor] = None,
        prepared: Any = None,
    ) -> None:
        if found_inf is not None and found_inf.item() != 0:
            return
        cache = prepared if isinstance(prepared, FisherCache) else FisherCache()
        groups = group_by_device_and_dtype(batch.params)  # one group when the dispatcher made the batch
        scale = None if grad_scale is None else float(grad_scale.item())
        for idx in groups.values():
            self._step_group(batch, idx, hyper, scale, cache)

    def _step_group(
        self, batch: StepBatch, idx: list[int], hyper: StepHyper, scale: Optional[float], cache: FisherCache
    ) -> None:
        params = [batch.params[i] for i in idx]
        grads: list[Tensor] | tuple[Tensor, ...] = [batch.grads[i] for i in idx]
        exp_avgs = [batch.exp_avgs[i] for i in idx]
        steps = [batch.steps[i] for i in idx]
        beta, lr, wd = hyper.beta, float(hyper.lr), hyper.weight_decay

        if scale is not None:
            grads = torch._foreach_div(grads, scale)
        torch._foreach_add_(steps, 1)
        bcs = [1 - beta ** float(k.item()) for k in steps]

        if not hyper.decoupled and wd != 0:
            grads = torch._foreach_add(grads, params, alpha=wd)
        torch._foreach_mul_(exp_avgs, beta)
        torch._foreach_add_(exp_avgs, grads, alpha=1 - beta)

        views = [batch.views[i] for i in idx]
        factored = [j for j, view in enumerate(views) if view is not None]
        plain = [j for j, view in enumerate(views) if view is None]
        fishers = [cache.fisher(params[j], view, hyper.Lambda, batch.factors_version)
                   for j, view in enumerate(views) if view is not None]

        if hyper.decoupled:
            # p <- p - lr * (m / bc / F + wd * p)
            upd = torch._foreach_div(exp_avgs, bcs)
            if factored:
                f_upd = [upd[j] for j in factored]
                torch._foreach_div_(f_upd, fishers)
            if wd != 0:
                torch._foreach_add_(upd, torch._foreach_mul(params, wd))
            torch._foreach_mul_(upd, lr)
            torch._foreach_sub_(params, upd)
            return

        # p <- p - (lr / bc) * m / F, as addcdiv with value -(lr / bc)
        if factored:
            torch._foreach_addcdiv_(
                [params[j] for j in factored],
                [exp_avgs[j] for j in factored],
                fishers,
                [-(lr / bcs[j]) for j in factored],
            )
        if plain:
            torch._foreach_add_(
                [params[j] for j in plain],
                torch._foreach_mul([exp_avgs[j] for j in plain], [-(lr / bcs[j]) for j in plain]),
            )
