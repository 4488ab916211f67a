"""The least device time a capture step's statistics can take: the bytes they must read
once (every captured layer's input and output gradient) at the device's peak memory
bandwidth.

Why: the statistics kernels are memory-bound, so these reads bound a capture step's added
device time from below, whatever the kernels; beside the capture-step goal (issue 16: 1 ms
above a normal step on ResNet-18, 5% on ResNet-50 and the GPT) the floor says how much of
the allowance no kernel tuning can win back on the current stream (only overlap with the
backward, the side stream, or reading less can), and beside the package's kernel time how
far those kernels are from it.

What is counted, per layer the optimizer binds, from one forward under the workload's
autocast (``statistics_bytes``): the input at the dtype the layer received it, except for a
Linear computing on an autocast copy of an input that has a graph node of its own (e.g.
after a float32 LayerNorm), whose statistics read the copy autograd saved, at the output's
dtype (``capture_tap.h``, ``autocast_copy``), and for a 1 x 1 convolution without padding
only the positions its one tap covers (at stride 2 a quarter of the input, which is what
the extension reads of a channels_last input, ``pointwise_taps`` in ``capture_ops.cpp``);
and the output gradient at the output's dtype.  A training batch norm or a layer norm on
``(B, T, ..., D)`` with a trained bias reads neither (its statistics come from the means it
saved and its bias gradient, ``capture/taps.py``); any other norm counts both.  Not
counted: a 3 x 3 convolution's second read of its border or last row and column
(``BorderTaps``) or its window sums over its per-position maps, the factor update, launch
latency: the floor is below any real figure.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch
from torch import nn

from .workloads import Workload


@dataclass
class StatisticsBytes:
    inputs: int  # bytes of the captured layers' inputs
    gradients: int  # bytes of their output gradients
    layers: int  # captured layers whose statistics read both


def reads_nothing(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether a capture of ``module`` on input ``x`` takes its statistics from what the norm
    saved (its means and bias gradient) rather than by reading ``x`` and its gradient."""
    bias = getattr(module, "bias", None)
    trained_bias = isinstance(bias, torch.Tensor) and bias.requires_grad
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, nn.SyncBatchNorm):
        return trained_bias and module.training
    return isinstance(module, nn.LayerNorm) and trained_bias and x.dim() >= 3


def reads_autocast_copy(module: nn.Module, x: torch.Tensor, output: torch.Tensor) -> bool:
    """Whether a capture reads the autocast copy of ``x`` that autograd saved for a Linear's
    weight (the copy's conditions that one forward shows: a Linear with a trained weight, an
    input with a graph node of its own, an output of another dtype) instead of ``x``."""
    weight = getattr(module, "weight", None)
    return (isinstance(module, nn.Linear) and isinstance(weight, torch.Tensor) and weight.requires_grad
            and x.grad_fn is not None and output.dtype != x.dtype)


def tap_positions_share(module: nn.Module, x: torch.Tensor, output: torch.Tensor) -> float:
    """The share of ``x``'s positions a convolution's statistics need: for a 1 x 1 kernel of one
    group without padding, the positions under its one tap (its output positions over its input
    positions); 1 for any other layer, whose window sums cover the input."""
    if not isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) or module.groups != 1:
        return 1.0
    nd = len(module.kernel_size)
    pads = () if isinstance(module.padding, str) else module.padding  # ("same" and "valid" pad a 1 x 1 kernel by 0)
    if any(k != 1 for k in module.kernel_size) or any(pads):
        return 1.0
    if x.dim() != nd + 2 or output.dim() != nd + 2:
        return 1.0
    return math.prod(output.shape[2:]) / math.prod(x.shape[2:])


def statistics_bytes(wl: Workload, device: torch.device, small: Optional[int] = None,
                     batch: Optional[int] = None) -> StatisticsBytes:
    """What one capture step's statistics read on ``wl``, from a forward of its first ``small``
    samples (all of them where None) on ``device``, scaled to ``batch`` samples (the
    workload's batch where None): every sample adds the same bytes."""
    model = wl.model(device)
    model.train()
    layers = wl.ada_cls(model, lr=wl.lr, weight_decay=wl.weight_decay).binding.captures
    x, _ = wl.batch(device)
    whole = x.shape[0] if batch is None else batch
    if small is not None:
        x = x[:small]
    read = {"inputs": 0, "gradients": 0, "layers": 0}

    def count(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        x = inputs[0]
        if reads_nothing(module, x):
            return
        size = output.element_size() if reads_autocast_copy(module, x, output) else x.element_size()
        read["inputs"] += round(x.numel() * tap_positions_share(module, x, output)) * size
        read["gradients"] += output.numel() * output.element_size()
        read["layers"] += 1

    handles = [cap.module.register_forward_hook(count) for cap in layers.values()]
    try:
        # (with autograd on: whether an input has a graph node of its own decides what is read)
        with torch.enable_grad(), wl.precision(device):
            model(x)
    finally:
        for h in handles:
            h.remove()
    scale = whole / x.shape[0]
    return StatisticsBytes(round(read["inputs"] * scale), round(read["gradients"] * scale), read["layers"])


def peak_bandwidth(device: torch.device) -> Optional[float]:
    """The device's peak memory bandwidth in bytes per second, from its memory clock and bus
    width (double data rate), or None where they are not known (a CPU, an older torch)."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    if not clock_khz or not bus_bits:
        return None
    return 2.0 * clock_khz * 1e3 * bus_bits / 8


def floor_ms(read: StatisticsBytes, bandwidth: float) -> float:
    """Milliseconds to read ``read`` once at ``bandwidth`` bytes per second."""
    return (read.inputs + read.gradients) / bandwidth * 1e3


def statistics_floor(wl: Workload, device: torch.device) -> dict[str, Any]:
    """The bench matrix's ``statistics_floor`` entry: the bytes, the device's peak bandwidth
    (TB/s) and the floor in ms (both None where the bandwidth is not known)."""
    read = statistics_bytes(wl, device)
    bandwidth = peak_bandwidth(device)
    return {**asdict(read), "bandwidth_tbs": None if bandwidth is None else bandwidth / 1e12,
            "floor_ms": None if bandwidth is None else floor_ms(read, bandwidth)}


def capture_allowance_ms(w: dict[str, Any]) -> Optional[float]:
    """What a workload's capture-step goal allows above its normal step, in ms, from its record
    in a matrix run (``w``: its goals and step-synchronous figures): the goal's limit in ms,
    or a ratio's share of the run's normal step; None without such a goal (or normal step)."""
    for g in w.get("goals", []):
        if g["figure"].startswith("sync capture step") and "stream" not in g["figure"] and g.get("limit") is not None:
            if g["unit"] == "ms":
                return float(g["limit"])
            normal = (w.get("sync") or {}).get("normal_ms", {}).get("median")
            return None if normal is None else (g["limit"] - 1.0) * normal
    return None
