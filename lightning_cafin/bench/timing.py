"""How the benchmark times things and reads memory, the same way on a GPU and on the CPU.

``time_ms``/``median_ms``/``extra_ms`` time one call from an idle device with CUDA events
(the wall clock on the CPU).  ``elapsed_ms`` times a block with the wall clock between two
synchronisations, host work included: what a training loop sees.  ``run_peak`` is the
allocator's peak over one call (``torch.cuda.max_memory_allocated`` after a reset), or on
the CPU the peak of the tensors the call creates (``monitor.memory.TemporaryMemory``).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch

from ..monitor.memory import TemporaryMemory


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device) -> float:
    """One call of fn, from an idle device to its completion."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def median_ms(fn: Callable[[], object], device: torch.device, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    return statistics.median(time_ms(fn, device) for _ in range(reps))


def extra_ms(base: Callable[[], object], more: Callable[[], object], device: torch.device, reps: int,
             warmup: int = 2) -> float:
    """Median over interleaved pairs of (time of more - time of base).  Two medians taken
    one after the other drift apart with clocks and allocator state by more than a
    millisecond on a 14 ms step; pairs measured back to back do not."""
    for _ in range(warmup):
        base()
        more()
    return statistics.median(time_ms(more, device) - time_ms(base, device) for _ in range(reps))


def elapsed_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Wall-clock milliseconds of ``fn`` from a synchronised device to a synchronised device."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return (time.perf_counter() - t0) * 1e3


def run_peak(fn: Callable[[], object], device: torch.device) -> tuple[int, int]:
    """``(allocated before, peak during)`` in bytes for one call of ``fn``.

    On a GPU both are the caching allocator's statistics (its peak is reset first); on the
    CPU, which keeps no such statistic, "before" is 0 and the peak is that of the tensors
    the call creates and holds at once."""
    sync(device)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    with TemporaryMemory(device) as mem:
        fn()
        sync(device)
    return before, before + mem.bytes


def quantile(xs: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` by linear interpolation (``q`` in [0, 1])."""
    s = sorted(xs)
    if not s:
        raise ValueError("quantile of no values")
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def spread(xs: Sequence[float]) -> dict[str, float]:
    """Median, p10 and p90 of a sample."""
    return {"median": statistics.median(xs), "p10": quantile(xs, 0.1), "p90": quantile(xs, 0.9), "n": len(xs)}


def spread_text(sp: dict[str, float]) -> str:
    """A :func:`spread` as the tables print it: ``median [p10, p90]``, two decimals."""
    return f"{sp['median']:.2f} [{sp['p10']:.2f}, {sp['p90']:.2f}]"
