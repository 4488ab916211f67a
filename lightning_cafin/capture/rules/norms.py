"""Normalisation layers: ``H`` has exactly two entries (the weight's and the bias's column).

Two families, each the direct generalisation of one of the paper's norms
(docs/ADAFISHER_SPEC.md, "Supported modules"):

* **per-channel norms** (``BatchNorm1d/2d/3d``, ``SyncBatchNorm``, ``GroupNorm``): the
  ``BatchNorm2d`` definition with the spatial size being the product of every dim after
  the channel dim (1 for a ``(B, C)`` input);
* **per-feature norms** (``LayerNorm`` over any normalised shape, ``RMSNorm``): the
  ``LayerNorm`` definition on the input seen as ``(..., N)`` with the ``N`` normalised
  elements last; a channels-first layer (``LayerNorm2d``: ``N x C x H x W`` normalised over
  ``C``) is exactly ``permute -> LayerNorm -> permute``, so its statistics are those of the
  LayerNorm on the permuted tensor.  ``RMSNorm`` is a LayerNorm without a bias: the same two
  ``H`` entries are computed (so the normalisation is the same), its weight reads the first.

On CUDA every reduction here is the extension's ``channel_stats`` kernel (any rank, any
channel dim, strided views included); elsewhere the torch ops.  The C++ tap of a batch
norm, or of a layer norm on an input of 3 or more dims, needs neither reduction
(``FusedStats.mean_scale``): autograd has both sums already, the input's as the means the
norm saved, the gradient's as its bias gradient.
"""

from __future__ import annotations

import math
from typing import Optional, cast

import torch
from torch import Tensor, nn

from .base import FusedStats, KernelPlan, LayerRule, ParamSlot, channel_op, channel_sums, stat_dtype


class _TwoColumnRule(LayerRule):
    """``H = [sum(a**2) / B**2, len(a) / B**2]`` and ``S = (sum of gradients)**2 / B``."""

    s_scale_power = 1  # S sums the gradient itself and squares after combining

    def supports(self, module: nn.Module) -> bool:
        return isinstance(getattr(module, "weight", None), Tensor)

    def slots(self, module: nn.Module) -> list[ParamSlot]:
        out = []
        if getattr(module, "weight", None) is not None:
            out.append(ParamSlot("weight", 0, 1))
        if getattr(module, "bias", None) is not None:
            out.append(ParamSlot("bias", 1, 1))
        return out

    def finalize(self, module: nn.Module, h: Tensor, hn: float, s: Tensor, sn: float) -> tuple[Tensor, Tensor]:
        H = torch.stack([h.square().sum() / hn**2, h.new_tensor(h.numel() / hn**2)])
        return H, s.square() / sn

    def kernel_plan(self, module: nn.Module, h: Tensor, hn: float) -> Optional[KernelPlan]:
        return KernelPlan(1, hn**2, h.numel() / hn**2, False)


