"""What a capture step adds to a train step on the GPU, counted in device operations.

A capture step is host-bound on the bench's workloads: each kernel it launches costs the
host about as much as one of the model's own ops (on the H200's host a launch with its
dispatch is tens of microseconds), so the device operations it adds, not their device
time, are what its cost above a normal step follows.  The design allows, per captured
layer, one statistics launch per statistic: a convolution's input statistics (two
passes) and its output gradient's, a linear layer's input and output gradient, a
normalisation layer's one launch from the means it saved and its bias gradient; and per
step a constant: the factor update (one launch per 56 layers), the copy of its NaN flags
to the host and the refresh of the memory-ordered factor copies (channels_last).  A torch
op per layer slipping into the capture path (a dtype copy, a gather, a fill) shows here
as a count above that bound, with the operations that make it up.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from lightning_cafin.bench import MATRIX_WORKLOADS, workloads
from lightning_cafin.bench.matrix import adafisher

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

#: device operations a captured layer may add, by kind
PER_LAYER = {"conv": 3, "linear": 2, "norm": 1}
#: device operations a capture step may add whatever its layers (factor update launches,
#: the NaN flags' copy to the host, the memory-ordered factor copies' refresh, slack)
PER_STEP = 8
NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.LayerNorm, nn.GroupNorm)


def layer_kind(module: nn.Module) -> str:
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return "conv"
    if isinstance(module, NORMS):
        return "norm"
    return "linear"


def device_ops(run, steps: int) -> collections.Counter:
    """Device operations (kernels, copies, fills) per name over ``steps`` calls of ``run``."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run()
        torch.cuda.synchronize()
    ops: collections.Counter = collections.Counter()
    for evt in prof.key_averages():
        on_device = str(evt.device_type).rsplit(".", 1)[-1] == "CUDA"
        if on_device and not getattr(evt, "is_user_annotation", False):
            ops[evt.key] += evt.count
    return ops


@pytest.mark.parametrize("name", MATRIX_WORKLOADS)
def test_a_capture_step_adds_at_most_the_statistics_launches_of_its_layers(name, fused_ok):
    device = torch.device("cuda")
    wl = workloads(device, quick=True)[name]
    trainer = adafisher(wl, device, wl.batch(device), TCov=10**9)
    trainer.steps(2)
    for _ in range(3):  # factors created, then the kept launch made and taken
        trainer.capture_step()
    steps = 2
    normal = device_ops(trainer.step, steps)
    capture = device_ops(trainer.capture_step, steps)

    kinds = collections.Counter(layer_kind(cap.module) for cap in trainer.opt.binding.captures.values())
    bound = sum(PER_LAYER[k] * n for k, n in kinds.items()) + PER_STEP
    added = sum(capture.values()) - sum(normal.values())
    per_step = added / steps
    changes = {k: (capture[k] - normal[k]) / steps for k in set(capture) | set(normal) if capture[k] != normal[k]}
    listing = "\n".join(f"  {v:+6.1f}  {k[:120]}" for k, v in sorted(changes.items(), key=lambda kv: -abs(kv[1])))
    print(f"{name}: {per_step:.1f} device operations added per capture step (bound {bound}, layers {dict(kinds)})\n{listing}")
    assert per_step <= bound, (
        f"{name}: a capture step adds {per_step:.1f} device operations, more than {bound} for its layers "
        f"{dict(kinds)}; per step, by operation:\n{listing}"
    )
    assert per_step >= sum(kinds.values()), f"{name}: {per_step:.1f} added operations for {dict(kinds)}: no statistics?\n{listing}"
