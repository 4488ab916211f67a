"""Layers whose forward is ``x @ W.T + b`` (``nn.Linear``) or ``x @ W + b`` (``Conv1D``).

``H`` has one entry per input feature (the mean of ``x**2`` over every row of the
flattened input) plus a ones column for the bias; ``S`` one per output feature.
"""

from __future__ import annotations

import math
from typing import Optional, cast

import torch
from torch import Tensor, nn

from .base import FusedStats, KernelPlan, LayerRule, ParamSlot, channel_op, channel_sums, sum_of_squares


def _rows(shape: torch.Size) -> float:
    """How many rows of the last dim a tensor of ``shape`` has (``_last_dim_squares``' count)."""
    return float(math.prod(shape) // max(shape[-1], 1))


def _last_dim_squares(t: Tensor) -> tuple[Tensor, float]:
    """Sums of squares over every dim but the last, and how many rows they summed (the
    capture kernel where it takes ``t``, else torch ops)."""
    sums = channel_sums(t, -1, True)
    if sums is not None:
        return sums, float(t.numel() // max(t.shape[-1], 1))
    t = t.reshape(-1, t.shape[-1])
    return sum_of_squares(t, 0), float(t.shape[0])


class LinearRule(LayerRule):
    """``nn.Linear`` and its subclasses; ``transposed=True`` for a weight stored ``in x out``
    (``transformers.pytorch_utils.Conv1D``, GPT-2's projections)."""

    kind = "linear"

    def __init__(self, transposed: bool = False) -> None:
        self.transposed = transposed
        if transposed:
            self.kind = "linear_transposed"

    def _in_features(self, module: nn.Module) -> int:
        weight = cast(Tensor, module.weight)  # supports() checked it is a 2-D tensor
        return weight.shape[0] if self.transposed else weight.shape[-1]

    def supports(self, module: nn.Module) -> bool:
        weight = getattr(module, "weight", None)
        return isinstance(weight, Tensor) and weight.dim() == 2

    def slots(self, module: nn.Module) -> list[ParamSlot]:
        k = self._in_features(module)
        out = [ParamSlot("weight", 0, k, transposed=self.transposed)]
        if getattr(module, "bias", None) is not None:
            out.append(ParamSlot("bias", k, 1))
        return out

    def input_partial(self, module: nn.Module, x: Tensor) -> tuple[Tensor, float]:
        return _last_dim_squares(x)

    def output_partial(self, module: nn.Module, s: Tensor) -> tuple[Tensor, float]:
        return _last_dim_squares(s)

    def fused_stats(self, module: nn.Module, x_shape: torch.Size, grad_shape: torch.Size) -> Optional[FusedStats]:
        if len(x_shape) == 0 or len(grad_shape) == 0:
            return None
        return FusedStats(channel_op(-1, True), 0.0, -1, True, 0.0, _rows(x_shape), _rows(grad_shape))

    def finalize(self, module: nn.Module, h: Tensor, hn: float, s: Tensor, sn: float) -> tuple[Tensor, Tensor]:
        H = h / hn
        if getattr(module, "bias", None) is not None:
            H = torch.cat([H, H.new_ones(1)])
        return H, s / sn

    def kernel_plan(self, module: nn.Module, h: Tensor, hn: float) -> Optional[KernelPlan]:
        return KernelPlan(0, hn, 1.0, getattr(module, "bias", None) is not None)

    def oracle(self, module: nn.Module, x: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
        from ... import spec

        return spec.linear_stats(module, x, s)

    def __repr__(self) -> str:
        return f"LinearRule(transposed={self.transposed})"