class ChannelNormRule(_TwoColumnRule):
    """Per-channel norms: channel dim 1, every later dim spatial."""

    def __init__(self, kind: str = "batchnorm") -> None:
        self.kind = kind

    def supports(self, module: nn.Module) -> bool:
        return super().supports(module) and getattr(module, "affine", True)

    def input_partial(self, module: nn.Module, x: Tensor) -> tuple[Tensor, float]:
        sp = math.prod(x.shape[2:])
        # quirk: divided by the squared spatial size
        h = channel_sums(x, 1, False, sp**2) if sp > 0 else None
        if h is not None:
            return h, float(x.shape[0])
        dims = (0,) + tuple(range(2, x.dim()))
        return x.sum(dims, dtype=stat_dtype(x)) / (sp**2), float(x.shape[0])

    def fused_stats(self, module: nn.Module, x_shape: torch.Size, grad_shape: torch.Size) -> Optional[FusedStats]:
        sp = math.prod(x_shape[2:])
        if len(x_shape) < 2 or len(grad_shape) < 2 or sp <= 0:
            return None
        # a batch norm's per-channel input sum over (batch, spatial) is its batch mean * B * sp,
        # here divided by sp**2 (GroupNorm's saved means are per group: none)
        mean_scale = x_shape[0] / sp if self.kind == "batchnorm" else 0.0
        return FusedStats(channel_op(1, False), float(sp**2), 1, False, 0.0, float(x_shape[0]), float(grad_shape[0]),
                          float(mean_scale))

    def output_partial(self, module: nn.Module, s: Tensor) -> tuple[Tensor, float]:
        sv = channel_sums(s, 1, False)
        if sv is not None:
            return sv, float(s.shape[0])
        return s.sum((0,) + tuple(range(2, s.dim())), dtype=stat_dtype(s)), float(s.shape[0])

    def oracle(self, module: nn.Module, x: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
        from ... import spec

        return spec.channel_norm_stats(module, x, s)

    def __repr__(self) -> str:
        return f"ChannelNormRule({self.kind!r})"


class FeatureNormRule(_TwoColumnRule):
    """LayerNorm-style norms over the weight's shape: trailing dims, or dim 1 when ``channels_first``."""

    def __init__(self, kind: str = "layernorm", channels_first: bool = False, with_bias: bool = True) -> None:
        self.kind = kind + ("_channels_first" if channels_first else "")
        self.channels_first = channels_first
        self.with_bias = with_bias

    def slots(self, module: nn.Module) -> list[ParamSlot]:
        slots = super().slots(module)
        return slots if self.with_bias else [s for s in slots if s.role == "weight"]

    def _view(self, module: nn.Module, t: Tensor) -> Tensor:
        """``t`` as ``(..., N)``: the normalised elements flattened into the last dim."""
        if self.channels_first and t.dim() >= 2:
            t = t.movedim(1, -1)
        shape = cast(Tensor, module.weight).shape  # supports() checked it is a tensor
        nd = len(shape)
        if nd != 1 and t.dim() >= nd and tuple(t.shape[t.dim() - nd :]) == tuple(shape):
            t = t.reshape(*t.shape[: t.dim() - nd], -1)
        return t

    def input_partial(self, module: nn.Module, x: Tensor) -> tuple[Tensor, float]:
        x = self._view(module, x)
        # quirk: reduce every dim except dim 1, not the normalised last dim
        dims = [d for d in range(x.dim()) if d != 1]
        dn = math.prod(x.shape[d] for d in dims if d != 0)
        h = channel_sums(x, 1, False, dn**2) if x.dim() >= 2 and dn > 0 else None
        if h is not None:
            return h, float(x.shape[0])
        return x.sum(dims, dtype=stat_dtype(x)) / (dn**2), float(x.shape[0])

    def fused_stats(self, module: nn.Module, x_shape: torch.Size, grad_shape: torch.Size) -> Optional[FusedStats]:
        # only where the input needs no view: one normalised dim, last
        if self.channels_first or cast(Tensor, module.weight).dim() != 1 or len(x_shape) < 2 or len(grad_shape) < 2:
            return None
        dn = math.prod(x_shape[2:])
        if dn <= 0:
            return None
        # a layer norm's sum over (batch, ..., normalised) per dim-1 index is the sum of its saved
        # row means times N (the normalised size), here divided by dn**2 (a 2-D input's dim 1 is
        # the normalised dim: none; RMSNorm saves no means and has no bias: none)
        mean_scale = x_shape[-1] / dn**2 if self.with_bias and len(x_shape) >= 3 else 0.0
        return FusedStats(channel_op(1, False), float(dn**2), -1, False, 0.0, float(x_shape[0]), float(grad_shape[0]),
                          float(mean_scale))

    def output_partial(self, module: nn.Module, s: Tensor) -> tuple[Tensor, float]:
        s = self._view(module, s)
        sv = channel_sums(s, -1, False) if s.dim() >= 2 else None
        if sv is not None:
            return sv, float(s.shape[0])
        return s.sum(tuple(range(s.dim() - 1)), dtype=stat_dtype(s)), float(s.shape[0])

    def oracle(self, module: nn.Module, x: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
        from ... import spec

        return spec.layernorm_stats(module, x, s, channels_first=self.channels_first)

    def __repr__(self) -> str:
        return f"FeatureNormRule({self.kind!r}, channels_first={self.channels_first}, with_bias={self.with_bias})"
