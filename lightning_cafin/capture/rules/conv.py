"""Convolutions (``nn.Conv1d``, ``nn.Conv2d``, ``nn.Conv3d``): ``H`` from window sums of
``x**2``, with no im2col tensor.

``H_raw[(c, k...)]`` is the sum, over the batch, the groups and every output position,
of the squared padded input under kernel tap ``k...`` of channel ``c`` within its group,
divided by ``B * L * K`` (``L`` output positions, ``K = C/g * prod(kernel)``), exactly the
spec's im2col definition.  Summing ``x**2`` over the batch and the groups first leaves a
small ``(C/g, *spatial)`` map; each tap is then one strided window sum of that map.

On CUDA, 2-D and 1-D convolutions (a 1-D one as a 2-D one of height 1) with zero padding
use the extension's ``conv_input_stats`` kernel, except pointwise ones (1 x 1 at stride 1,
one group: :func:`pointwise`), whose window sums are the per-channel sums of squares that
``channel_stats`` computes in one pass; 3-D ones and other padding modes use the torch
ops here.  (A 1 x 1 one without padding at a larger stride, on a channels_last input, is
read the same way by the extension itself over the positions under its tap: a quarter of
the input at stride 2, ``pointwise_taps`` in ``csrc/capture_ops.cpp``.)
"""

from __future__ import annotations

import math
from typing import Optional, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..._conv import call_geometry, conv_padding, pad_like_conv
from .. import kernels as _kernels
from .. import streams as _streams
from .base import FusedStats, KernelPlan, LayerRule, ParamSlot, channel_op, channel_sums, sum_of_squares


_ConvNd = nn.modules.conv._ConvNd


