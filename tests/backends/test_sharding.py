"""Rows of a dim-0 shard and the factor rows they read (``backends/sharding.py``)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_cafin.backends import FactorView
from lightning_cafin.backends.sharding import chunk_rows, local_rows, shard_view
from tests.distributed_runs import free_port, init_gloo


@pytest.mark.parametrize("rows", [0, 1, 3, 7, 8, 13])
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 8])
def test_chunk_rows_are_torch_chunks_split(rows, parts):
    t = torch.arange(rows)
    chunks = list(torch.chunk(t, parts)) if rows else []
    for i in range(parts):
        r0, r1 = chunk_rows(rows, parts, i)
        want = chunks[i] if i < len(chunks) else t[:0]
        assert torch.equal(t[r0:r1], want), (rows, parts, i)


def test_chunk_rows_rejects_a_missing_chunk():
    with pytest.raises(ValueError, match="chunk 4 of 4"):
        chunk_rows(7, 4, 4)


@pytest.mark.parametrize(
    "shape, ncols, col_offset, h_len",
    [
        ((7, 5), 5, 0, 6),  # a Linear weight (H has the bias column too)
        ((7,), 1, 5, 6),  # its bias
        ((6, 3, 2, 2), 12, 0, 12),  # a Conv2d weight
        ((9,), 1, 0, 2),  # a norm's weight
    ],
)
def test_a_shard_reads_the_rows_of_f_its_rows_hold(shape, ncols, col_offset, h_len):
    gen = torch.Generator().manual_seed(0)
    nrows = torch.Size(shape).numel() // ncols
    view = FactorView(torch.rand(nrows, generator=gen), torch.rand(h_len, generator=gen), col_offset, ncols)
    full = view.fisher(1e-3, torch.Size(shape))
    for parts in (2, 3, 4):
        for i in range(parts):
            rows = chunk_rows(shape[0], parts, i)
            mine = shard_view(view, torch.Size(shape), rows)
            local_shape = torch.Size((rows[1] - rows[0], *shape[1:]))
            assert mine.S.untyped_storage().data_ptr() == view.S.untyped_storage().data_ptr()  # a view, never a copy
            assert mine.H is view.H
            torch.testing.assert_close(mine.fisher(1e-3, local_shape), full[rows[0] : rows[1]], rtol=0, atol=0)


def test_a_shard_that_splits_a_factor_row_is_refused():
    view = FactorView(torch.rand(2), torch.rand(6), 0, 6)  # a (2, 6) matrix read from a (4, 3) parameter
    with pytest.raises(NotImplementedError, match="whole rows"):
        shard_view(view, torch.Size((4, 3)), (1, 3))


def _placements_worker(rank, port, out):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    init_gloo(rank, 1, port)
    mesh = init_device_mesh("cpu", (1,))
    results = {
        "shard0": local_rows(distribute_tensor(torch.randn(5, 3), mesh, [Shard(0)])),
        "replicate": local_rows(distribute_tensor(torch.randn(5, 3), mesh, [Replicate()])),
        "plain": local_rows(torch.randn(5, 3)),
    }
    try:
        local_rows(distribute_tensor(torch.randn(5, 3), mesh, [Shard(1)]))
    except NotImplementedError as exc:
        results["shard1"] = str(exc)
    torch.save(results, os.path.join(out, "placements.pt"))
    dist.destroy_process_group()


def test_placements_dim0_shards_and_replicas_pass_others_are_refused_with_the_fix(tmp_path):
    mp.spawn(_placements_worker, args=(free_port(), str(tmp_path)), nprocs=1, join=True)
    results = torch.load(tmp_path / "placements.pt", weights_only=True)
    assert results["shard0"] == (0, 5) and results["replicate"] == (0, 5) and results["plain"] is None
    assert "Shard(dim=1)" in results["shard1"] and "fully_shard" in results["shard1"]
