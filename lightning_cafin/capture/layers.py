"""Which modules AdaFisher preconditions, and how each turns a forward/backward into statistics.

Each rule produces *partial sums* that are linear in the batch (sums over samples,
plus the count that divides them), so the statistics of several micro-batches, or of
several ranks, combine by plain addition and give exactly the statistics of the whole
batch.  ``finalize`` turns the combined sums into the spec's raw vectors ``H_raw`` and
``S_raw`` (ADAFISHER_SPEC.md, "Supported modules and their two factor vectors").

All statistics are accumulated in float32 (float64 for float64 inputs) whatever the
activation dtype, so float16 sums of squares cannot overflow.

On CUDA tensors (float32, float16, bfloat16) the partial sums come from the extension's
capture kernels (one pass over the tensor, no patches, see ``kernels.py``); the torch ops
below are the fallback everywhere else and the reference the kernels are tested against.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor, nn

import torch.nn.functional as F

from .._conv import conv_output_hw, conv_padding, pad_like_conv
from . import kernels as _kernels
from . import streams as _streams


def stat_dtype(x: Tensor) -> torch.dtype:
    """float64 stays float64; everything else (fp16, bf16, fp32) is summed in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def channel_sums(t: Tensor, dim: int, square: bool, divisor: float = 0.0) -> Optional[Tensor]:
    """The kernels' per-channel ``sum`` (or sum of squares) over every dim but ``dim``,
    divided by ``divisor`` when it is positive; ``None`` where the kernels do not apply."""
    ext = _kernels.ext_for(t)
    if ext is None or t.dim() == 0:
        return None
    return ext.channel_stats(t, dim, square, float(divisor), _streams.side())


def sum_of_squares(x: Tensor, dims) -> Tensor:
    """``sum(x**2)`` over ``dims`` in the statistics dtype, in one pass over ``x``.

    A norm reduction reads ``x`` once and writes only the result: no squared copy and
    no upcast copy of the activation is ever made (squaring the norm costs one rounding).
    """
    return torch.linalg.vector_norm(x, 2, dim=dims, dtype=stat_dtype(x)).square()


@dataclass(frozen=True)
class ParamSlot:
    """Where one of a module's parameters reads its F: ``H[col_offset : col_offset + ncols]``."""

    role: str  # "weight" or "bias"
    col_offset: int
    ncols: int


class LayerRule(ABC):
    """The statistics of one supported module type."""

    kind: str
    #: ``S`` partial sums scale with this power of a loss scale (squared sums: 2).
    s_scale_power: int = 2

    @abstractmethod
    def supports(self, module: nn.Module) -> bool: ...

    @abstractmethod
    def slots(self, module: nn.Module) -> list[ParamSlot]:
        """The columns each of the module's parameters uses, in ``H`` order."""

    @abstractmethod
    def input_partial(self, module: nn.Module, x: Tensor) -> tuple[Tensor, float]:
        """(sum vector, count) of the activation side for one forward call."""

    @abstractmethod
    def output_partial(self, module: nn.Module, s: Tensor) -> tuple[Tensor, float]:
        """(sum vector, count) of the output-gradient side for one backward call."""

    @abstractmethod
    def finalize(self, module: nn.Module, h: Tensor, hn: float, s: Tensor, sn: float) -> tuple[Tensor, Tensor]:
        """Combined partial sums -> (H_raw, S_raw)."""


class LinearRule(LayerRule):
    kind = "linear"

    def supports(self, module: nn.Module) -> bool:
        return isinstance(module, nn.Linear)

    def slots(self, module: nn.Module) -> list[ParamSlot]:
        out = [ParamSlot("weight", 0, module.in_features)]
        if module.bias is not None:
            out.append(ParamSlot("bias", module.in_features, 1))
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
        if module.bias is not None:
            H = torch.cat([H, H.new_ones(1)])
        return H, s / sn


