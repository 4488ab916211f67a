"""A capture step's variants side by side in one process, per workload: the statistics on the
current stream, on the side stream and on a high-priority side stream, and on either stream
with the norm taps' launches in their hooks, each above a normal step.

    python scripts/capture_variants.py --workload resnet50
    python scripts/capture_variants.py --device cpu --quick --steps 2   # a smoke run

Why one process: on H100s whether the side stream's statistics ran beside the backward pass
changed from process to process, and followed the stream (of two side streams in one
process, one had the gain and the other not: ``docs/results/side-stream-priority-h100-e4859e1.txt``),
so variants timed in separate processes compare processes, not variants.  Here every variant
meets the same process, the same two side streams and the same host, in interleaved rounds.

A variant that read the layer inputs' statistics in the forward, on the side stream, was timed
here for the ResNet-50 capture step above its 5% goal and did not pay
(``docs/results/inputs-in-forward-h100-7e7a772.txt``); it was removed.

The norm taps' variants time what ``csrc/deferred_norms.h`` changed: a plain backward's
batch norms and layer norms take one launch at its end where each took one in its hook
(ResNet-50: 53 launches and extension calls a capture step), the same statistics.

What is timed: the workload's AdaFisher(W) with ``TCov`` never and ``capture_stream=True``
(the bench's optimizer), three untimed steps of each variant, then ``--steps`` rounds of a
synchronised normal step and one capture step of each variant, in turn (``bench.timing``'s
``interleaved`` and ``elapsed_ms``); per variant the paired difference from the normal step
(median [p10, p90]) and the ratio; then each variant's over the one it changes (the
high-priority side stream's over the side stream's, the norms-in-hooks steps' over their
stream's).  On a CPU (a smoke run) the streams and settings do not apply: every variant is the
current stream's.
"""

from __future__ import annotations

import argparse
import functools
import sys
from typing import Callable, Optional

import torch

from lightning_cafin.bench.matrix import NEVER, Trainer, adafisher, capture_step_at_high_priority, capture_step_on
from lightning_cafin.bench.timing import diff, elapsed_ms, interleaved, paired, ratio, spread, spread_text
from lightning_cafin.bench.workloads import Workload, print_reports, script_arguments
from lightning_cafin.capture import taps

#: the script's counts: flag -> (default, help)
COUNTS = {"steps": (20, "rounds of a normal step and one capture step of each variant")}


def capture_step_with_norms_in_hooks(trainer: Trainer, stream: bool) -> None:
    """A capture step on ``stream`` whose norm taps launch in their hooks (``taps.deferred_norms``)."""
    with taps.deferred_norms(False):
        capture_step_on(trainer, stream=stream)


#: the capture variants, in report order: name -> the step
VARIANTS: dict[str, Callable[[Trainer], None]] = {
    "current": functools.partial(capture_step_on, stream=False),
    "side": functools.partial(capture_step_on, stream=True),
    "side at high priority": capture_step_at_high_priority,
    "current, norms in hooks": functools.partial(capture_step_with_norms_in_hooks, stream=False),
    "side, norms in hooks": functools.partial(capture_step_with_norms_in_hooks, stream=True),
}
#: the variants that change another, reported over it: variant -> the one it changes
CHANGES = {"side at high priority": "side", "current, norms in hooks": "current", "side, norms in hooks": "side"}


def report(wl: Workload, device: torch.device, args: argparse.Namespace) -> str:
    """One workload's line: the normal step, each variant above it, each side variant over the side stream's."""
    trainer = adafisher(wl, device, wl.batch(device), TCov=NEVER, capture_stream=True)
    steps = {"normal": trainer.step, **{name: functools.partial(step, trainer) for name, step in VARIANTS.items()}}
    for _ in range(3):
        for step in steps.values():
            step()
    times = interleaved({name: functools.partial(elapsed_ms, step, device) for name, step in steps.items()},
                        args.steps)
    normal = times["normal"]
    parts = [f"{wl.name}: {wl.description}; {args.steps} rounds: normal {spread_text(spread(normal))} ms"]
    for name in VARIANTS:
        parts.append(f"{name} +{spread_text(paired(times[name], normal, diff))} ms "
                     f"({paired(times[name], normal, ratio)['median']:.4f}x)")
    for name, base in CHANGES.items():
        r = paired(times[name], times[base], ratio)
        parts.append(f"{name} / {base} {r['median']:.4f}x [{r['p10']:.4f}x, {r['p90']:.4f}x]")
    return "; ".join(parts)


def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    return script_arguments(__doc__.split("\n\n")[0], COUNTS, argv)


def main(argv: Optional[list[str]] = None) -> int:
    return print_reports(parse(argv), report)


if __name__ == "__main__":
    sys.exit(main())
