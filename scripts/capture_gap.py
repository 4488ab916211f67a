"""What a capture step costs above a normal one, per workload, in one short run: the quick
same-machine measure for an A/B of a capture-path change (``scripts/gpu_ab.sh`` with
``AB_CMD``), where the bench's whole matrix takes minutes a workload.

    python scripts/capture_gap.py --workload gpt             # the statistics on the current stream
    python scripts/capture_gap.py --workload resnet50 --side # on the side stream
    python scripts/capture_gap.py --workload resnet18 --auto # on the stream "auto" chooses
    python scripts/capture_gap.py --device cpu --quick --steps 2 --host-steps 0   # a smoke run

Why: the capture-step goals (issue 16: 1 ms above a normal step on ResNet-18, 5% on
ResNet-50 and the GPT) are step-synchronous figures that move with the host more than most
changes move them, so a change is judged against the code without it on one machine, side by
side (``gpu_ab.sh``).  The bench's matrix measures the same figure among a dozen others.

Per workload, one fresh model at full size (``--quick``: tiny) with AdaFisher(W) at
``TCov`` never, its statistics on the current stream (``--side``: the side stream) rather
than ``"auto"``'s choice, whose trials would time some steps on either (``--auto``: built
with ``capture_stream="auto"``, its trials run first, untimed, as the bench's matrix runs
them: ``bench.matrix.choose_stream``): ``--steps`` rounds of a synchronised normal and
capture step, interleaved (``bench.timing.interleaved``, ``elapsed_ms``), after three of
each untimed; the paired differences and ratios (median [p10, p90]); the share of the timed
capture steps that took the factor update kept from the one before (``KeptShare``), as the
matrix's do; then ``--host-steps`` pairs of ``Trainer.host_phases``: the host's forward,
backward and optimizer step above a normal step's, per captured layer (none with ``--host-steps 0``:
the step timings alone).

``--auto`` is there because on an H100 (``docs/results/capture-gap-h100-3900f42.txt``) the
side stream gave ResNet-18 no gain here (+1.04 ms against +1.05 on the current stream) where
the matrix's rotation, on an optimizer built with ``"auto"``, had it at +0.67 against +1.03.
It was not the setting: at e855321, in one process, optimizers built with ``True`` and with
``"auto"`` had no gain, and in later processes both had it (below).

``--pool-streams`` is there because on H100s at e855321
(``docs/results/side-stream-per-process-h100-e855321.txt``) the side stream's gain came or
went with the process, not with the option it was chosen by, the order of the steps, the
warm-up or the bench's other measurements: ResNet-18 +1.02 to +1.09 ms above a normal step
on the side stream in one process (the current stream +1.05 to +1.08), +0.64 to +0.69 (the
current stream +0.99 to +1.03) in the next one on the same machine and in two on another, the
same code.  One explanation it tests: a stream's work goes to one of the device's few
hardware queues (``CUDA_DEVICE_MAX_CONNECTIONS``, 8 by default) in the order streams are
made, and a side stream sharing the current stream's queue waits behind it, as if on the
current stream.  The extension takes its side stream from torch's pool when first needed;
taking ``n`` streams first moves it ``n`` along the pool.  On an H100 at e9a5d2a
(``docs/results/side-stream-queues-h100-e9a5d2a.txt``) a spin on every pooled stream tried ran
beside one on the default stream, made in any order, in the backward pass or not, and with
``CUDA_DEVICE_MAX_CONNECTIONS=1``: the queues do not explain it there.  Of two side streams in
one process (default and high priority), one had the gain and the other not, which one changing
with the process (``docs/results/side-stream-priority-h100-e4859e1.txt``): it follows the stream.

On an H100 at cc8b6d1 a first form of this script measured the GPT's capture step at
+2.02-2.14 ms (1.047x-1.049x) against +2.24-2.32 ms (1.052x-1.053x) without that commit's
change (``docs/results/ab-autocast-copy-h100-cc8b6d1.txt``).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from typing import Optional

import torch

from lightning_cafin.bench.matrix import NEVER, KeptShare, adafisher, choose_stream
from lightning_cafin.bench.timing import diff, elapsed_ms, interleaved, paired, ratio, spread, spread_text
from lightning_cafin.bench.workloads import Workload, print_reports, script_arguments


def report(wl: Workload, device: torch.device, args: argparse.Namespace) -> str:
    """One workload's line: the normal step, the capture step above it, their ratio, the
    share of capture steps that took the kept factor update, and the host's phases above a
    normal step per captured layer."""
    trainer = adafisher(wl, device, wl.batch(device), TCov=NEVER, capture_stream="auto" if args.auto else args.side)
    for _ in range(3):
        trainer.step()
        trainer.capture_step()
    where = "the side stream" if args.side else "the current stream"
    if args.auto:
        chosen = choose_stream(trainer)["side"]  # (None where nothing is timed: a CPU runs no trials)
        where = ("the current stream ('auto' timed no trials)" if chosen is None
                 else f"the {'side' if chosen else 'current'} stream ('auto' chose it)")
    if args.pool_streams:
        where += f", {args.pool_streams} of torch's pooled streams taken first"
    kept = KeptShare(trainer)
    steps = interleaved({"normal": functools.partial(elapsed_ms, trainer.step, device),
                         "capture": functools.partial(elapsed_ms, kept.counted(trainer.capture_step), device)},
                        args.steps)
    above = paired(steps["capture"], steps["normal"], diff)
    times = paired(steps["capture"], steps["normal"], ratio)
    layers = len(trainer.opt.binding.captures)
    line = (f"{wl.name}: {wl.description}; statistics on {where}, {args.steps} interleaved pairs: "
            f"normal {spread_text(spread(steps['normal']))} ms, capture above normal {spread_text(above)} ms, "
            f"capture / normal {times['median']:.4f}x [{times['p10']:.4f}x, {times['p90']:.4f}x]; "
            f"the kept factor update taken by {kept.share:.0%} of them")
    if not args.host_steps:
        return line + "; host phases not measured (--host-steps 0)"
    host = [(trainer.host_phases(False), trainer.host_phases(True)) for _ in range(args.host_steps)]
    per_layer = [statistics.median(c[i] - n[i] for n, c in host) * 1e3 / max(1, layers) for i in range(3)]
    return (line + f"; host above normal per captured layer ({layers} layers, {args.host_steps} pairs), "
            f"forward / backward / step: " + " / ".join(f"{v:.2f}" for v in per_layer) + " us")


#: the script's counts: flag -> (default, help[, least])
COUNTS = {"steps": (30, "interleaved pairs of a normal and a capture step"),
          "host-steps": (10, "pairs of the host's phases, normal then capture (0: not measured)", 0),
          "pool-streams": (0, "streams taken from torch's pool (torch.cuda.Stream()) before anything else, so that "
                              "the side stream is a later one of the pool", 0)}


def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    args = script_arguments(__doc__.split("\n\n")[0], COUNTS, argv,
                            {"side": "the statistics on the side stream (default: the current stream)",
                             "auto": "the stream capture_stream='auto' chooses, its trials run first, untimed"})
    if args.side and args.auto:
        raise SystemExit("--side and --auto each set the statistics' stream: pass one of them (or neither: the "
                         "current stream)")
    if args.pool_streams and args.device != "cuda":
        raise SystemExit(f"--pool-streams takes CUDA streams: pass --device cuda (got --device {args.device})")
    return args


def take_pool_streams(n: int) -> None:
    """Advance torch's pool of CUDA streams by ``n`` (the extension's side stream is the next
    one the pool hands out, once, the first time a statistic goes to the side stream)."""
    for _ in range(n):
        torch.cuda.Stream()


def main(argv: Optional[list[str]] = None) -> int:
    args = parse(argv)
    take_pool_streams(args.pool_streams)
    return print_reports(args, report)


if __name__ == "__main__":
    sys.exit(main())
