"""Parameters sharded on dim 0 (FSDP2's ``DTensor`` shards): the local rows and the factor rows they read.

AdaFisher's preconditioner is elementwise, built from two short vectors per layer:
a rank that owns rows ``r0..r1`` of a weight needs only ``S[r0:r1]`` and the whole
(short) ``H``.  So a sharded parameter is stepped as its local tensor, with the same
kernel and the same state layout as an unsharded one, reading a slice of ``S`` (a
view of the live factor, never a copy).  Every rank keeps every layer's factors:
they are small (the sum of the factor lengths, a few MB for a billion-parameter
model), identical on every rank after the capture step's all-reduce, and whole
factors keep checkpoints independent of the number of ranks.

Placements supported: ``Shard(0)`` and ``Replicate()`` on any mesh dims (FSDP2,
HSDP); anything else (tensor parallel ``Shard(1)``, ``Partial``, strided shards) is
refused with the reason.  Rows are split as ``torch.chunk`` splits them (what FSDP2
and ``DTensor`` do): ``ceil(rows / n)`` per rank, the last ranks fewer or none.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .base import FactorView

try:  # torch.distributed is optional in a torch build
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # pragma: no cover - builds without distributed support
    DTensor = None  # type: ignore[assignment,misc]


def is_sharded(t: Optional[Tensor]) -> bool:
    """Whether ``t`` is a ``DTensor`` (a parameter, gradient or state of a sharded model)."""
    return DTensor is not None and isinstance(t, DTensor)


def local(t: Tensor) -> Tensor:
    """The tensor this rank holds: ``t`` itself, or a ``DTensor``'s local shard (a view, same storage)."""
    return t.to_local() if is_sharded(t) else t  # type: ignore[attr-defined]


def chunk_rows(rows: int, parts: int, index: int) -> tuple[int, int]:
    """``[r0, r1)``: the rows ``torch.chunk(t, parts)[index]`` holds (empty past the last chunk)."""
    if parts < 1 or not 0 <= index < parts:
        raise ValueError(f"chunk {index} of {parts} does not exist")
    size = -(-rows // parts) if rows else 0
    r0 = min(index * size, rows)
    return r0, min(r0 + size, rows)


def local_rows(p: Tensor) -> Optional[tuple[int, int]]:
    """``[r0, r1)`` of dim 0 that this rank holds of ``p``; ``None`` for a plain tensor.

    Raises ``NotImplementedError`` for placements the step cannot map onto factor rows."""
    if not is_sharded(p):
        return None
    mesh, placements = p.device_mesh, p.placements  # type: ignore[attr-defined]
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # this rank holds nothing of the mesh
        return 0, 0
    r0, r1 = 0, p.shape[0] if p.dim() else 1
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Replicate):
            continue
        if type(placement) is Shard and placement.dim == 0:  # exactly Shard: _StridedShard is a subclass
            lo, hi = chunk_rows(r1 - r0, mesh.size(mesh_dim), coordinate[mesh_dim])
            r0, r1 = r0 + lo, r0 + hi
            continue
        raise NotImplementedError(
            f"a parameter of shape {tuple(p.shape)} is placed {placements}: AdaFisher steps parameters sharded on "
            "dim 0 (FSDP2's fully_shard, HSDP) or replicated; tensor-parallel (Shard(1)), Partial and strided "
            "placements are not supported. Shard only with fully_shard, or leave such layers out of the optimizer"
        )
    held = local(p).shape[0] if p.dim() else 1
    if held != r1 - r0:
        raise RuntimeError(f"a parameter of shape {tuple(p.shape)} placed {placements} holds {held} rows on this "
                           f"rank; the torch.chunk split gives rows [{r0}, {r1})")
    return r0, r1


def shard_view(view: FactorView, shape: torch.Size, rows: tuple[int, int]) -> FactorView:
    """The factor view of rows ``[r0, r1)`` (of dim 0) of a parameter of global ``shape``.

    The parameter is read as a row-major ``(len(view.S), ncols)`` matrix; the shard is
    the flat range ``[r0 * e, r1 * e)`` with ``e`` elements per index of dim 0, which must
    start and end on whole rows of that matrix (true for every built-in layer, whose
    factor rows are dim 0: output channels, or a transposed weight's input rows)."""
    numel = shape.numel()
    per_index = numel // shape[0] if len(shape) and shape[0] else numel
    a, b = rows[0] * per_index, rows[1] * per_index
    if a % view.ncols or b % view.ncols:
        raise NotImplementedError(
            f"a shard of rows [{rows[0]}, {rows[1]}) of a parameter of shape {tuple(shape)} does not cover whole rows "
            f"of its ({view.S.numel()}, {view.ncols}) factor matrix; this layer cannot be stepped sharded on dim 0"
        )
    return FactorView(view.S[a // view.ncols : b // view.ncols], view.H, view.col_offset, view.ncols)


def local_view(p: Tensor, view: Optional[FactorView]) -> Optional[FactorView]:
    """``p``'s factor view as its local shard reads it (``view`` itself for a plain tensor)."""
    rows = local_rows(p)
    return view if view is None or rows is None else shard_view(view, p.shape, rows)
