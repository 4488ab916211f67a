"""How the benchmark times things and reads memory, the same way on a GPU and on the CPU.

``time_ms``/``median_ms``/``extra_ms`` time one call from an idle device with CUDA events
(the wall clock on the CPU).  ``elapsed_ms`` times a block with the wall clock between two
synchronisations, host work included: what a training loop sees.  ``interleaved`` runs
variants in rotated rounds, ``paired`` spreads their per-round ratios or differences.
``device_us_per_call`` gives calls' device time (the profiler's), ``us_per_kernel`` one call's
kernel by kernel.  ``run_peak`` is the allocator's peak over one call (``torch.cuda.max_memory_allocated``
after a reset), or on the CPU the peak of the tensors the call creates
(``monitor.memory.TemporaryMemory``).
"""

from __future__ import annotations

import gc
import math
import random
import statistics
import time
from typing import Any, Callable, Optional, Sequence

import torch
from torch.profiler import ProfilerActivity, profile, record_function

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


def interleaved(fns: dict[str, Callable[[], float]], reps: int) -> dict[str, list[float]]:
    """``reps`` rounds of every fn, the order rotated each round so none always goes first."""
    keys = list(fns)
    out: dict[str, list[float]] = {k: [] for k in keys}
    for r in range(reps):
        for k in keys[r % len(keys):] + keys[: r % len(keys)]:
            out[k].append(fns[k]())
    return out


def paired(num: list[float], den: list[float], op: Callable[[float, float], float]) -> dict[str, Any]:
    """The spread of ``op(num[i], den[i])`` over rounds measured together (``ratio``, ``diff``)."""
    return spread([op(a, b) for a, b in zip(num, den)])


def ratio(a: float, b: float) -> float:
    return a / b


def diff(a: float, b: float) -> float:
    return a - b


def free_memory(device: torch.device) -> None:
    """Collect garbage and give the allocator's cached blocks back, between measurements."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


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


#: the confidence of the intervals the bench reports beside its medians
CONFIDENCE = 0.9


def median_interval(xs: Sequence[float], confidence: float = CONFIDENCE) -> Optional[tuple[float, float]]:
    """A distribution-free interval for the median of what ``xs`` samples: the order
    statistics ``x(k)`` and ``x(n+1-k)`` with the largest ``k`` whose binomial tail
    ``P(Binomial(n, 1/2) < k)`` is at most ``(1 - confidence) / 2`` (so the interval covers
    the median with at least ``confidence``, whatever the distribution, for independent
    samples).  ``None`` for a sample too small for any such interval (n < 5 at 90%).

    Why: a host's step times spread by 10% and more (a shared machine), so a median 2% over
    a goal may say nothing; the bench says a goal is missed only where this interval lies
    wholly above it."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    n = len(xs)
    tail = (1.0 - confidence) / 2.0
    k, below = 0, 0.0  # below: P(Binomial(n, 1/2) < k + 1) as k grows
    while k < n // 2:
        below += math.comb(n, k) / 2.0**n
        if below > tail:
            break
        k += 1
    if k == 0:
        return None
    s = sorted(xs)
    return s[k - 1], s[n - k]


def ratio_of_sums_interval(num: Sequence[float], den: Sequence[float], confidence: float = CONFIDENCE,
                           resamples: int = 4000, seed: int = 0) -> Optional[tuple[float, float]]:
    """A percentile-bootstrap interval for ``sum(num) / sum(den)`` over paired samples
    (blocks timed side by side): the pairs are resampled together, ``resamples`` times with
    a fixed seed (the same data give the same interval).  ``None`` for fewer than 5 pairs."""
    if len(num) != len(den):
        raise ValueError(f"num and den must pair up, got {len(num)} and {len(den)} samples")
    n = len(num)
    if n < 5:
        return None
    rng = random.Random(seed)
    ratios = []
    for _ in range(resamples):
        picks = [rng.randrange(n) for _ in range(n)]
        ratios.append(sum(num[i] for i in picks) / sum(den[i] for i in picks))
    tail = (1.0 - confidence) / 2.0
    return quantile(ratios, tail), quantile(ratios, 1.0 - tail)


def spread(xs: Sequence[float]) -> dict[str, Any]:
    """Median, p10 and p90 of a sample, its size, and ``ci90``: the median's 90% interval
    (:func:`median_interval`, ``[low, high]``; ``None`` for fewer than 5 values)."""
    ci = median_interval(xs)
    return {"median": statistics.median(xs), "p10": quantile(xs, 0.1), "p90": quantile(xs, 0.9), "n": len(xs),
            "ci90": None if ci is None else list(ci)}


