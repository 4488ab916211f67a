"""Temporary memory of a code span: bytes allocated during it beyond what it started with.

On a GPU this is the caching allocator's peak statistic.  On the CPU, where torch keeps
no such statistic, every tensor an operator creates during the span is tracked through a
dispatch mode, and the peak of those still alive is taken; outputs that share an input's
storage (in-place results and views) are not new memory.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class _CpuAllocations(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live: list[tuple[StorageWeakRef, int]] = []
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
        }
        self.live = [(ref, n) for ref, n in self.live if not ref.expired()]
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage.data_ptr() not in inputs and storage.nbytes() > 0:
                    self.live.append((StorageWeakRef(storage), storage.nbytes()))
                    inputs.add(storage.data_ptr())
        self.peak = max(self.peak, sum(n for _, n in self.live))
        return out


class TemporaryMemory:
    """``with TemporaryMemory(device) as m: ...`` then ``m.bytes``: the span's temporary peak."""

    def __init__(self, device: torch.device):
        self.device = device
        self.bytes: int = 0
        self._base: Optional[int] = None
        self._mode: Optional[_CpuAllocations] = None

    def __enter__(self) -> "TemporaryMemory":
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            self._mode = _CpuAllocations()
            self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            self.bytes = max(0, torch.cuda.max_memory_allocated(self.device) - self._base)
        else:
            self._mode.__exit__(*exc)
            self.bytes = self._mode.peak
