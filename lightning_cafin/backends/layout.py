"""Dense layouts the fused step can take, and how ``F`` is indexed through them.

The kernel walks a parameter as a flat row-major ``(rows, ncols)`` array and reads
``F[f] = S[f // ncols] * H[col_offset + f % ncols] + Lambda``.  A parameter in another
dense memory order (channels_last conv weights: strides ordered ``o, kh, kw, C``) is
handed over as it is, and the op walks it flat, in memory order.  As long as dim 0 stays
outermost, each row is still one contiguous block, so only the column order within a
row differs from the logical one; the kernel stays the same when it is given a copy
of the parameter's segment of ``H`` permuted to memory order (``H_mem[j_mem] =
H[col_offset + j_logical]``, read from offset 0),
rewritten in place whenever the factors change (the order itself is made once, on the
device: a host-to-device copy per capture step would wait for the GPU).  The
parameter's gradient and momentum must have the same strides (momentum is created in
the parameter's memory format).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def dense_in_memory(t: Tensor) -> bool:
    """Whether ``t``'s elements fill its storage span exactly once (any dim order)."""
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def rows_outermost(t: Tensor) -> bool:
    """Whether each index of dim 0 owns one contiguous block of ``numel / size(0)`` elements."""
    if t.dim() == 0 or t.numel() == 0:
        return True
    row = t.numel() // t.shape[0]
    return t.shape[0] == 1 or t.stride(0) == row


def layout_reason(param: Tensor, grad: Optional[Tensor] = None) -> Optional[str]:
    """``None`` when the kernel can walk ``param`` (and ``grad``) flat, else why not."""
    strides = tuple(param.stride())
    if not param.is_contiguous():
        if not dense_in_memory(param):
            return f"it is not contiguous and not dense in memory (strides {strides}, e.g. a sliced view)"
        if not rows_outermost(param):
            return (f"it is not contiguous and its memory order does not keep dim 0 outermost (strides {strides}, "
                    "e.g. a transposed view)")
    if grad is not None:
        if grad.is_sparse:
            return "its gradient is sparse"
        alike = grad.is_contiguous() if param.is_contiguous() else tuple(grad.stride()) == strides
        if not alike:
            return (f"its gradient is not contiguous alike the parameter (gradient strides {tuple(grad.stride())}, "
                    f"parameter {strides})")
    return None


def memory_columns(t: Tensor) -> Tensor:
    """For a parameter with dim 0 outermost: ``perm[j_mem] = j_logical`` over one row's columns."""
    rest_shape, rest_strides = tuple(t.shape[1:]), tuple(t.stride()[1:])
    ncols = t.numel() // t.shape[0] if t.dim() and t.shape[0] else 0
    logical = torch.arange(ncols, dtype=torch.long).view(rest_shape)
    in_memory = torch.empty_strided(rest_shape, rest_strides, dtype=torch.long)
    in_memory.copy_(logical)  # the element stored at memory offset m holds its logical column
    return in_memory.as_strided((ncols,), (1,)).clone()


def permuted_factor(H: Tensor, col_offset: int, perm: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """The parameter's segment ``H[col_offset : col_offset + len(perm)]`` in memory order
    (read from offset 0; written into ``out`` when given, so a kept buffer is refreshed
    in place by one gather)."""
    segment = H[col_offset : col_offset + perm.numel()]
    if out is None or out.shape != perm.shape or out.device != H.device or out.dtype != H.dtype:
        out = torch.empty(perm.shape, dtype=H.dtype, device=H.device)
    return torch.index_select(segment, 0, perm.to(H.device), out=out)