def spread_text(sp: dict[str, float]) -> str:
    """A :func:`spread` as the tables print it: ``median [p10, p90]``, two decimals."""
    return f"{sp['median']:.2f} [{sp['p10']:.2f}, {sp['p90']:.2f}]"


def device_us_per_call(calls: list[list[Callable[[], object]]], device: torch.device, reps: int,
                       rounds: int) -> list[list[float]]:
    """Median microseconds per call of every ``calls[i][j]``: on a GPU the device time of the
    kernels each call launches (``torch.profiler``, summed under a ``record_function`` range
    around ``reps`` calls), so that neither the host's launch rate nor the gaps between
    launches count; on a CPU (a smoke run) the host time of the range.  One profiled pass over
    every call per round, ``rounds`` rounds (interleaved), the order rotated each round.

    Each round first runs every call ``reps`` times untimed, inside the profiler: the device
    comes out of the pause between rounds (the profiler's own processing) slower.  Without
    that pass, on one H100, the call timed first in a round took 10% longer than the same call
    timed after 40 ms of other work (the GPT's optimizer step 1189.5 against 1081.5 us,
    ``docs/results/step-first-in-round-h100-a1abb70.txt``).  (Why the device is slower then,
    its clocks or the profiler's start, was not measured; nor, yet, this pass's effect on a GPU.)"""
    on_gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    samples: dict[tuple[int, int], list[float]] = {}
    order = [(i, j) for i, row in enumerate(calls) for j in range(len(row))]
    for row in calls:  # (a warm-up call each: first launches, allocator)
        for fn in row:
            fn()
    for r in range(rounds):
        with profile(activities=activities) as prof:
            for i, j in order:  # (untimed: the device back at speed)
                for _ in range(reps):
                    calls[i][j]()
            shift = r % len(order) if order else 0
            for i, j in order[shift:] + order[:shift]:
                with record_function(f"device_us_per_call/{i}/{j}"):
                    for _ in range(reps):
                        calls[i][j]()
            if on_gpu:
                torch.cuda.synchronize(device)
        for e in prof.events():
            if e.name.startswith("device_us_per_call/") and e.device_type == torch.autograd.DeviceType.CPU:
                i, j = (int(k) for k in e.name.split("/")[1:])
                total = getattr(e, "device_time_total", None) if on_gpu else e.cpu_time_total
                samples.setdefault((i, j), []).append(float(total if total is not None else e.cuda_time_total) / reps)
    if on_gpu and calls and not any(t > 0 for ts in samples.values() for t in ts):
        raise RuntimeError("torch.profiler gave the timed calls no device time (no kernel was attributed to their "
                           "record_function ranges): this torch's profiler cannot time them here")
    return [[statistics.median(samples[(i, j)]) for j in range(len(row))] for i, row in enumerate(calls)]


def kernel_name(name: str) -> str:
    """A profiler's kernel name without its signature, ``void`` and namespaces (its template
    arguments kept: ``window_sums_hwc_kernel<3>`` is not ``window_sums_hwc_kernel<1>``)."""
    s = name.replace("(anonymous namespace)::", "").removeprefix("void ")
    depth = 0
    for i, ch in enumerate(s):  # the signature: the first "(" outside the template arguments
        depth += {"<": 1, ">": -1}.get(ch, 0)
        if ch == "(" and depth == 0:
            s = s[:i]
            break
    s = s.strip()
    lt = s.find("<")
    head, tail = (s, "") if lt < 0 else (s[:lt], s[lt:])
    return head.rsplit("::", 1)[-1] + tail.replace("c10::", "").replace("lightning_cafin::", "")


def us_per_kernel(fn: Callable[[], object], device: torch.device, reps: int) -> dict[str, tuple[float, float]]:
    """One call of ``fn`` broken down: name -> (microseconds per call, launches per call) of
    each kernel (and copy, fill) it runs on a GPU, by the profiler's device time over ``reps``
    calls after a warm-up call; on a CPU (a smoke run) each op's own host time.  Where a
    call's total (``device_us_per_call``) is more than expected, this says which kernel."""
    on_gpu = device.type == "cuda"
    fn()
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            fn()
        sync(device)
    out: dict[str, tuple[float, float]] = {}
    for e in prof.key_averages():
        t = float(getattr(e, "device_time_total", 0) or 0) if on_gpu else float(e.self_cpu_time_total)
        if t > 0:
            name = kernel_name(e.key) if on_gpu else e.key
            us, n = out.get(name, (0.0, 0.0))
            out[name] = (us + t / reps, n + e.count / reps)
    return out
