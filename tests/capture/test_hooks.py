"""The capture hooks: where each layer's input statistics are read, and the side stream.

With a trainable weight the input's statistics are computed in the backward pass (autograd
keeps the input unchanged until then); with a frozen weight nothing keeps it, so they are
read in the forward, before a later in-place operation can change the input.  On a GPU
the statistics run on a side stream, which must not change a single bit of the factors.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_cafin.capture import streams
from lightning_cafin.capture.hooks import attach, detach
from lightning_cafin.capture.layer_capture import LayerCapture
from lightning_cafin.capture.layers import rule_for


@contextlib.contextmanager
def always_captured(layer: nn.Module) -> Iterator[LayerCapture]:
    """``layer`` hooked for capture on every call inside the block, unhooked after it."""
    cap = LayerCapture("fc", layer, rule_for(layer), lambda: True)
    attach(cap)
    try:
        yield cap
    finally:
        detach(cap)


@pytest.mark.parametrize("weight_trainable", [False, True])
def test_input_statistics_see_the_input_of_the_forward(weight_trainable):
    torch.manual_seed(0)
    # Linear: autograd saves its input only for the weight's gradient (a convolution
    # saves it whatever requires grad, so it could not be modified in place at all)
    layer = nn.Linear(7, 5)
    layer.weight.requires_grad_(weight_trainable)
    with always_captured(layer) as cap:
        rule = cap.rule
        x = torch.randn(4, 7)
        want_h, want_hn = rule.input_partial(layer, x.clone())
        y = layer(x)
        if not weight_trainable:
            x.mul_(3.0)  # legal: nothing saved x; the statistics must predate this
        grad = torch.randn_like(y)
        y.backward(grad)
        want_s, want_sn = rule.output_partial(layer, grad)
    pending = cap.take_pending()
    assert pending.calls == 1
    torch.testing.assert_close(pending.h, want_h, rtol=1e-6, atol=0)
    torch.testing.assert_close(pending.s, want_s, rtol=1e-6, atol=0)
    assert (pending.hn, pending.sn) == (want_hn, want_sn)


def test_a_layer_computing_on_an_autocast_copy_has_its_input_read_in_the_forward():
    # under autocast a Linear given float32 computes on a bfloat16 copy, which autograd keeps
    # instead of the input: the input may then be changed in place before the backward (and
    # holding it to the backward would keep a second activation alive)
    torch.manual_seed(0)
    layer = nn.Linear(7, 5)
    with always_captured(layer) as cap:
        x = torch.randn(4, 7)
        want_h, want_hn = cap.rule.input_partial(layer, x.clone())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)
        assert y.dtype == torch.bfloat16
        x.mul_(3.0)  # legal: autograd saved the bfloat16 copy, not x
        y.float().square().sum().backward()
    pending = cap.take_pending()
    assert pending.calls == 1 and pending.hn == want_hn
    torch.testing.assert_close(pending.h, want_h, rtol=1e-6, atol=0)


def test_the_hook_lets_go_of_the_input_once_it_has_read_it():
    # autograd keeps a tensor hook as long as the graph (until the loss is dropped); a hook
    # still holding its layer's input would keep every activation to the end of the backward
    layer = nn.Linear(7, 5)
    with always_captured(layer) as cap:
        x = torch.randn(4, 7)
        held = x.untyped_storage()._weak_ref()
        y = layer(x)
        del x
        loss = y.square().sum()
        loss.backward()  # autograd releases the input it saved; the graph (and the hook) live on
        assert cap.pending.calls == 1
        assert torch.UntypedStorage._expired(held), "the capture hook still holds the layer's input"
        assert loss.grad_fn is not None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the side stream needs a CUDA device")
@pytest.mark.parametrize("priorities", [(False, False), (True, True), (False, True)],
                         ids=["default-priority", "high-priority", "priority-changed-between-micro-batches"])
def test_side_stream_factors_equal_current_stream_factors(priorities):
    """The side stream (at either priority, ``capture_side_high_priority``; changed between
    micro-batches, the first one's statistics pending on the other stream) gives the current
    stream's factors and weights bit for bit."""
    from lightning_cafin import AdaFisher
    from lightning_cafin.kernels.loader import load_extension
    from lightning_cafin.models.resnet import cifar_resnet18

    ext = load_extension()
    out = []
    for side in (True, False):
        previous, high_before = streams.set_enabled(side), ext.capture_side_high_priority(False)
        try:
            torch.manual_seed(0)
            model = cifar_resnet18().cuda()
            opt = AdaFisher(model, TCov=2, backend="fused")
            gen = torch.Generator().manual_seed(3)
            for _ in range(3):  # two capture steps (0 and 2), one plain step between
                opt.zero_grad()
                for high in priorities:  # gradient accumulation: partials added after the join
                    ext.capture_side_high_priority(high)
                    x = torch.randn(16, 3, 32, 32, generator=gen).cuda()
                    y = torch.randint(0, 10, (16,), generator=gen).cuda()
                    F.cross_entropy(model(x), y).backward()
                opt.step()
            torch.cuda.synchronize()
            out.append((model, opt))
        finally:
            streams.set_enabled(previous)
            ext.capture_side_high_priority(high_before)
    (m_side, o_side), (m_cur, o_cur) = out
    assert o_side.binding.captures.keys() == o_cur.binding.captures.keys() and o_cur.binding.captures
    for name, cap in o_cur.binding.captures.items():
        assert torch.equal(o_side.binding.captures[name].H, cap.H), name
        assert torch.equal(o_side.binding.captures[name].S, cap.S), name
    for a, b in zip(m_side.parameters(), m_cur.parameters()):
        assert torch.equal(a, b)


def test_a_deep_copy_of_a_bound_model_adds_nothing_to_the_original_layers():
    """``copy.deepcopy`` (an EMA model, a teacher) copies the modules' hook dicts, ours included:
    the copy's forwards must not add statistics to the original's layers."""
    from lightning_cafin import AdaFisher

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = AdaFisher(model, lr=1e-3, TCov=1, backend="foreach", capture="torch")
    model(torch.randn(5, 6)).mean().backward()
    opt.step()
    twin = copy.deepcopy(model)
    assert any(len(m._forward_hooks) or "forward" in vars(m) for m in twin.modules())  # the copy carries the hook
    opt.zero_grad()
    twin(torch.randn(5, 6)).mean().backward()  # a training forward with grad, on a capture step
    assert all(c.pending.calls == 0 for c in opt.binding.captures.values())
    model(torch.randn(5, 6)).mean().backward()
    assert all(c.pending.calls == 1 for c in opt.binding.captures.values())
    opt.step()