class Conv2dRule(LayerRule):
    """Conv2d: ``H`` from window sums of ``x^2`` over the batch, with no im2col tensor.

    ``H_raw[(c, ki, kj)]`` is the sum, over the batch, the groups and every output
    position, of the squared padded input under kernel tap ``(ki, kj)`` of channel ``c``
    within its group.  Summing ``x^2`` over the batch and the groups first leaves a
    ``(C/g, H, W)`` map; each tap is then one strided slice sum of that map.
    """

    kind = "conv2d"

    def supports(self, module: nn.Module) -> bool:
        return isinstance(module, nn.Conv2d)

    @staticmethod
    def _k(module: nn.Conv2d) -> int:
        return (module.in_channels // module.groups) * module.kernel_size[0] * module.kernel_size[1]

    def slots(self, module: nn.Module) -> list[ParamSlot]:
        K = self._k(module)
        out = [ParamSlot("weight", 0, K)]
        if module.bias is not None:
            out.append(ParamSlot("bias", K, 1))
        return out

    def input_partial(self, module, x):
        if x.dim() == 3:  # unbatched input
            x = x.unsqueeze(0)
        B = x.shape[0]
        Ho, Wo = conv_output_hw(module, tuple(x.shape[-2:]))
        g, (kh, kw) = module.groups, module.kernel_size
        (dh, dw), (sh, sw) = module.dilation, module.stride
        count = float(B * Ho * Wo * self._k(module))
        ext = _kernels.ext_for(x) if module.padding_mode == "zeros" else None
        if ext is not None:  # one pass over x, then the taps of the small batch-reduced map
            left, _, top, _ = conv_padding(module)
            h = ext.conv_input_stats(x, [kh, kw], [sh, sw], [top, left], [dh, dw], g, [Ho, Wo], _streams.side())
            return h, count
        if module.padding_mode == "zeros":
            # zeros square to zeros: reduce the batch first, then pad the small map
            sq = F.pad(sum_of_squares(x, 0), conv_padding(module))  # (C, Hp, Wp)
        else:  # reflect / replicate / circular padding repeats real values
            sq = sum_of_squares(pad_like_conv(module, x), 0)
        sq = sq.reshape(g, -1, *sq.shape[-2:]).sum(0)  # pool the groups: (C/g, Hp, Wp)
        # every tap's window sum at once: the patches of this small map, summed over positions
        taps = F.unfold(sq[None], (kh, kw), dilation=(dh, dw), stride=(sh, sw))  # (1, C/g*kh*kw, Ho*Wo)
        h = taps[0].sum(1)  # (c, ki, kj) order, as the weight
        return h, count

    def output_partial(self, module, s):
        if s.dim() == 3:
            s = s.unsqueeze(0)
        count = float(s.shape[0] * s.shape[2] * s.shape[3])
        sv = channel_sums(s, 1, True)
        if sv is not None:
            return sv, count
        return sum_of_squares(s, (0, 2, 3)), count

    def finalize(self, module, h, hn, s, sn):
        H = h / hn
        if module.bias is not None:
            # The ones column of the patch matrix: (B * g * L) / (B * L * K).
            H = torch.cat([H, H.new_full((1,), module.groups / self._k(module))])
        return H, s / sn


class _TwoColumnRule(LayerRule):
    """BatchNorm2d and LayerNorm: ``H`` has exactly two entries (weight, bias)."""

    s_scale_power = 1  # S sums the gradient itself and squares after combining

    def slots(self, module: nn.Module) -> list[ParamSlot]:
        out = []
        if module.weight is not None:
            out.append(ParamSlot("weight", 0, 1))
        if module.bias is not None:
            out.append(ParamSlot("bias", 1, 1))
        return out

    def finalize(self, module, h, hn, s, sn):
        H = torch.stack([h.square().sum() / hn**2, h.new_tensor(h.numel() / hn**2)])
        return H, s.square() / sn


class BatchNorm2dRule(_TwoColumnRule):
    kind = "batchnorm2d"

    def supports(self, module: nn.Module) -> bool:
        return isinstance(module, nn.BatchNorm2d) and module.affine

    def input_partial(self, module, x):
        hw = x.shape[2] * x.shape[3]
        # quirk: divided by the squared spatial size
        h = channel_sums(x, 1, False, hw**2) if hw > 0 else None
        if h is not None:
            return h, float(x.shape[0])
        return x.sum((0, 2, 3), dtype=stat_dtype(x)) / (hw**2), float(x.shape[0])

    def output_partial(self, module, s):
        sv = channel_sums(s, 1, False)
        if sv is not None:
            return sv, float(s.shape[0])
        return s.sum((0, 2, 3), dtype=stat_dtype(s)), float(s.shape[0])


class LayerNormRule(_TwoColumnRule):
    """LayerNorm over one trailing dimension (the spec's layout has one ``S`` per feature)."""

    kind = "layernorm"

    def supports(self, module: nn.Module) -> bool:
        return (
            isinstance(module, nn.LayerNorm)
            and module.elementwise_affine
            and len(module.normalized_shape) == 1
        )

    def input_partial(self, module, x):
        # quirk: reduce every dim except dim 1, not the normalised last dim
        dims = [d for d in range(x.dim()) if d != 1]
        dn = math.prod(x.shape[d] for d in dims if d != 0)
        h = channel_sums(x, 1, False, dn**2) if x.dim() >= 2 and dn > 0 else None
        if h is not None:
            return h, float(x.shape[0])
        return x.sum(dims, dtype=stat_dtype(x)) / (dn**2), float(x.shape[0])

    def output_partial(self, module, s):
        sv = channel_sums(s, -1, False) if s.dim() >= 2 else None
        if sv is not None:
            return sv, float(s.shape[0])
        return s.sum(tuple(range(s.dim() - 1)), dtype=stat_dtype(s)), float(s.shape[0])


RULES: tuple[LayerRule, ...] = (LinearRule(), Conv2dRule(), BatchNorm2dRule(), LayerNormRule())


def rule_for(module: nn.Module) -> Optional[LayerRule]:
    """The rule for a supported module, or ``None`` (its parameters then use F = 1)."""
    for rule in RULES:
        if rule.supports(module):
            return rule
    return None
