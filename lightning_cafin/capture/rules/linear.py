"""Layers whose forward is ``x @ W.T + b`` (``nn.Linear``) or ``x @ W + b`` (``Conv1D``).

``H`` has one entry per input feature (the mean of ``x**2`` over every row of the
flattened input) plus a ones column for the bias; ``S`` one per output feature.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from .base import KernelPlan, LayerRule, ParamSlot, channel_sums, sum_of_squares


class LinearRule(LayerRule):
    """``nn.Linear`` and its subclasses; ``transposed=True`` for a weight stored ``in x out``
    (``transformers.pytorch_utils.Conv1D``, GPT-2's projections)."""

    kind = "linear"

    def __init__(self, transposed: bool = False) -> None:
        self.transposed = transposed
        if transposed:
            self.kind = "linear_transposed"

    def _in_features(self, module: nn.Module) -> int:
        return module.weight.shape[0] if self.transposed else module.weight.shape[-1]

    def supports(self, module: nn.Module) -> bool:
        return isinstance(getattr(module, "weight", None), Tensor) and module.weight.dim() == 2

    def slots(self, module: nn.Module) -> list[ParamSlot]:
        k = self._in_features(module)
        out = [ParamSlot("weight", 0, k, transposed=self.transposed)]
        if getattr(module, "bias", None) is not None:
            out.append(ParamSlot("bias", k, 1))
        return out

    def input_partial(self, module, x):
        h = channel_sums(x, -1, True)
        if h is not None:
            return h, float(x.numel() // max(x.shape[-1], 1))
        x = x.reshape(-1, x.shape[-1])
        return sum_of_squares(x, 0), float(x.shape[0])

    def output_partial(self, module, s):
        sv = channel_sums(s, -1, True)
        if sv is not None:
            return sv, float(s.numel() // max(s.shape[-1], 1))
        s = s.reshape(-1, s.shape[-1])
        return sum_of_squares(s, 0), float(s.shape[0])

    def finalize(self, module, h, hn, s, sn):
        H = h / hn
        if getattr(module, "bias", None) is not None:
            H = torch.cat([H, H.new_ones(1)])
        return H, s / sn

    def kernel_plan(self, module, h, hn) -> Optional[KernelPlan]:
        return KernelPlan(0, hn, 1.0, getattr(module, "bias", None) is not None)

    def oracle(self, module, x, s):
        from ... import spec

        return spec.linear_stats(module, x, s)

    def __repr__(self) -> str:
        return f"LinearRule(transposed={self.transposed})"
