"""The gradient taps' deferred sums over splits (``csrc/deferred_sums.h``, GPU only).

A tap's rows-kernel launch leaves its partial sums; one finish launch per stream sums them
when the statistics are taken (a sink's ``take``, or ``capture_join``).  The finish sums the
splits as the rows kernel's last block does, so a tap's ``(h, s)`` equal ``layer_stats``' on
the same input and gradient bit for bit, on the current and the side stream; micro-batches
leave several launches to one finish; the finish's buffers are held while the stream's
memory is reused before the take.  Inputs are fresh and random (never zeros).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_cafin.capture.layers import rule_for

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the deferred sums need a CUDA device"),
]
DEV = "cuda"


def _linear_tokens():
    """A GPT MLP's first layer in bf16 on 16 x 256 tokens: 768 -> 3072 channels, many splits."""
    return nn.Linear(768, 3072).to(DEV, torch.bfloat16), torch.randn(16, 256, 768, device=DEV, dtype=torch.bfloat16)


def _linear_fp32():
    """A float32 Linear on 4096 rows whose 1001 outputs are no multiple of four: its gradient is
    read one element a lane (the finish's scalar sums), its input in 16-byte vectors (two launches)."""
    return nn.Linear(512, 1001).to(DEV), torch.randn(4096, 512, device=DEV)


def _pointwise_conv():
    """A ResNet bottleneck's 1 x 1 convolution on a channels_last bf16 map (a per-channel read)."""
    conv = nn.Conv2d(64, 256, 1, bias=False).to(DEV, torch.bfloat16).to(memory_format=torch.channels_last)
    return conv, torch.randn(32, 64, 28, 28, device=DEV, dtype=torch.bfloat16).to(memory_format=torch.channels_last)


LAYERS = {"linear-bf16-tokens": _linear_tokens, "linear-fp32-1001": _linear_fp32, "conv1x1-bf16-cl": _pointwise_conv}


def _tapped(ext, module, x, side, sink=None):
    """The module's output with a tap on it, the tap's sink and its layer_stats arguments."""
    out = module(x)
    fused = rule_for(module).fused_stats(module, x.shape, out.shape)
    sink = ext.TapSink() if sink is None else sink
    fused.tap_plan(ext, sink).tap(x, out, side)
    return out, sink, fused


def _backward(out):
    """A backward from ``out`` and the gradient its tap was given.  (Not ``retain_grad``'s
    ``out.grad``: that is a contiguous clone, and a channels_last gradient read in another
    layout is summed in another order, so its sums differ in the last bits.)"""
    seen = []
    out.register_hook(seen.append)
    (out.float() * torch.randn_like(out, dtype=torch.float32)).sum().backward()
    (grad,) = seen
    return grad


@pytest.mark.parametrize("side", [False, True])
@pytest.mark.parametrize("name", list(LAYERS))
def test_a_taps_sums_taken_after_its_backward_equal_layer_stats_bit_for_bit(ext, name, side):
    torch.manual_seed(0)
    module, x = LAYERS[name]()
    out, sink, fused = _tapped(ext, module, x, side)
    grad = _backward(out)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        ext.capture_join()  # (the side stream's finish is launched here, the current stream's at the take)
        ((h, hn, s, sn),) = sink.take()
        torch.cuda.synchronize()
    finishes = [e for e in prof.events() if "finish_sums_kernel" in e.name]
    assert len(finishes) == 1, [e.name for e in prof.events()]  # one launch for the layer's deferred reads
    want_h, want_s = fused.run(ext, x, grad, side)
    ext.capture_join()
    torch.cuda.synchronize()
    assert (hn, sn) == (fused.hn, fused.sn)
    assert h.abs().sum() > 0 and s.abs().sum() > 0
    assert torch.equal(h, want_h), name
    assert torch.equal(s, want_s), name


