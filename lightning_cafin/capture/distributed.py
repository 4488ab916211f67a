"""Reducing the statistics of a capture step across data-parallel ranks: one all-reduce.

The partial sums are linear in the batch, so summing them over ranks gives the
statistics of the global batch, under DDP and FSDP2 alike (the hooks see the whole,
unsharded layer in both).  Three details make that exact, safe and cheap:

* DDP and FSDP2 average gradients over ranks, so the true output gradient of the global
  loss is each rank's local one divided by the world size; the ``S`` sums are divided
  by ``world_size ** s_scale_power`` after the reduction.
* A module may not have fired on some rank (a branch not taken there).  Every rank
  contributes a buffer of the same layout, zeros where it saw nothing, so no rank's
  local state decides whether a collective happens and nothing can deadlock.
* The layout (each layer's statistic sizes) is agreed once, by a MAX all-reduce of the
  sizes, and kept.  Later capture steps send one buffer: a flag, each layer's two
  counts, then the sums.  A rank whose statistics do not fit the kept layout (a layer
  firing for the first time, a changed shape) sends its flag and zeros; seeing a flag,
  every rank agrees the layout again and sends again.  In the steady state a capture
  step is one all-reduce of about the sum of the factor lengths; a normal step, none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .layer_capture import LayerCapture, PendingStats

Sizes = tuple[tuple[int, int], ...]


def distributed_world(group: Optional[dist.ProcessGroup] = None) -> int:
    """The data-parallel world size, or 1 when torch.distributed is not in use."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def _collective_device(group: Optional[dist.ProcessGroup]) -> torch.device:
    if dist.get_backend(group) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _stat_dtype_of(cap: LayerCapture) -> torch.dtype:
    """The dtype the rules sum in for this module (float64 for float64 modules, else float32),
    decided from the module alone, so every rank decides alike."""
    weight = getattr(cap.module, "weight", None)
    return torch.float64 if isinstance(weight, Tensor) and weight.dtype == torch.float64 else torch.float32


def _local_sizes(captures: Sequence[LayerCapture]) -> list[Optional[tuple[int, int]]]:
    out: list[Optional[tuple[int, int]]] = []
    for c in captures:
        if c.pending.calls:
            h, s = c.pending.sums()
            out.append((h.numel(), s.numel()))
        else:
            out.append(None)
    return out


@dataclass
class ReductionStats:
    """What the last capture step sent: collectives called and elements all-reduced."""

    collectives: int = 0
    elements: int = 0
    bytes: int = 0


class StatisticsReduction:
    """The capture step's all-reduce of every layer's statistics, with its kept layout."""

    def __init__(self) -> None:
        self._names: tuple[str, ...] = ()
        self._sizes: Optional[Sizes] = None
        #: what the last capture step sent (for the README's figures and the tests)
        self.last = ReductionStats()

    @staticmethod
    def buffer_elements(captures: Sequence[LayerCapture]) -> int:
        """Elements of the all-reduce that the pending statistics of ``captures`` make: a flag,
        two counts per layer and the sums (fixed by the layers' shapes, whatever the batch)."""
        return 1 + sum(2 + sum(size or (0, 0)) for size in _local_sizes(captures))

    def all_reduce(self, captures: Sequence[LayerCapture], group: Optional[dist.ProcessGroup] = None) -> None:
        """Replace every capture's pending statistics by their sum over all ranks."""
        world = distributed_world(group)
        self.last = ReductionStats()
        if world == 1 or not captures:
            return
        names = tuple(c.name for c in captures)
        local = _local_sizes(captures)
        if self._sizes is not None and self._names == names:
            fits = all(mine is None or mine == kept for mine, kept in zip(local, self._sizes))
            if self._reduce(captures, self._sizes, fits, world, group):
                return
        self._names, self._sizes = names, self._agree(local, group)
        if not self._reduce(captures, self._sizes, True, world, group):  # pragma: no cover - sizes just agreed
            raise RuntimeError("the statistics layout changed while it was being agreed")

    def _agree(self, local: list[Optional[tuple[int, int]]], group: Optional[dist.ProcessGroup]) -> Sizes:
        sizes = torch.tensor([list(s) if s is not None else [0, 0] for s in local], dtype=torch.int64,
                             device=_collective_device(group))
        dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=group)
        self.last.collectives += 1
        agreed = tuple((int(h), int(s)) for h, s in sizes.tolist())
        for size, kept in zip(local, agreed):
            if size is not None and size != kept:
                raise RuntimeError(
                    f"a layer produced statistics of different sizes on different ranks ({size[0]}/{size[1]} here, "
                    f"{kept[0]}/{kept[1]} elsewhere): its input shapes differ across ranks"
                )
        return agreed

    def _reduce(self, captures: Sequence[LayerCapture], sizes: Sizes, fits: bool, world: int,
                group: Optional[dist.ProcessGroup]) -> bool:
        """One all-reduce in ``sizes``' layout; False (nothing changed) when some rank did not fit it."""
        device = _collective_device(group)
        dtype = torch.float64 if any(_stat_dtype_of(c) == torch.float64 for c in captures) else torch.float32
        head = [0.0 if fits else 1.0]
        body: list[Tensor] = []
        for cap, (nh, ns) in zip(captures, sizes):
            p = cap.pending
            if fits and p.calls:
                head += [p.hn, p.sn]
                body += [t.reshape(-1).to(device, dtype) for t in p.sums()]
            else:
                head += [0.0, 0.0]
                body.append(torch.zeros(nh + ns, dtype=dtype, device=device))
        flat = torch.cat([torch.tensor(head, dtype=dtype, device=device), *body])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        self.last.collectives += 1
        self.last.elements += flat.numel()
        self.last.bytes += flat.numel() * flat.element_size()
        counts = flat[: len(head)].tolist()  # the one wait for the collective
        if counts[0] != 0:
            return False
        offset = len(head)
        for i, (cap, (nh, ns)) in enumerate(zip(captures, sizes)):
            h, s = flat[offset : offset + nh], flat[offset + nh : offset + nh + ns]
            offset += nh + ns
            hn, sn = counts[1 + 2 * i], counts[2 + 2 * i]
            if hn == 0 and sn == 0:
                cap.pending = PendingStats()
                continue
            home, stat = cap.device, _stat_dtype_of(cap)
            s = s / world**cap.rule.s_scale_power
            cap.pending = PendingStats(h.to(home, stat), hn, s.to(home, stat), sn, calls=1)
        return True