def conv_columns(module: _ConvNd) -> int:
    """``K``: the weight's columns, ``C/g * prod(kernel)``."""
    return (module.in_channels // module.groups) * math.prod(module.kernel_size)


def pointwise(module: _ConvNd) -> bool:
    """A 1 x 1 kernel at stride 1 in one group: every input position lies under the one tap
    exactly once (zero padding adds nothing), so the window sums are the per-channel sums
    of squares, one pass of the per-channel kernel instead of a map and its window sums."""
    return module.groups == 1 and all(k == 1 for k in module.kernel_size) and all(st == 1 for st in module.stride)


def _conv(module: nn.Module) -> _ConvNd:
    """The module as the convolution :meth:`ConvRule.supports` checked it is (no runtime cost)."""
    return cast(_ConvNd, module)


class ConvRule(LayerRule):
    """``nn.Conv1d`` / ``nn.Conv2d`` / ``nn.Conv3d`` (not transposed convolutions)."""

    def __init__(self, ndim: int = 2) -> None:
        self.ndim = ndim
        self.kind = f"conv{ndim}d"

    def supports(self, module: nn.Module) -> bool:
        return isinstance(module, nn.modules.conv._ConvNd) and not module.transposed

    def slots(self, module: nn.Module) -> list[ParamSlot]:
        conv = _conv(module)
        K = conv_columns(conv)
        out = [ParamSlot("weight", 0, K)]
        if conv.bias is not None:
            out.append(ParamSlot("bias", K, 1))
        return out

    def input_partial(self, module: nn.Module, x: Tensor) -> tuple[Tensor, float]:
        return self._input_partial(_conv(module), x)

    def _input_partial(self, module: _ConvNd, x: Tensor) -> tuple[Tensor, float]:
        nd = len(module.kernel_size)
        if x.dim() == nd + 1:  # unbatched input
            x = x.unsqueeze(0)
        shape = x.shape
        pads, out_size, positions = call_geometry(module.kernel_size, module.stride, module.padding, module.dilation,
                                                  tuple(shape[2:]))
        count = float(shape[0] * positions * conv_columns(module))
        h = self._kernel_input_sums(module, x, out_size, pads) if nd in (1, 2) else None
        if h is not None:
            return h, count
        if nd == 2:
            return self._taps_2d(module, x), count
        return self._taps_nd(module, x, out_size), count

    @staticmethod
    def _kernel_input_sums(module: _ConvNd, x: Tensor, out_size: tuple[int, ...],
                           pads: tuple[int, ...]) -> Optional[Tensor]:
        ext = _kernels.ext_for(x) if module.padding_mode == "zeros" else None
        if ext is None:
            return None
        if pointwise(module):
            return ext.channel_stats(x, 1, True, 0.0, _streams.side())
        ks, st, dl = module.kernel_size, module.stride, module.dilation
        if len(ks) == 1:  # a 1-D convolution is a 2-D one of height 1
            x, pads, ks, st, dl, out_size = x.unsqueeze(2), (0,) + pads, (1,) + ks, (1,) + st, (1,) + dl, (1,) + out_size
        return ext.conv_input_stats(x, ks, st, pads, dl, module.groups, out_size, _streams.side())

    @staticmethod
    def _taps_2d(module: _ConvNd, x: Tensor) -> Tensor:
        g, (kh, kw) = module.groups, module.kernel_size
        if module.padding_mode == "zeros":
            # zeros square to zeros: reduce the batch first, then pad the small map
            sq = F.pad(sum_of_squares(x, 0), conv_padding(module))  # (C, Hp, Wp)
        else:  # reflect / replicate / circular padding repeats real values
            sq = sum_of_squares(pad_like_conv(module, x), 0)
        sq = sq.reshape(g, -1, *sq.shape[-2:]).sum(0)  # pool the groups: (C/g, Hp, Wp)
        # every tap's window sum at once: the patches of this small map, summed over positions
        taps = F.unfold(sq[None], (kh, kw), dilation=module.dilation, stride=module.stride)  # (1, K, Ho*Wo)
        return taps[0].sum(1)  # (c, ki, kj) order, as the weight

    @staticmethod
    def _taps_nd(module: _ConvNd, x: Tensor, out_size: tuple[int, ...]) -> Tensor:
        g = module.groups
        if module.padding_mode == "zeros":
            sq = F.pad(sum_of_squares(x, 0), conv_padding(module))  # (C, *padded)
        else:
            sq = sum_of_squares(pad_like_conv(module, x), 0)
        sq = sq.reshape(g, -1, *sq.shape[1:]).sum(0)  # (C/g, *padded)
        nd = sq.dim() - 1
        windows = sq
        for i, (k, d, st) in enumerate(zip(module.kernel_size, module.dilation, module.stride)):
            windows = windows.unfold(1 + i, d * (k - 1) + 1, st)  # a view: (C/g, O..., extents...)
        taps = windows[(...,) + tuple(slice(None, None, d) for d in module.dilation)]  # (C/g, O..., k...)
        assert tuple(taps.shape[1 : 1 + nd]) == tuple(out_size)
        return taps.sum(tuple(range(1, 1 + nd))).reshape(-1)  # (c, k...) order, as the weight

    def output_partial(self, module: nn.Module, s: Tensor) -> tuple[Tensor, float]:
        nd = len(_conv(module).kernel_size)
        if s.dim() == nd + 1:
            s = s.unsqueeze(0)
        count = float(s.shape[0] * math.prod(s.shape[2:]))
        sv = channel_sums(s, 1, True)
        if sv is not None:
            return sv, count
        return sum_of_squares(s, (0,) + tuple(range(2, s.dim()))), count

    def fused_stats(self, module: nn.Module, x_shape: torch.Size, grad_shape: torch.Size) -> Optional[FusedStats]:
        conv = _conv(module)
        nd = len(conv.kernel_size)
        if nd not in (1, 2) or conv.padding_mode != "zeros" or len(x_shape) != nd + 2 or len(grad_shape) != nd + 2:
            return None  # 3-D, other padding modes, unbatched calls: the partial methods
        pads, out_size, positions = call_geometry(conv.kernel_size, conv.stride, conv.padding, conv.dilation,
                                                  tuple(x_shape[2:]))
        ks, st, dl = conv.kernel_size, conv.stride, conv.dilation
        if nd == 1:  # a 1-D convolution is a 2-D one of height 1
            ks, st, dl, pads, out_size = (1,) + ks, (1,) + st, (1,) + dl, (0,) + pads, (1,) + out_size
        op = channel_op(1, True) if pointwise(conv) else (1, *ks, *st, *pads, *dl, conv.groups, *out_size)
        hn = float(x_shape[0] * positions * conv_columns(conv))
        return FusedStats(op, 0.0, 1, True, 0.0, hn, float(grad_shape[0] * math.prod(grad_shape[2:])))

    def finalize(self, module: nn.Module, h: Tensor, hn: float, s: Tensor, sn: float) -> tuple[Tensor, Tensor]:
        conv = _conv(module)
        H = h / hn
        if conv.bias is not None:
            # The ones column of the patch matrix: (B * g * L) / (B * L * K).
            H = torch.cat([H, H.new_full((1,), conv.groups / conv_columns(conv))])
        return H, s / sn

    def kernel_plan(self, module: nn.Module, h: Tensor, hn: float) -> Optional[KernelPlan]:
        conv = _conv(module)
        return KernelPlan(0, hn, conv.groups / conv_columns(conv), conv.bias is not None)

    def oracle(self, module: nn.Module, x: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
        from ... import spec

        return spec.conv_stats(_conv(module), x, s)

    def __repr__(self) -> str:
        return f"ConvRule(ndim={self.ndim})"