def test_micro_batches_leave_several_launches_to_one_finish(ext):
    torch.manual_seed(1)
    module, _ = _linear_tokens()
    sink, wants = ext.TapSink(), []
    for _ in range(3):  # three backward passes, nothing taken between them
        x = torch.randn(16, 256, 768, device=DEV, dtype=torch.bfloat16)
        out, sink, fused = _tapped(ext, module, x, False, sink)
        grad = _backward(out)
        wants.append(fused.run(ext, x, grad, False))
    got = sink.take()
    assert len(got) == 3
    for (h, _, s, _), (want_h, want_s) in zip(got, wants):
        assert torch.equal(h, want_h) and torch.equal(s, want_s)


def _tapped_tokens_backward(ext, seed):
    """A bf16 token layer's tap on the current stream and its backward (the sums left to the
    finish): its output, sink, and layer_stats' sums of the same input and gradient."""
    torch.manual_seed(seed)
    module, x = _linear_tokens()
    out, sink, fused = _tapped(ext, module, x, False)
    grad = _backward(out)
    want_h, want_s = fused.run(ext, x, grad, False)
    return out, sink, want_h, want_s


def test_the_finish_holds_its_buffers_while_the_streams_memory_is_reused(ext):
    out, sink, want_h, want_s = _tapped_tokens_backward(ext, 2)
    del out  # (the layer's input and gradient are gone too)
    # the allocator hands freed memory of this stream out again: NaN over as much of it as it
    # gives, in the results blocks' size and smaller, before the take launches the finish
    junk = [torch.full((n,), float("nan"), device=DEV) for n in [1 << 18] * 32 + [1 << 14] * 256]
    del junk
    ((h, _, s, _),) = sink.take()
    assert torch.isfinite(h).all() and torch.isfinite(s).all()
    assert torch.equal(h, want_h) and torch.equal(s, want_s)


def test_a_take_on_another_stream_waits_for_the_finish(ext):
    # The backward runs on its own stream, the caller joins it (wait_stream) and takes on the
    # default stream: the finish is launched on the backward's stream after that join, behind
    # a long sleep there, so the sums read on the default stream are right only if the take
    # made it wait for the finish.
    torch.manual_seed(3)
    module, x = _linear_tokens()
    work = torch.cuda.Stream()
    work.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(work):
        out, sink, fused = _tapped(ext, module, x, False)
        grad = _backward(out)
        want_h, want_s = fused.run(ext, x, grad, False)
    torch.cuda.current_stream().wait_stream(work)
    with torch.cuda.stream(work):
        torch.cuda._sleep(200_000_000)  # (about 0.1 s: the finish waits behind it)
    ((h, _, s, _),) = sink.take()
    got_h, got_s = h.clone(), s.clone()  # (on the default stream)
    torch.cuda.synchronize()
    assert torch.equal(got_h, want_h) and torch.equal(got_s, want_s)


def test_a_take_under_a_graph_capture_raises_and_leaves_the_sums_for_a_later_take(ext):
    # An eager backward leaves its sums deferred on its stream; taking them on a stream being
    # captured into a CUDA graph would record the finish into the graph only.  The take
    # refuses, naming the fix, and the sums stay pending: taken after the capture, they are
    # the layer_stats of the backward.  (The backward runs on a stream of its own: asking
    # whether the legacy default stream is capturing while another stream captures is itself
    # an error that ends the capture.)
    work = torch.cuda.Stream()
    work.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(work):
        _, sink, want_h, want_s = _tapped_tokens_backward(ext, 4)
    torch.cuda.current_stream().wait_stream(work)
    graph, capturing = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    capturing.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(capturing):
        graph.capture_begin()
        try:
            with pytest.raises(RuntimeError, match="before the capture begins"):
                sink.take()
        finally:
            graph.capture_end()
    ((h, _, s, _),) = sink.take()
    assert torch.equal(h, want_h) and torch.equal(s, want_s)
