"""The device operations a capture step adds to a train step: what its host cost follows.

On the bench's GPU machine a train step is host-bound, and each kernel launch costs the
host about as much as one of the model's own ops (tens of microseconds there), so a
capture step's cost above a normal step follows the launches it adds more than their
device time.  The design allows, per captured layer, one statistics launch per statistic
(``BUDGET``): a convolution's input statistics (two passes) and its output gradient's, a
linear layer's input and output gradient, a normalisation layer's one launch from the
means it saved and its bias gradient; and per step a constant (the factor update, one
launch per 56 layers; the copy of its NaN flags to the host; the refresh of the
memory-ordered factor copies of weights in a dense order other than channels innermost,
``backends/layout.py``).

:func:`capture_launches` counts them with ``torch.profiler`` (kernels, copies and fills on
the device) over normal and capture steps of one trainer.  The profiler's hooks can slow
later launches, so the matrix counts after every timing of its run, on fresh trainers.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

#: device operations a captured layer may add, by kind (``layer_kind``)
BUDGET = {"conv": 3, "linear": 2, "norm": 1}
#: device operations a capture step may add whatever its layers (factor update launches, the
#: NaN flags' copy to the host, the memory-ordered factor copies' refresh, and slack)
BUDGET_PER_STEP = 8
_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.LayerNorm, nn.GroupNorm)
_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def layer_kind(module: nn.Module) -> str:
    """``"conv"``, ``"norm"`` or ``"linear"`` (every other captured layer takes a linear's launches)."""
    if isinstance(module, _CONVS):
        return "conv"
    if isinstance(module, _NORMS):
        return "norm"
    return "linear"


def is_device_operation(evt: Any) -> bool:
    """Whether an averaged profiler event is work on the device (a kernel, copy or fill):
    not a host op (its kernels are listed on their own) and not a region the host marked
    (``Optimizer.step#...``, which on the device spans the kernels inside it and the gaps
    between them)."""
    return str(evt.device_type).rsplit(".", 1)[-1] == "CUDA" and not getattr(evt, "is_user_annotation", False)


def device_operations(fn: Callable[[], object], steps: int) -> collections.Counter:
    """Device operations (kernels, copies, fills) per name over ``steps`` calls of ``fn``, on a GPU."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    ops: collections.Counter = collections.Counter()
    for evt in prof.key_averages():
        if is_device_operation(evt):
            ops[evt.key] += evt.count
    return ops


def capture_launches(optimizer: Any, normal_step: Callable[[], object], capture_step: Callable[[], object],
                     steps: int = 2) -> Optional[dict[str, Any]]:
    """Per step, the device operations of a normal and of a capture train step of
    ``optimizer``'s model (``normal_step`` / ``capture_step`` run one each), what the capture
    step adds (``added``, and ``added_by_operation`` by name), and the budget its layers
    allow (``budget``, from the captured layers by kind).  None without a GPU."""
    if not torch.cuda.is_available():
        return None
    normal = device_operations(normal_step, steps)
    capture = device_operations(capture_step, steps)
    kinds = collections.Counter(layer_kind(cap.module) for cap in optimizer.binding.captures.values())
    changes = {name: (capture[name] - normal[name]) / steps for name in set(capture) | set(normal)
               if capture[name] != normal[name]}
    return {
        "normal": sum(normal.values()) / steps,
        "capture": sum(capture.values()) / steps,
        "added": (sum(capture.values()) - sum(normal.values())) / steps,
        "budget": sum(BUDGET[k] * n for k, n in kinds.items()) + BUDGET_PER_STEP,
        "layers": dict(kinds),
        "added_by_operation": dict(sorted(changes.items(), key=lambda kv: -abs(kv[1]))),
    }
