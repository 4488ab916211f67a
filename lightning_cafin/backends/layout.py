"""Dense layouts the fused step can take, and how ``F`` is indexed through them.

The kernel walks a parameter as a flat row-major ``(rows, ncols)`` array and reads
``F[f] = S[f // ncols] * H[col_offset + f % ncols] + Lambda``.  A parameter in another
dense memory order (channels_last conv weights: strides ordered ``o, kh, kw, C``) is
handed over as it is, and the op walks it flat, in memory order.  As long as dim 0 stays
outermost, each row is still one contiguous block, so only the column order within a
row differs from the logical one.  Two ways to read ``H`` in that order:

* **channels innermost** (channels_last and channels_last_3d conv weights, the layouts
  models are converted to): the kernel maps memory column ``k * C + c`` to logical column
  ``c * (ncols / C) + k`` itself (the op's ``inners``, :func:`channels_innermost`), reading
  the factors where they are;
* **any other dense order** (e.g. a permuted view autograd keeps dense): the kernel is
  given a copy of the parameter's segment of ``H`` permuted to memory order (``H_mem[j_mem]
  = H[col_offset + j_logical]``, read from offset 0), rewritten in place whenever the
  factors change (the order itself is made once, on the device: a host-to-device copy per
  capture step would wait for the GPU).  Rewriting the copies was two launches (a
  concatenation and a gather) and their host dispatch on every capture step of a
  channels_last network, which the first way does without.

The parameter's gradient and momentum must have the same strides (momentum is created in
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


def channels_innermost(t: Tensor) -> int:
    """``C`` where ``t`` (logical ``(O, C, *k)``, not contiguous) is stored channels innermost,
    as channels_last / channels_last_3d store a convolution's weight: ``C`` with stride 1,
    then the ``k`` dims in their order, dim 0 outermost (size-1 dims' strides not looked
    at); else 1.  The op checks the same (``check_channels_innermost``)."""
    if t.dim() < 3 or t.shape[1] < 2 or t.is_contiguous() or t.stride(1) != 1:
        return 1
    expected = t.shape[1]
    for d in range(t.dim() - 1, 1, -1):
        if t.shape[d] != 1 and t.stride(d) != expected:
            return 1
        expected *= t.shape[d]
    return t.shape[1] if t.shape[0] == 1 or t.stride(0) == expected else 1


def memory_columns(t: Tensor) -> Tensor:
    """For a parameter with dim 0 outermost: ``perm[j_mem] = j_logical`` over one row's columns."""
    rest_shape, rest_strides = tuple(t.shape[1:]), tuple(t.stride()[1:])
    ncols = t.numel() // t.shape[0] if t.dim() and t.shape[0] else 0
    logical = torch.arange(ncols, dtype=torch.long).view(rest_shape)
    in_memory = torch.empty_strided(rest_shape, rest_strides, dtype=torch.long)
    in_memory.copy_(logical)  # the element stored at memory offset m holds its logical column
    return in_memory.as_strided((ncols,), (1,)).clone()


class MemoryOrderCopies:
    """Parameters' segments of ``H`` in memory order (``H_mem[j_mem] = H[col_offset +
    j_logical]``), each a view of one buffer, all refreshed by one gather.

    Every capture step rewrites the factors in place, so every copy is rewritten then.  A
    channels_last network has one such conv weight per layer; one ``index_select`` each was
    a launch and its host dispatch per layer on every capture step (17 on a ResNet), where
    concatenating the segments and gathering them at once is two launches, whatever the
    count.  The gather's index (every order, shifted to its segment's place in the
    concatenation) is made once, on the device, and the concatenation has a buffer of its
    own: a refresh allocates nothing (the step may run inside a CUDA graph)."""

    def __init__(self) -> None:
        self._sources: list[tuple[Tensor, int, int]] = []  # (the live H, column offset, columns)
        self._orders: list[Tensor] = []
        self._buffer: Optional[Tensor] = None
        self._source: Optional[Tensor] = None  # the segments concatenated (several parameters)
        self._index: Optional[Tensor] = None
        self._segments: list[Tensor] = []  # each source's columns, a view of its H

    def __len__(self) -> int:
        return len(self._sources)

    def add(self, H: Tensor, col_offset: int, order: Tensor) -> None:
        """One more parameter: its columns ``order`` (``memory_columns``) of ``H`` from ``col_offset``."""
        if self._buffer is not None:
            raise RuntimeError("MemoryOrderCopies.add: the copies were already made (add every parameter first)")
        self._sources.append((H, int(col_offset), order.numel()))
        self._orders.append(order)

    def copies(self) -> list[Tensor]:
        """The copies, in the order added, filled from the factors as they are now."""
        if self._buffer is None:
            if not self._sources:
                return []
            device, dtype = self._sources[0][0].device, self._sources[0][0].dtype
            shifted, start = [], 0
            for order, (_, _, n) in zip(self._orders, self._sources):
                shifted.append(order.to(device) + start)
                start += n
            self._index = torch.cat(shifted)
            self._buffer = torch.empty(start, dtype=dtype, device=device)
            # views of the factors' columns, made once: the factors are updated in place
            # (a replaced factor makes the step plan, and with it these copies, anew)
            self._segments = [H[o : o + n] for H, o, n in self._sources]
            if len(self._sources) > 1:
                self._source = torch.empty(start, dtype=dtype, device=device)
        self.refresh()
        views, start = [], 0
        for _, _, n in self._sources:
            views.append(self._buffer[start : start + n])
            start += n
        return views

    def refresh(self) -> None:
        """Rewrite every copy in place from the factors (two launches: cat, gather)."""
        if self._buffer is None or self._index is None:
            return
        segments = self._segments
        source = segments[0] if self._source is None else torch.cat(segments, out=self._source)
        torch.index_select(source, 0, self._index, out=self._buffer)
