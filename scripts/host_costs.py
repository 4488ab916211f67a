"""Where a capture step's host time goes: each extension call a capture step makes per
layer, timed alone beside a one-element torch op, and the host time per captured layer that
a capture step adds to a normal one on small models of the workloads' layer structure.

    python scripts/host_costs.py
    python scripts/host_costs.py --device cpu --steps 2 --rounds 2   # a smoke run (the layers only)

Why: where a capture step is host-bound (bf16 + channels_last ResNet-18, the GPT's
forward), what it costs above a normal step is host time; ``profile_capture.py`` breaks
that down under ``torch.profiler``, whose own cost per recorded op inflates every figure.
This times without a profiler:

* each call alone (``--calls`` calls a round, ``--rounds`` rounds, synchronised between
  rounds so that the device never holds the host back, the median per call): the
  statistics ops on small tensors (``channel_stats``, ``layer_stats`` of a linear layer and
  of a 3 x 3 channels_last convolution, ``norm_stats``), and a layer's tap registrations
  (``TapPlan.tap``, ``tap_gradient``, ``tap_read``), each on a fresh layer output whose
  making is not timed; a GPU only;
* ``Trainer.host_phases`` (the bench's: host ms of the forward with the loss, the backward
  and the optimizer step, from a synchronised device), normal and capture steps
  interleaved ``--steps`` times each, the median of the paired differences per captured
  layer, on the GPT's 12 blocks at width 64 (74 captured layers) under bf16 autocast and
  in float32, and ResNet-18 at width 8 (41 layers) in bf16 + channels_last and float32:
  the workloads' layers, each so small that the device waits for the host throughout.  The
  statistics run on the current stream (``capture_stream=False``, what ``"auto"`` chooses
  where the host is the bottleneck): ``"auto"``'s trials would run some of the timed
  capture steps on the side stream, whose ordering costs the host more per layer.

On the H200 at 45e49de, a first form of this script (``capture_stream="auto"``) gave: a one-element torch op 7.1 us,
``channel_stats`` 5.9, ``layer_stats`` 7.7 (linear) and 11.2 (3 x 3 convolution),
``norm_stats`` 5.9; a capture step's host above a normal one per layer (forward, backward,
step): the GPT 9.5 / 12.7 / 5.7 us in bf16 and 4.4 / 12.2 / 4.2 in float32, ResNet-18
13.0 / 25.0 / 8.9 in bf16 + channels_last and 4.9 / 17.5 / 5.4 in float32.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from typing import Callable, Optional

import torch
from torch import Tensor

from lightning_cafin.bench.host_speed import per_call_us
from lightning_cafin.bench.matrix import NEVER, adafisher
from lightning_cafin.bench.workloads import Workload, script_arguments, workloads
from lightning_cafin.kernels.loader import extension_or_none
from lightning_cafin.models.gpt import GPT


def per_call(fn: Callable[[Tensor], object], make: Callable[[], Tensor], calls: int, rounds: int,
             device: torch.device) -> float:
    """Median host microseconds of ``fn(out)``, each call on a fresh ``make()`` made before the clock."""
    outs: list[Tensor] = []

    def prepare() -> None:
        outs[:] = [make() for _ in range(calls)]

    def block() -> None:
        for out in outs:
            fn(out)

    return per_call_us(block, device, calls, rounds, prepare)["median"]


def call_costs(device: torch.device, calls: int, rounds: int) -> str:
    """Each extension call of a capture step alone, host us per call (a GPU's)."""
    ext = extension_or_none()
    if device.type != "cuda" or ext is None:
        return "calls alone: on a GPU with the extension only"
    x = torch.randn(2, 16, 64, device=device)
    xb, gb = x.bfloat16(), torch.randn(2, 16, 96, device=device, dtype=torch.bfloat16)
    xc, gc = (torch.randn(4, 16, 8, 8, device=device, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
              for _ in range(2))
    conv_op = [1, 3, 3, 1, 1, 1, 1, 1, 1, 1, 8, 8]  # a same 3 x 3 convolution's input_op on 8 x 8 maps
    means, bias_grad, one = torch.randn(16, device=device), torch.randn(16, device=device), torch.zeros(1, device=device)
    w = torch.randn(64, 96, device=device, requires_grad=True)
    sink = ext.TapSink()
    plan = ext.TapPlan(sink, [0, 2, 1], 0.0, 2, True, 0.0, 1.0, 1.0)
    h = torch.zeros(64, device=device)
    cases: dict[str, Callable[[Tensor], object]] = {
        "a one-element torch op (add_)": lambda _: one.add_(1),
        "channel_stats (2, 16, 64) float32": lambda _: ext.channel_stats(x, 2, True, 0.0, False),
        "channel_stats, on the side stream": lambda _: ext.channel_stats(x, 2, True, 0.0, True),
        "layer_stats, a linear layer, bf16": lambda _: ext.layer_stats(xb, gb, [0, 2, 1], 0.0, 2, True, 0.0, False),
        "layer_stats, a 3 x 3 conv, bf16 cl": lambda _: ext.layer_stats(xc, gc, conv_op, 0.0, 1, True, 0.0, False),
        "norm_stats": lambda _: ext.norm_stats(means, bias_grad, 1.0),
        "TapPlan.tap(x, out)": lambda out: plan.tap(x, out, False),
        "TapPlan.tap_gradient(out, h)": lambda out: plan.tap_gradient(out, h, 1.0, False),
        "TapPlan.tap_read(x, out)": lambda out: plan.tap_read(x, out, False),
    }
    lines = [f"calls alone, host us per call (median of {rounds} rounds of {calls}):"]
    for name, fn in cases.items():
        us = per_call(fn, lambda: x @ w, calls, rounds, device)  # (a fresh output with a backward node each)
        if "side stream" in name:
            ext.capture_join()
            ext.capture_release()
        sink.take()
        lines.append(f"  {name:38s} {us:7.2f}")
    return "\n".join(lines)


def layer_models(device: torch.device) -> dict[str, Workload]:
    """The workloads' layer structure, small enough that the device waits for the host."""
    small = workloads(device, quick=True)
    gpt = dataclasses.replace(small["gpt"], make_model=lambda: GPT(128, 64, 12, 2, 16))
    return {"GPT 12 x 64, bf16 autocast": gpt, "GPT 12 x 64, float32": dataclasses.replace(gpt, autocast=None),
            "ResNet-18 width 8, bf16 + channels_last": small["resnet18-bf16cl"],
            "ResNet-18 width 8, float32": small["resnet18"]}


def layer_costs(device: torch.device, steps: int) -> str:
    """A capture step's host time above a normal step's per captured layer, per phase."""
    lines = [f"a capture step above a normal one, host us per captured layer (forward, backward, step; "
             f"median of {steps} interleaved pairs):"]
    for name, wl in layer_models(device).items():
        trainer = adafisher(wl, device, wl.batch(device), TCov=NEVER, capture_stream=False)
        layers = len(trainer.opt.binding.captures)
        for _ in range(3):
            trainer.capture_step()
            trainer.step()
        pairs = []
        for i in range(steps):
            order = (False, True) if i % 2 else (True, False)
            phases = {capture: trainer.host_phases(capture) for capture in order}
            pairs.append([(c - n) * 1e3 / layers for n, c in zip(phases[False], phases[True])])
        diff = [statistics.median(p[j] for p in pairs) for j in range(3)]
        lines.append(f"  {name:40s} {layers:3d} layers " + " ".join(f"{v:7.2f}" for v in diff))
    return "\n".join(lines)


#: the script's counts: flag -> (default, help)
COUNTS = {"calls": (200, "calls per round of each call alone"), "rounds": (9, "rounds of each call alone"),
          "steps": (40, "normal and capture steps of each model")}


def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    return script_arguments(__doc__.split("\n\n")[0], COUNTS, argv, per_workload=False)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse(argv)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"host costs on {name} (torch {torch.__version__})", flush=True)
    print(call_costs(device, args.calls, args.rounds), flush=True)
    print(layer_costs(device, args.steps), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
