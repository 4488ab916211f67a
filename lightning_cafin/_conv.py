"""Convolution geometry shared by the capture rules and the oracle.

Both must see exactly the patches the convolution itself sees (integer, ``'valid'`` and
``'same'`` padding, dilation, non-zero padding modes), for 1-, 2- and 3-D convolutions,
so the geometry lives in one place.
"""

from __future__ import annotations

import functools
import math
from typing import Union

import torch.nn.functional as F
from torch import Tensor, nn


def conv_pads(module: nn.modules.conv._ConvNd) -> list[tuple[int, int]]:
    """(before, after) zero padding per spatial dim, in dim order.

    Integer padding is symmetric; ``'valid'`` is none; ``'same'`` pads
    ``dilation*(k-1)`` in total, the extra element after, as PyTorch does.
    """
    return _pads(module.kernel_size, module.padding, module.dilation)


@functools.lru_cache(maxsize=4096)
def call_geometry(kernel_size: tuple[int, ...], stride: tuple[int, ...], padding: Union[str, tuple[int, ...]],
                  dilation: tuple[int, ...], in_size: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """``(zero padding before each spatial dim, output spatial size, output positions)`` of
    one convolution call.  Pure and cached: the capture hook asks for it on every call of
    every convolution, where recomputing it in Python cost host time per layer."""
    pads = _pads(kernel_size, padding, dilation)
    out = tuple((size + before + after - d * (k - 1) - 1) // st + 1
                for size, (before, after), d, k, st in zip(in_size, pads, dilation, kernel_size, stride))
    return tuple(before for before, _ in pads), out, math.prod(out)


def _pads(kernel_size: tuple[int, ...], padding: Union[str, tuple[int, ...]],
          dilation: tuple[int, ...]) -> list[tuple[int, int]]:
    if isinstance(padding, str):
        if padding == "valid":
            return [(0, 0)] * len(kernel_size)
        totals = [d * (k - 1) for d, k in zip(dilation, kernel_size)]
        return [(t // 2, t - t // 2) for t in totals]
    return [(p, p) for p in padding]


def conv_padding(module: nn.modules.conv._ConvNd) -> tuple[int, ...]:
    """The padding in ``F.pad`` order (last dim first): ``(left, right, top, bottom)`` for 2-D."""
    out: list[int] = []
    for before, after in reversed(conv_pads(module)):
        out += [before, after]
    return tuple(out)


def conv_output_size(module: nn.modules.conv._ConvNd, in_size: tuple[int, ...]) -> tuple[int, ...]:
    """The output's spatial size for an input of spatial size ``in_size``."""
    return call_geometry(module.kernel_size, module.stride, module.padding, module.dilation, tuple(in_size))[1]


def conv_output_hw(module: nn.Conv2d, in_hw: tuple[int, int]) -> tuple[int, int]:
    return conv_output_size(module, in_hw)  # type: ignore[return-value]


def pad_like_conv(module: nn.modules.conv._ConvNd, x: Tensor) -> Tensor:
    """The input as the kernel sees it: padded with the module's padding mode."""
    pads = conv_padding(module)
    if not any(pads):
        return x
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    return F.pad(x, pads, mode=mode)
