"""The shadow baseline step: the same update replayed by another backend on copies.

Just before the live update, the parameters that will move, their gradients and their
state are copied; just after it, the baseline backend (the ``reference`` oracle by
default) applies the same update to the copies with the same factors, and the two
results are compared.  Nothing live is touched by the replay.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor

from ..backends import StepBackend, StepBatch
from ..backends.sharding import local, local_view


@dataclass
class _Entry:
    group: int
    live: Tensor
    param: Tensor
    grad: Tensor
    exp_avg: Tensor
    step: Tensor


@dataclass
class Snapshot:
    entries: list[_Entry] = field(default_factory=list)
    grad_scale: Optional[Tensor] = None


@dataclass(frozen=True)
class Divergence:
    max_abs: float  # largest |fused - baseline| over every updated element
    rel: float  # max_abs / largest |baseline| element


def take_snapshot(opt: Any) -> Snapshot:
    """Copies of everything the coming update reads and writes (a sharded parameter's local shard)."""
    snap = Snapshot(grad_scale=None if getattr(opt, "grad_scale", None) is None else opt.grad_scale.clone())
    for gi, group in enumerate(opt.param_groups):
        for p in group["params"]:
            if p.grad is None:
                continue
            state = opt.state.get(p, {})
            mine = local(p).detach()
            m = local(state["exp_avg"]).clone() if "exp_avg" in state else torch.zeros_like(mine)
            k = state["step"].detach().cpu().clone() if "step" in state else torch.zeros((), dtype=torch.float32)
            snap.entries.append(_Entry(gi, p, mine.clone(), local(p.grad).detach().clone(), m, k))
    return snap


def replay(opt: Any, snap: Snapshot, backend: StepBackend, found_inf: Optional[Tensor] = None) -> None:
    """Apply the update to the snapshot's copies with ``backend`` and the optimizer's current factors.

    ``found_inf`` is the live step's loss-scaler flag: a step the live update skipped on
    the device is skipped by the baseline too (the baseline may read it on the host)."""
    for gi, group in enumerate(opt.param_groups):
        mine = [e for e in snap.entries if e.group == gi]
        if not mine:
            continue
        batch = StepBatch(
            [e.param for e in mine], [e.grad for e in mine], [e.exp_avg for e in mine], [e.step for e in mine],
            [local_view(e.live, opt.fisher_view(e.live)) for e in mine], opt.factors_version,
        )
        backend.step(batch, opt.hyper(group), snap.grad_scale, found_inf)


def divergence(snap: Snapshot) -> Divergence:
    """How far the live update landed from the replayed baseline."""
    max_abs, scale = 0.0, 0.0
    with torch.no_grad():
        for e in snap.entries:
            diff = (local(e.live).detach().float() - e.param.float()).abs().max()
            max_abs = max(max_abs, float(diff))
            scale = max(scale, float(e.param.float().abs().max()))
    return Divergence(max_abs, max_abs / scale if scale > 0 else 0.0)
