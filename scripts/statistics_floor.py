"""The least device time a capture step's statistics can take on the bench's workloads: the
bytes the statistics must read once (every captured layer's input and output gradient), at
the device's memory bandwidth, beside what the capture-step goal allows.

    python scripts/statistics_floor.py                       # the full-size workloads, on the CPU
    python scripts/statistics_floor.py --matrix docs/results/bench-matrix-h100-1b851b1.json

Why: the capture-step goals (issue 16) allow 1 ms above a normal step on ResNet-18 and 5% on
ResNet-50 and the GPT.  The statistics kernels are memory-bound and read each activation and
gradient at least once; where those reads alone at the peak bandwidth come near the
allowance, no kernel tuning meets the goal on the current stream, and only overlap with
the backward's compute (the side stream) or reading less can.

What is counted, and what is not: ``lightning_cafin/bench/floor.py`` (the bench matrix
stores the same figure, with the device's own peak bandwidth, as ``statistics_floor``).
Here the forward runs on the CPU, on a small batch scaled to the workload's, under the
CPU's autocast, which gives these workloads' layers the dtypes CUDA's does (the one
difference that could matter, a layer norm given a bfloat16 input returning float32 on
CUDA and bfloat16 on the CPU, does not arise: the GPT's layer norms take the float32
residual stream).

Bandwidths: the devices' specification figures (``--bandwidth NAME=TB/s``; by default the
H100 SXM's 3.35 and the H200's 4.8), since the CPU cannot ask a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

import torch

from lightning_cafin.bench.floor import capture_allowance_ms, floor_ms, statistics_bytes
from lightning_cafin.bench.matrix import CAPTURE_LIMIT_MS
from lightning_cafin.bench.workloads import NAMES, workloads

DEFAULT_BANDWIDTHS = {"H100": 3.35, "H200": 4.8}


def allowance_ms(matrix: Optional[dict], name: str, wl) -> Optional[float]:
    """What the goal lets a capture step add above a normal step, in ms: 1 ms for the
    ResNet-18s, 5% of the matrix run's step-synchronous normal step for the others (where
    a matrix run is given, its own goal rows say which: ``floor.capture_allowance_ms``)."""
    if matrix is not None and name in matrix["workloads"]:
        return capture_allowance_ms(matrix["workloads"][name])
    return CAPTURE_LIMIT_MS if wl.capture_goal == "ms" else None


def parse_bandwidths(items: Optional[list[str]]) -> dict[str, float]:
    if not items:
        return dict(DEFAULT_BANDWIDTHS)
    out = {}
    for item in items:
        name, _, value = item.partition("=")
        try:
            out[name] = float(value)
        except ValueError:
            raise SystemExit(f"--bandwidth: expected NAME=TB/s (e.g. H100=3.35), got {item!r}") from None
        if not name or out[name] <= 0:
            raise SystemExit(f"--bandwidth: expected NAME=TB/s with a positive figure, got {item!r}")
    return out


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="all", help=f"one of {', '.join(NAMES)}, or all (default)")
    ap.add_argument("--small", type=int, default=2, help="samples in the counted forward (scaled to the batch)")
    ap.add_argument("--bandwidth", action="append", metavar="NAME=TB/s",
                    help="a device's memory bandwidth (repeatable; default H100=3.35 and H200=4.8)")
    ap.add_argument("--matrix", type=Path, help="a bench matrix JSON whose normal steps set the 5%% allowances")
    ap.add_argument("--resnet50-batch", type=int, default=128,
                    help="ResNet-50's batch: the bench sizes it to the GPU's memory, 128 on an 80 GB+ one "
                         "(default %(default)s), which the CPU cannot ask")
    ap.add_argument("--quick", action="store_true", help="the tiny workloads (a smoke run)")
    args = ap.parse_args(argv)
    names = NAMES if args.workload == "all" else (args.workload,)
    if any(n not in NAMES for n in names):
        raise SystemExit(f"--workload: unknown workload {args.workload!r}; choose from {', '.join(NAMES)} or all")
    for flag, value in (("--small", args.small), ("--resnet50-batch", args.resnet50_batch)):
        if value < 1:
            raise SystemExit(f"{flag} must be at least 1, got {value}")
    bandwidths = parse_bandwidths(args.bandwidth)
    matrix = json.loads(args.matrix.read_text())["matrix"] if args.matrix else None
    wls = workloads(torch.device("cpu"), quick=args.quick)
    head = ["workload", "layers", "inputs MB", "gradients MB"] + [f"floor ms {n}" for n in bandwidths] + ["allowance ms"]
    print(" | ".join(head))
    for name in names:
        wl = wls[name]
        batch = args.resnet50_batch if name == "resnet50" and not args.quick else None
        read = statistics_bytes(wl, torch.device("cpu"), args.small, batch)
        floors = [floor_ms(read, tb * 1e12) for tb in bandwidths.values()]
        allow = allowance_ms(matrix, name, wl)
        print(" | ".join([name, str(read.layers), f"{read.inputs / 1e6:.0f}", f"{read.gradients / 1e6:.0f}"]
                         + [f"{f:.2f}" for f in floors] + ["-" if allow is None else f"{allow:.2f}"]))
    if args.matrix:
        print(f"(allowances from the normal steps of {args.matrix})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
