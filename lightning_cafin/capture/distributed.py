"""Reducing the statistics of a capture step across data-parallel ranks.

The partial sums are linear in the batch, so summing them over ranks gives the
statistics of the global batch.  Two details make that exact and safe:

* DDP averages gradients over ranks, so the true output gradient of the global loss is
  each rank's local one divided by the world size; the ``S`` sums are divided by
  ``world_size ** s_scale_power`` after the reduction.
* A module may not have fired on some rank (a branch not taken there).  The sizes are
  agreed first (a MAX all-reduce of one small tensor), then every rank contributes a
  buffer of the same layout, zeros where it saw nothing: no rank's local state decides
  whether a collective happens, so nothing can deadlock.

Both collectives run only on capture steps, once each, for all layers together.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .hooks import LayerCapture, PendingStats


def distributed_world(group=None) -> int:
    """The data-parallel world size, or 1 when torch.distributed is not in use."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def _collective_device(captures: list[LayerCapture], group) -> torch.device:
    if dist.get_backend(group) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_pending(captures: list[LayerCapture], group: Optional[object] = None) -> None:
    """Replace every capture's pending statistics by their sum over all ranks."""
    world = distributed_world(group)
    if world == 1 or not captures:
        return
    device = _collective_device(captures, group)
    sizes = torch.zeros(len(captures), 2, dtype=torch.int64, device=device)
    for i, cap in enumerate(captures):
        if cap.pending.calls:
            sizes[i, 0], sizes[i, 1] = cap.pending.h.numel(), cap.pending.s.numel()
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=group)
    sizes = sizes.tolist()

    chunks = []
    for cap, (nh, ns) in zip(captures, sizes):
        p = cap.pending
        if p.calls and (p.h.numel() != nh or p.s.numel() != ns):
            raise RuntimeError(
                f"layer {cap.name!r} produced statistics of different sizes on different ranks "
                f"({p.h.numel()}/{p.s.numel()} here, {nh}/{ns} elsewhere): its input shapes differ across ranks"
            )
        if p.calls:
            chunks += [p.h.double().to(device), torch.tensor([p.hn], dtype=torch.float64, device=device),
                       p.s.double().to(device), torch.tensor([p.sn], dtype=torch.float64, device=device)]
        else:
            chunks.append(torch.zeros(nh + ns + 2, dtype=torch.float64, device=device))
    flat = torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.float64, device=device)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)

    offset = 0
    for cap, (nh, ns) in zip(captures, sizes):
        h, hn = flat[offset : offset + nh], float(flat[offset + nh])
        s, sn = flat[offset + nh + 1 : offset + nh + 1 + ns], float(flat[offset + nh + 1 + ns])
        offset += nh + ns + 2
        if nh == 0 and ns == 0:
            cap.pending = PendingStats()
            continue
        dtype = _stat_dtype_of(cap)
        home = cap.device
        s = s / world**cap.rule.s_scale_power
        cap.pending = PendingStats(h.to(home, dtype), hn, s.to(home, dtype), sn, calls=1)



def _stat_dtype_of(cap: LayerCapture) -> torch.dtype:
    """The dtype the rules sum in for this module: float64 for float64 modules, else float32."""
    if cap.pending.calls:
        return cap.pending.h.dtype
    weight = getattr(cap.module, "weight", None)
    return torch.float64 if weight is not None and weight.dtype == torch.float64 else torch.float32
