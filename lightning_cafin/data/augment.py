"""Batch augmentation on whatever device the batch is on (the GPU, after transfer).

The CIFAR recipe's standard augmentation -- a random 32x32 crop of the image padded by
4 zero pixels, and a random horizontal flip -- done for a whole batch with one gather,
so a GPU run does not wait on per-image CPU transforms.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


def random_crop_flip(x: Tensor, padding: int = 4, flip: bool = True,
                     generator: Optional[torch.Generator] = None) -> Tensor:
    """Each image of ``x`` (N, C, H, W) cropped at a random offset from its zero-padded copy, maybe mirrored."""
    if x.dim() != 4:
        raise ValueError(f"random_crop_flip expects a (N, C, H, W) batch, got shape {tuple(x.shape)}")
    n, _, h, w = x.shape
    if padding < 0:
        raise ValueError(f"padding must be >= 0, got {padding}")
    padded = F.pad(x, (padding, padding, padding, padding))
    dev = x.device
    # Offsets are drawn where the batch lives (no host round trip per batch on a GPU) unless
    # a generator is given, whose device then decides.
    rng = generator.device if generator is not None else dev
    oy = torch.randint(0, 2 * padding + 1, (n, 1), generator=generator, device=rng).to(dev)
    ox = torch.randint(0, 2 * padding + 1, (n, 1), generator=generator, device=rng).to(dev)
    rows = oy + torch.arange(h, device=dev)  # (N, H)
    cols = ox + torch.arange(w, device=dev)  # (N, W)
    if flip:
        mirrored = torch.rand(n, 1, generator=generator, device=rng).to(dev) < 0.5
        cols = torch.where(mirrored, cols.flip(1), cols)
    batch = torch.arange(n, device=dev)[:, None, None]
    # advanced indexing over (N, H, W) with the channel slice kept: result (N, H, W, C)
    out = padded.permute(0, 2, 3, 1)[batch, rows[:, :, None], cols[:, None, :]]
    return out.permute(0, 3, 1, 2).contiguous()


def normalize(x: Tensor, mean: Sequence[float], std: Sequence[float]) -> Tensor:
    """``(x - mean) / std`` per channel."""
    m = torch.as_tensor(mean, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
    s = torch.as_tensor(std, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
    return (x - m) / s


def prepare_batch(x: Tensor, mean: Sequence[float], std: Sequence[float], crop_padding: Optional[int] = None,
                  normalise: bool = True, generator: Optional[torch.Generator] = None) -> Tensor:
    """uint8 images -> float in [0, 1], randomly cropped and flipped when ``crop_padding`` is given, normalised."""
    x = x.float().div_(255.0)
    if crop_padding is not None:
        x = random_crop_flip(x, padding=crop_padding, generator=generator)
    return normalize(x, mean, std) if normalise else x
