"""The oracle: docs/ADAFISHER_SPEC.md restated in plain PyTorch, as directly as it is written.

Nothing here is fast and nothing here imports a fast path.  Tests measure every
other implementation (the capture rules, the ``foreach`` and ``fused`` steps)
against these functions, and the ``reference`` backend uses them for its factor
statistics, so that backend is the authors' algorithm end to end (im2col included).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._conv import pad_like_conv

#: The epsilon of the min-max normalisation.
NORM_EPS = 1e-6


def _float(t: Tensor) -> Tensor:
    return t.double() if t.dtype == torch.float64 else t.float()


def linear_stats(module: nn.Module, x: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
    """(H_raw, S_raw) of a Linear layer: the ones column appended for the bias."""
    x = _float(x).reshape(-1, x.shape[-1])
    s = _float(s).reshape(-1, s.shape[-1])
    if module.bias is not None:
        x = torch.cat([x, x.new_ones(x.shape[0], 1)], 1)
    return (x * x).sum(0) / x.shape[0], (s * s).sum(0) / s.shape[0]


def conv2d_patches(module: nn.Conv2d, x: Tensor) -> Tensor:
    """The im2col patch matrix: rows (b, group, position), columns (c within group, ki, kj)."""
    x = pad_like_conv(module, _float(x))
    cols = F.unfold(x, module.kernel_size, dilation=module.dilation, stride=module.stride)  # (B, C*kh*kw, L)
    B, _, L = cols.shape
    g = module.groups
    cols = cols.reshape(B, g, -1, L).permute(0, 1, 3, 2)  # (B, g, L, K)
    return cols.reshape(B * g * L, -1)


def conv2d_stats(module: nn.Conv2d, x: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
    """(H_raw, S_raw) of a Conv2d layer, through the explicit patch matrix."""
    patches = conv2d_patches(module, x)
    if module.bias is not None:
        patches = torch.cat([patches, patches.new_ones(patches.shape[0], 1)], 1)
    B, L = x.shape[0], s.shape[2] * s.shape[3]
    K = (module.in_channels // module.groups) * module.kernel_size[0] * module.kernel_size[1]
    H = (patches * patches).sum(0) / (B * L * K)
    s = _float(s)
    return H, (s * s).sum((0, 2, 3)) / (B * L)


def conv_patches(module: nn.modules.conv._ConvNd, x: Tensor) -> Tensor:
    """The im2col patch matrix of a 1-, 2- or 3-D convolution: rows (b, group, position),
    columns (c within group, k...), as the weight is flattened."""
    nd = len(module.kernel_size)
    x = pad_like_conv(module, _float(x))
    for i, (k, d, st) in enumerate(zip(module.kernel_size, module.dilation, module.stride)):
        x = x.unfold(2 + i, d * (k - 1) + 1, st)  # (B, C, O..., extent...)
    x = x[(...,) + tuple(slice(None, None, d) for d in module.dilation)]  # (B, C, O..., k...)
    B, C, g = x.shape[0], x.shape[1], module.groups
    L = math.prod(x.shape[2 : 2 + nd])
    x = x.reshape(B, g, C // g, L, -1).permute(0, 1, 3, 2, 4)  # (B, g, L, C/g, prod k)
    return x.reshape(B * g * L, -1)


def conv_stats(module: nn.modules.conv._ConvNd, x: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
    """(H_raw, S_raw) of a 1-, 2- or 3-D convolution, through the explicit patch matrix."""
    patches = conv_patches(module, x)
    if module.bias is not None:
        patches = torch.cat([patches, patches.new_ones(patches.shape[0], 1)], 1)
    B, L = x.shape[0], math.prod(s.shape[2:])
    K = (module.in_channels // module.groups) * math.prod(module.kernel_size)
    H = (patches * patches).sum(0) / (B * L * K)
    s = _float(s)
    return H, (s * s).sum((0,) + tuple(range(2, s.dim()))) / (B * L)


def batchnorm2d_stats(module: nn.BatchNorm2d, x: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
    x, s = _float(x), _float(s)
    B, C = x.shape[0], x.shape[1]
    a = x.sum((0, 2, 3)) / (x.shape[2] * x.shape[3]) ** 2
    H = torch.stack([(a * a).sum() / B**2, x.new_tensor(C / B**2)])
    ssum = s.sum((0, 2, 3))
    return H, ssum * ssum / B


def layernorm_stats(module: nn.Module, x: Tensor, s: Tensor, channels_first: bool = False) -> tuple[Tensor, Tensor]:
    """(H_raw, S_raw) of a LayerNorm (any normalised shape) or an RMSNorm (the same two ``H``
    entries; it has no bias to read the second).

    The input is seen as ``(..., N)``, the ``N = weight.numel()`` normalised elements last
    (flattened); a channels-first layer (``N x C x H x W`` normalised over ``C``) is
    ``permute -> LayerNorm -> permute``, so it is first permuted channels-last.  Then the
    paper's LayerNorm: ``a`` sums every dim but dim 1, divided by the squared product of the
    dims after dim 1; ``S`` sums every dim but the last.
    """
    x, s = _float(x), _float(s)
    if channels_first:
        x, s = x.movedim(1, -1), s.movedim(1, -1)
    weight = module.weight
    assert isinstance(weight, Tensor)
    shape = tuple(weight.shape)
    if len(shape) > 1:
        x = x.reshape(*x.shape[: x.dim() - len(shape)], -1)
        s = s.reshape(*s.shape[: s.dim() - len(shape)], -1)
    dims = [d for d in range(x.dim()) if d != 1]
    dn = math.prod(x.shape[d] for d in dims if d != 0)
    a = x.sum(dims) / dn**2
    B = x.shape[0]
    H = torch.stack([(a * a).sum() / B**2, x.new_tensor(a.numel() / B**2)])
    ssum = s.sum(tuple(range(s.dim() - 1)))
    return H, ssum * ssum / s.shape[0]


def channel_norm_stats(module: nn.Module, x: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
    """(H_raw, S_raw) of a per-channel norm of any rank (BatchNorm1d/2d/3d, SyncBatchNorm,
    GroupNorm): the BatchNorm2d definition with the spatial size the product of the dims
    after the channel dim (1 for a ``(B, C)`` input)."""
    x, s = _float(x), _float(s)
    B, C = x.shape[0], x.shape[1]
    spatial = tuple(range(2, x.dim()))
    a = x.sum((0,) + spatial) / math.prod(x.shape[2:]) ** 2
    H = torch.stack([(a * a).sum() / B**2, x.new_tensor(C / B**2)])
    ssum = s.sum((0,) + tuple(range(2, s.dim())))
    return H, ssum * ssum / B


def raw_stats(module: nn.Module, x: Tensor, s: Tensor, channels_first: bool = False) -> tuple[Tensor, Tensor]:
    """(H_raw, S_raw) of a built-in module type from its input ``x`` and output gradient ``s``.

    ``channels_first``: a LayerNorm / RMSNorm that normalises dim 1 (which one is, is a
    property of its class, see ``capture/layers.py``).  Linear-like layers with a transposed
    weight have the same statistics as ``nn.Linear``.
    """
    if isinstance(module, (nn.Conv1d, nn.Conv3d)):
        return conv_stats(module, x, s)
    if isinstance(module, nn.Conv2d):
        return conv2d_stats(module, x, s)
    if isinstance(module, nn.BatchNorm2d):
        return batchnorm2d_stats(module, x, s)
    if isinstance(module, (nn.modules.batchnorm._BatchNorm, nn.GroupNorm)):
        return channel_norm_stats(module, x, s)
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        return layernorm_stats(module, x, s, channels_first)
    weight = getattr(module, "weight", None)
    if isinstance(weight, Tensor) and weight.dim() == 2:
        return linear_stats(module, x, s)
    raise TypeError(f"{type(module).__name__} has no built-in AdaFisher factors")


def normalise(v: Tensor) -> Tensor:
    """Steps 1-2 of the averaging: map +-inf, then min-max normalise."""
    v = v.clone()
    v[v == math.inf] = 1.0
    v[v == -math.inf] = 0.0
    return (v - v.min()) / (v.max() - v.min() + NORM_EPS)


def average(old: Tensor | None, raw: Tensor, gamma: float) -> Tensor:
    """Steps 3-4: the stored factor starts as ones; then ``0.1*gamma*old + 0.01*gamma*new``."""
    if old is None:
        old = torch.ones_like(raw)
    return old * (0.1 * gamma) + normalise(raw) * (0.01 * gamma)


def fisher(S: Tensor, H: Tensor, Lambda: float) -> Tensor:
    """The full preconditioner of a layer: ``F[i, j] = S[i] * H[j] + Lambda``."""
    return S[:, None] * H[None, :] + Lambda
