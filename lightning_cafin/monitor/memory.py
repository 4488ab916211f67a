"""Bytes a code span allocates, measured without touching anyone's statistics.

On a GPU this is the delta of the caching allocator's cumulative counter
``allocated_bytes.all.allocated`` (``torch.cuda.memory_stats``) across the span: every
byte the span asked the allocator for, temporaries and anything it keeps alike.  The
global peak statistics are never reset, so a user's or ``DeviceStatsMonitor``'s peak
figures stay theirs.  Reading the counter is host-side bookkeeping: no synchronisation.

On the CPU, where torch keeps no such counter, every tensor an operator creates during
the span is seen through a dispatch mode and its new storage counted; outputs that share
an input's storage (in-place results and views) are not new memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_CUDA_COUNTER = "allocated_bytes.all.allocated"


def _new_storages(args: tuple[Any, ...], kwargs: Optional[dict[str, Any]], out: Any) -> Iterator[torch.UntypedStorage]:
    """The non-empty storages of an operator's outputs that none of its inputs holds, each once
    (an in-place result or a view shares an input's storage: not new memory)."""
    seen = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen and storage.nbytes() > 0:
                seen.add(storage.data_ptr())
                yield storage


class _CpuAllocations(TorchDispatchMode):
    """Sums the bytes of every new storage an operator returns."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func: Callable[..., Any], types: Sequence[type], args: tuple[Any, ...] = (),
                           kwargs: Optional[dict[str, Any]] = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.bytes += sum(storage.nbytes() for storage in _new_storages(args, kwargs, out))
        return out


def cuda_allocated_total(device: torch.device) -> int:
    """The allocator's cumulative count of bytes allocated on ``device`` (never reset here)."""
    return int(torch.cuda.memory_stats(device).get(_CUDA_COUNTER, 0))


class AllocatedMemory:
    """``with AllocatedMemory(device) as m: ...`` then ``m.bytes``: what the span allocated.
    On a GPU, the bytes of the blocks the caching allocator handed out, which can exceed the
    requests: it rounds them up, and serves one from a cached block up to 1 MiB larger whole.

    Also usable as an explicit ``start()`` / ``stop()`` pair; ``stop()`` is safe to call
    when ``start()`` was not, and always pops what ``start()`` pushed.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.bytes: int = 0
        self._base: Optional[int] = None
        self._mode: Optional[_CpuAllocations] = None

    def start(self) -> None:
        if self.device.type == "cuda":
            self._base = cuda_allocated_total(self.device)
        else:
            self._mode = _CpuAllocations()
            self._mode.__enter__()

    def stop(self) -> int:
        if self._base is not None:
            self.bytes = cuda_allocated_total(self.device) - self._base
            self._base = None
        elif self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)
            self.bytes = mode.bytes
        return self.bytes

    def __enter__(self) -> "AllocatedMemory":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class _CpuPeak(TorchDispatchMode):
    """The peak of the bytes of new storages still alive, over the span."""

    def __init__(self) -> None:
        super().__init__()
        self.live: list[tuple[StorageWeakRef, int]] = []
        self.peak = 0

    def __torch_dispatch__(self, func: Callable[..., Any], types: Sequence[type], args: tuple[Any, ...] = (),
                           kwargs: Optional[dict[str, Any]] = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.live = [(ref, n) for ref, n in self.live if not ref.expired()]
        self.live.extend((StorageWeakRef(storage), storage.nbytes()) for storage in _new_storages(args, kwargs, out))
        self.peak = max(self.peak, sum(n for _, n in self.live))
        return out


class TemporaryMemory:
    """``with TemporaryMemory(device) as m: ...`` then ``m.bytes``: the span's temporary peak.

    On a GPU this resets the allocator's peak statistics: for tools that own the process
    (the benchmark), never for a monitor inside someone's training run (use
    :class:`AllocatedMemory` there).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.bytes: int = 0
        self._base: Optional[int] = None
        self._mode: Optional[_CpuPeak] = None

    def __enter__(self) -> "TemporaryMemory":
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            self._mode = _CpuPeak()
            self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.device.type == "cuda":
            self.bytes = max(0, torch.cuda.max_memory_allocated(self.device) - (self._base or 0))
        elif self._mode is not None:
            self._mode.__exit__(*exc)
            self.bytes = self._mode.peak
