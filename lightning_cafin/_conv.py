"""Convolution geometry shared by the capture rules and the oracle.

Both must see exactly the patches the convolution itself sees (integer, ``'valid'`` and
``'same'`` padding, dilation, non-zero padding modes), so the geometry lives in one place.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


def conv_padding(module: nn.Conv2d) -> tuple[int, int, int, int]:
    """The (left, right, top, bottom) zero padding the convolution really applies.

    Integer padding is symmetric; ``'valid'`` is none; ``'same'`` pads
    ``dilation*(k-1)`` in total, the extra element on the right/bottom, as PyTorch does.
    """
    pad = module.padding
    if isinstance(pad, str):
        if pad == "valid":
            return (0, 0, 0, 0)
        totals = [d * (k - 1) for d, k in zip(module.dilation, module.kernel_size)]
        top, left = totals[0] // 2, totals[1] // 2
        return (left, totals[1] - left, top, totals[0] - top)
    return (pad[1], pad[1], pad[0], pad[0])


def conv_output_hw(module: nn.Conv2d, in_hw: tuple[int, int]) -> tuple[int, int]:
    left, right, top, bottom = conv_padding(module)
    padded = (in_hw[0] + top + bottom, in_hw[1] + left + right)
    return tuple(
        (size - d * (k - 1) - 1) // st + 1
        for size, d, k, st in zip(padded, module.dilation, module.kernel_size, module.stride)
    )


def pad_like_conv(module: nn.Conv2d, x: Tensor) -> Tensor:
    """The input as the kernel sees it: padded with the module's padding mode."""
    pads = conv_padding(module)
    if not any(pads):
        return x
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    return F.pad(x, pads, mode=mode)
