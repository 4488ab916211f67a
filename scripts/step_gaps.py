"""The main stream's idle time inside synchronised training steps, split by its cause, for a
normal step and a capture step with its statistics on the side stream (at default and at high
priority: two side streams in one process) and on the current one.

    python scripts/step_gaps.py --workload resnet50
    python scripts/step_gaps.py --workload gpt --steps 9

Why: a capture step's time above a normal one's is host work or device work, and the two
call for different changes.  A gap between two kernels of the main stream whose second
kernel the host launched only after the gap began is host-bound: the stream ran dry while
the host worked (Python, the taps' planning, launches).  A gap whose next kernel was
launched before it began is held back on the device: a wait on another stream, or the
side stream's kernels holding the multiprocessors (reported: the side stream's kernel time
inside held-back gaps).  On an H100 at 2240a31, ResNet-50's capture step on the side stream
was 2.14 ms longer than a normal one: 0.73 ms more main-stream kernel time, 1.31 ms more
held-back gaps (with 1.47 ms of side kernels inside them) and no host-bound time, so its
statistics kernels, not the host, set its cost; the GPT's 2.17 ms: 0.44 busy, 1.44 held back,
0.32 host-bound (``docs/results/step-gaps-h100-2240a31.txt``).

What is timed: the workload's AdaFisher(W) as the bench trains it (a schedule that never
captures by itself; capture steps asked for with ``capture_next_step``, their stream set as
the bench sets it), after ``--warmup`` steps of each kind; ``--steps`` of each kind,
interleaved in rounds, each profiled alone (``torch.profiler``, CUDA activity only: kernels and the runtime calls that
launched them) between synchronisations; medians.  Gaps under 1 us (back-to-back kernels)
are not counted.  The figures need a GPU: on a CPU the script says so and measures nothing.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
from dataclasses import dataclass
from typing import Iterator, Optional, Union

import torch
from torch.profiler import ProfilerActivity, profile

from lightning_cafin.bench.matrix import NEVER, adafisher, capture_stream_set
from lightning_cafin.bench.workloads import Workload, print_reports, script_arguments
from lightning_cafin.capture.streams import side_priority

#: the script's counts: flag -> (default, help)
COUNTS = {"steps": (5, "profiled steps of each kind"), "warmup": (2, "steps of each kind before them")}

#: gaps shorter than this (us) are the device's own spacing between back-to-back kernels
MIN_GAP_US = 1.0

#: the figures of one step, in report order: name -> heading
FIGURES = {
    "span": "span", "main_busy": "main busy", "main_ours": "main ours", "side_busy": "side busy",
    "host_bound": "host-bound", "host_gaps": "host gaps", "held_back": "held back", "side_in_held": "side in held",
    "side_beside": "side beside", "side_waited": "side waited", "side_tail": "side tail",
    "device_mallocs": "cudaMallocs",
}

#: the allocator's counts whose change over a step is ``device_mallocs``: its calls to the
#: driver (an allocation the cached blocks could not serve, a release of cached blocks)
ALLOCATOR_CALLS = ("num_device_alloc", "num_device_free", "num_alloc_retries")


@dataclass(frozen=True)
class Kernel:
    """One kernel of a profiled step: device start and end (us), its stream, whether it is
    the package's, and when the host's runtime call launched it (us; None where unknown)."""

    start: float
    end: float
    stream: int
    ours: bool
    launched: Optional[float]


def split_gaps(kernels: list[Kernel]) -> dict[str, float]:
    """One step's figures (ms; ``host_gaps`` a count): the main stream (the one with the most
    kernel time) from its first kernel's start to its last one's end, its busy time and the
    package's share of it, the other streams' kernel time, and the main stream's gaps split
    into host-bound (its next kernel launched after the gap began) and held back (launched
    before: a wait, or the other streams' kernels holding the device), with the other
    streams' kernel time inside the held-back gaps; and of the other streams' kernels, their
    time beside the main stream's kernels (``side_beside``) and how long they waited after
    they could have started (``side_waited``: from the later of the end of their stream's
    kernel before and the end of the last main-stream kernel launched before them, the work
    a side stream is ordered after, to their start; kernels of unknown launch not counted),
    and the main stream's gap that the last of them ended in (``side_tail``: the side work
    left when the main stream had nothing else to run, the join's wait).  The first two tell
    a side stream that runs beside the backward pass from one whose kernels start only once
    the main stream's work is done; the third, what of the side work no main work hides."""
    busy: dict[int, float] = {}
    for k in kernels:
        busy[k.stream] = busy.get(k.stream, 0.0) + (k.end - k.start)
    main = max(busy, key=lambda s: busy[s])
    ours = sorted((k for k in kernels if k.stream == main), key=lambda k: k.start)
    side = [k for k in kernels if k.stream != main]
    host = held = side_in_held = 0.0
    host_gaps = 0
    end = ours[0].end
    for k in ours[1:]:
        gap = k.start - end
        if gap > MIN_GAP_US:
            if k.launched is not None and k.launched > end:
                host += gap
                host_gaps += 1
            else:
                held += gap
                side_in_held += sum(max(0.0, min(s.end, k.start) - max(s.start, end)) for s in side)
        end = max(end, k.end)
    beside, waited = side_timing(ours, side)
    tail = tail_gap(ours, max((k.end for k in side), default=None))
    ms = 1e-3
    return {"span": (end - ours[0].start) * ms, "main_busy": busy[main] * ms,
            "main_ours": sum(k.end - k.start for k in ours if k.ours) * ms,
            "side_busy": sum(k.end - k.start for k in side) * ms, "host_bound": host * ms,
            "host_gaps": float(host_gaps), "held_back": held * ms, "side_in_held": side_in_held * ms,
            "side_beside": beside * ms, "side_waited": waited * ms, "side_tail": tail * ms}


def tail_gap(main: list[Kernel], at: Optional[float]) -> float:
    """(us) The main stream's gap (between the end of all its kernels before and its next
    kernel's start) that the time ``at`` falls in; 0 where a main kernel runs at ``at``, none
    starts after it, or ``at`` is None."""
    if at is None:
        return 0.0
    ended = [m.end for m in main if m.start < at]
    later = [m.start for m in main if m.start >= at]
    if not ended or not later or max(ended) >= at:
        return 0.0
    return min(later) - max(ended)


def side_timing(main: list[Kernel], side: list[Kernel]) -> tuple[float, float]:
    """(us) The side kernels' time beside main-stream kernels, and their waits after they
    could have started (``split_gaps``); ``main`` sorted by start."""
    beside = waited = 0.0
    for k in side:
        beside += sum(max(0.0, min(k.end, m.end) - max(k.start, m.start)) for m in main)
    last_end: dict[int, float] = {}
    for k in sorted(side, key=lambda k: k.start):
        before = last_end.get(k.stream)
        last_end[k.stream] = k.end
        if k.launched is None:
            continue
        after = [m.end for m in main if m.launched is not None and m.launched < k.launched]
        after += [] if before is None else [before]
        if after:  # (a first kernel launched before any main-stream kernel waited for nothing known)
            waited += max(0.0, k.start - max(after))
    return beside, waited


#: the step kinds, in a round's first order: name -> the capture step's stream (None: a normal
#: step; HIGH: the side stream at high priority, a second side stream in the process)
HIGH = "high"
StepStream = Union[None, bool, str]
KINDS = {"normal": None, "capture, side stream": True, "capture, high-priority side stream": HIGH,
         "capture, current stream": False}


def allocator_calls(device: torch.device) -> int:
    """The caching allocator's calls to the driver so far (``ALLOCATOR_CALLS``)."""
    stats = torch.cuda.memory_stats(device)
    return sum(int(stats.get(key, 0)) for key in ALLOCATOR_CALLS)


@contextlib.contextmanager
def stream_setting(trainer, stream: StepStream) -> Iterator[None]:
    """Inside: the capture stream (and side-stream priority) of a step of ``stream``'s kind."""
    with side_priority(True) if stream == HIGH else contextlib.nullcontext():
        with contextlib.nullcontext() if stream is None else capture_stream_set(trainer, stream is not False):
            yield


def profiled_step(trainer, device: torch.device, stream: StepStream) -> tuple[list[Kernel], int]:
    """One synchronised step (a capture step with its statistics on the side stream where
    ``stream`` is True, on a high-priority side stream where HIGH, on the current stream
    where False; a normal step where None): its kernels (copies and fills left out) with
    their launch calls' start times, and the allocator's calls to the driver during it."""
    torch.cuda.synchronize(device)
    with stream_setting(trainer, stream):
        if stream is not None:
            trainer.opt.capture_next_step()
        calls = allocator_calls(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            trainer.step()
            torch.cuda.synchronize(device)
        calls = allocator_calls(device) - calls
    events = list(prof.profiler.kineto_results.events())
    on_device = torch.autograd.DeviceType.CUDA
    launched = {e.correlation_id(): e.start_ns() / 1e3 for e in events
                if e.device_type() != on_device and e.name().startswith("cuda")}
    return [Kernel(e.start_ns() / 1e3, e.end_ns() / 1e3, e.device_resource_id(), "lightning_cafin" in e.name(),
                   launched.get(e.correlation_id()))
            for e in events if e.device_type() == on_device and not e.name().startswith(("Memcpy", "Memset"))], calls


def step_figures(trainer, device: torch.device, stream: StepStream) -> dict[str, float]:
    """``split_gaps`` of one ``profiled_step``, with its allocator calls (``device_mallocs``)."""
    kernels, calls = profiled_step(trainer, device, stream)
    return {**split_gaps(kernels), "device_mallocs": float(calls)}


def table(rows: dict[str, list[dict[str, float]]]) -> list[str]:
    """The median of each figure per step kind, then each capture step's above the normal one's."""
    medians = {kind: {f: statistics.median(r[f] for r in runs) for f in FIGURES} for kind, runs in rows.items()}
    for kind in [k for k in medians if k != "normal"]:
        medians[f"{kind.split(', ')[1]} - normal"] = {f: medians[kind][f] - medians["normal"][f] for f in FIGURES}
    width = max(len(k) for k in medians)
    lines = ["  " + f"{'step':>{width}s}" + "".join(f"{h:>13s}" for h in FIGURES.values())]
    for kind, m in medians.items():
        lines.append("  " + f"{kind:>{width}s}" + "".join(f"{m[f]:13.3f}" for f in FIGURES))
    return lines


def report(wl: Workload, device: torch.device, steps: int, warmup: int) -> str:
    if device.type != "cuda":
        return (f"workload {wl.name}: the gaps' split needs a CUDA device (kernel start times and the calls that "
                f"launched them); nothing measured on {device.type}")
    trainer = adafisher(wl, device, wl.batch(device), TCov=NEVER)
    for _ in range(warmup):
        for stream in KINDS.values():
            profiled_step(trainer, device, stream)
    rows: dict[str, list[dict[str, float]]] = {kind: [] for kind in KINDS}
    order = list(KINDS)
    for i in range(steps):
        for kind in order[i % len(order):] + order[:i % len(order)]:  # (each kind first as often as the others)
            rows[kind].append(step_figures(trainer, device, KINDS[kind]))
    del trainer
    torch.cuda.empty_cache()
    return "\n".join([f"workload {wl.name}: {wl.description}; the main stream's time in a synchronised step, ms "
                      f"(host gaps: a count), median of {steps} steps of each kind, interleaved"] + table(rows))


def parse(argv: Optional[list[str]]):
    return script_arguments(__doc__.split("\n\n")[0], COUNTS, argv)


def main(argv: Optional[list[str]] = None) -> int:
    return print_reports(parse(argv), lambda wl, device, a: report(wl, device, a.steps, a.warmup))


if __name__ == "__main__":
    sys.exit(main())
