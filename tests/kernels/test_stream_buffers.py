"""Where the statistics ops put their results and workspaces (``csrc/stream_buffers.h``), GPU only.

Each stream's results are cut in turn from one block and its workspaces share one scratch
buffer, so these tests hold many results at once, of sizes that cross blocks and grow the
scratch, and check every one against the float64 sums of its own random input; that no
two held results overlap in memory; that blocks are per stream; that a result outlives the
block it was cut from; and that an op captured into a CUDA graph takes memory of its own.
"""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the capture kernels need a CUDA device"),
]

DEV = "cuda"
RTOL = 1e-5
BLOCK_FLOATS = 1 << 18  # stream_buffers.cpp's kBlockFloats


def close(got, want):
    want = want.double().cpu()
    err = ((got.double().cpu() - want).abs().max() / want.abs().max().clamp_min(1e-300)).item()
    assert err <= RTOL, f"relative error {err:.3e} > {RTOL:.1e}"


def channel_sums(ext, rows, channels, dtype=torch.bfloat16):
    """One op's input and result: the per-channel sums of squares of a random (rows, channels) tensor."""
    t = torch.randn(rows, channels, device=DEV, dtype=dtype)
    return t, ext.channel_stats(t, 1, True, 0.0, False)


def assert_disjoint(results):
    spans = sorted((r.data_ptr(), r.data_ptr() + 4 * r.numel()) for r in results if r.numel())
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert end <= start, "two held results overlap in memory"


def test_many_held_results_keep_their_values_and_do_not_overlap(ext):
    """300 ops of random sizes (a few channels to more than a quarter block, which takes an
    allocation of its own; few rows to many, which split and use the scratch), convolutions
    among them, every result held: each equals its input's float64 sums, no two overlap,
    and the small ones share blocks (fewer storages than results)."""
    rng = random.Random(0)
    held = []
    for i in range(300):
        if i % 7 == 3:  # a convolution's input statistics: phase 1's maps in the scratch
            x = torch.randn(rng.choice([2, 16, 64]), rng.choice([3, 16, 64]), 12, 12, device=DEV)
            h = ext.conv_input_stats(x, [3, 3], [1, 1], [1, 1], [1, 1], 1, [12, 12], False)
            want = torch.nn.functional.unfold(x.double().square(), 3, padding=1).sum((0, 2))
            held.append((h, want))
            continue
        channels = rng.choice([1, 5, 64, 1000, 4097, BLOCK_FLOATS // 4 + 1])
        t, s = channel_sums(ext, rng.choice([1, 64, 4096]), channels)
        held.append((s, t.double().square().sum(0)))
    torch.cuda.synchronize()
    for got, want in held:
        close(got, want)
    assert_disjoint([got for got, _ in held])
    storages = {got.untyped_storage().data_ptr() for got, _ in held}
    assert len(storages) < len(held) / 4


def test_each_stream_cuts_its_own_blocks(ext):
    """Results made on two streams never share a block (a block is freed in its own
    stream's order), and each equals its sums."""
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    made = {0: [], 1: []}
    for i in range(20):
        k = i % 2
        streams[k].wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(streams[k]):
            t, s = channel_sums(ext, 256, 300)
            made[k].append((t, s))
    torch.cuda.synchronize()
    for k in (0, 1):
        for t, s in made[k]:
            close(s, t.double().square().sum(0))
    blocks = [{s.untyped_storage().data_ptr() for _, s in made[k]} for k in (0, 1)]
    assert blocks[0].isdisjoint(blocks[1])


def test_a_result_outlives_its_block(ext):
    """A result held while the stream cuts several more blocks, whose results are dropped and
    whose memory is taken again by other tensors, keeps its values."""
    t0, kept = channel_sums(ext, 512, 777)
    filler = []
    for _ in range(4 * BLOCK_FLOATS // 4096):
        channel_sums(ext, 8, 4096)
        filler.append(torch.full((4096,), 7.0, device=DEV))
    torch.cuda.synchronize()
    close(kept, t0.double().square().sum(0))


def test_an_op_captured_into_a_cuda_graph_takes_its_own_memory(ext):
    """On a stream being captured the result and workspace are the graph's own allocations:
    the result shares no block with results made on that stream before, which keep their
    values through the replays, and every replay sums the input as it is then."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    x = torch.randn(4096, 300, device=DEV, dtype=torch.bfloat16)
    with torch.cuda.stream(stream):  # the stream's block, scratch and counters, made before the capture
        t_before, before = channel_sums(ext, 4096, 300)
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        s = ext.channel_stats(x, 1, True, 0.0, False)
    assert s.untyped_storage().data_ptr() != before.untyped_storage().data_ptr()
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        close(s, x.double().square().sum(0))
    close(before, t_before.double().square().sum(0))
