"""The package's kernels inside real capture steps, one by one in launch order, each with
its median device time over a few profiled capture steps, and their totals per kernel.

    python scripts/step_kernels.py --workload resnet50
    python scripts/step_kernels.py --workload gpt --side     # the statistics on the side stream
    python scripts/step_kernels.py --quick --device cpu --workload resnet18   # a smoke run

Why: ``statistics_bandwidth.py`` times each layer's statistics call out of the step (its
calls back to back, beside torch's sum of the same tensors) and ``profile_capture.py``
sums each kernel name over a step; neither says what one layer's kernels take in the step,
between the backward's own kernels.  The two can differ a lot: on the H200 at 45e49de the
bandwidth script's pass over ResNet-50's layers gave each layer3.x.conv2 call 80-82 us
(27 us for the same call timed on its own, kernel by kernel), while in a capture step its
two kernels took 18.5 + 11.8 us (``docs/results/step-kernels-resnet50-h200-45e49de.txt``).

What is timed: the workload's AdaFisher(W) as the bench trains it (the default backend, a
schedule that never captures by itself, capture steps asked for with
``capture_next_step``), after a few warm-up steps; ``--steps`` capture steps, each profiled
on its own (``torch.profiler``) between synchronisations.  The statistics run on the
current stream unless ``--side``: there no kernel of theirs shares the device with the
backward's, so a kernel's time is its own (on the side stream it includes the wait for
multiprocessors that the backward's kernels hold).  On a CPU (a smoke run) the rows are
the package's host operations and the optimizer's own ranges (``AdaFisher.update_factors``,
...) and their host time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from typing import Optional

import torch
from torch.profiler import ProfilerActivity, profile

from lightning_cafin.bench.matrix import NEVER, adafisher
from lightning_cafin.bench.timing import kernel_name
from lightning_cafin.bench.workloads import Workload, print_reports, script_arguments

#: the script's counts: flag -> (default, help)
COUNTS = {"steps": (3, "profiled capture steps"), "warmup": (3, "capture and normal step pairs before them")}


def step_kernels(wl: Workload, device: torch.device, steps: int, warmup: int, side: bool) -> list[list[tuple[str, float]]]:
    """Per profiled capture step, the package's kernels (their names without signature) and
    their microseconds, in launch order (on a CPU: its host operations)."""
    trainer = adafisher(wl, device, wl.batch(device), TCov=NEVER, capture_stream=side)
    on_gpu = device.type == "cuda"
    for _ in range(warmup):
        trainer.capture_step()
        trainer.step()
    kind = torch.autograd.DeviceType.CUDA if on_gpu else torch.autograd.DeviceType.CPU
    # (a kernel's name starts with its signature's return type; on a CPU the statistics are
    # torch ops, so the optimizer's own ranges stand for them)
    ours = ("void lightning_cafin::", "lightning_cafin::") if on_gpu else ("lightning_cafin::", type(trainer.opt).__name__ + ".")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    runs = []
    for _ in range(steps):
        if on_gpu:
            torch.cuda.synchronize(device)
        with profile(activities=activities) as prof:
            trainer.capture_step()
            if on_gpu:
                torch.cuda.synchronize(device)
        events = sorted((e.start_ns(), e.duration_ns(), e.name()) for e in prof.profiler.kineto_results.events()
                        if e.device_type() == kind and e.name().startswith(ours))
        runs.append([(kernel_name(name), ns / 1e3) for _, ns, name in events])
    return runs


def report(wl: Workload, device: torch.device, steps: int, warmup: int, side: bool) -> str:
    runs = step_kernels(wl, device, steps, warmup, side)
    unit = "device" if device.type == "cuda" else "host"
    stream = "side" if side else "current"
    lines = [f"workload {wl.name}: {wl.description}; the package's {'kernels' if unit == 'device' else 'operations'} "
             f"in a capture step, statistics on the {stream} stream, in launch order, {unit} us, median of {steps} steps"]
    names = [[name for name, _ in run] for run in runs]
    if any(n != names[0] for n in names):
        lines.append("  (the profiled steps launched different kernels: each row is the first step's, its time "
                     "the median over the steps that launched the same kernel there)")
    totals: dict[str, float] = defaultdict(float)
    for i, (name, _) in enumerate(runs[0]):
        us = statistics.median(run[i][1] for run in runs if i < len(run) and run[i][0] == name)
        totals[name.split("(")[0]] += us
        lines.append(f"  {i:4d} {us:9.1f}  {name}")
    lines.append(f"  total {sum(totals.values()):.1f} us: "
                 + "; ".join(f"{name} {us:.1f}" for name, us in sorted(totals.items(), key=lambda kv: -kv[1])))
    return "\n".join(lines)


def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    return script_arguments(__doc__.split("\n\n")[0], COUNTS, argv,
                            {"side": "the statistics on the side stream (default: the current stream)"})


def main(argv: Optional[list[str]] = None) -> int:
    return print_reports(parse(argv), lambda wl, device, a: report(wl, device, a.steps, a.warmup, a.side))


if __name__ == "__main__":
    sys.exit(main())
