"""Norm taps left to the end of their backward (``csrc/deferred_norms.h``, GPU only).

A plain backward's batch norms and layer norms get their statistics in one launch at the
backward's end, from the saved means and each call's own bias gradient: the same floats as
the launch in each norm's hook (``taps.deferred_norms(False)``), for a bf16 channels_last batch norm
under autocast, a layer norm on tokens and a norm with bf16 parameters in one launch; one
launch where the hooks made one each; and right where the backward runs on another stream
than the forward.  Inputs are fresh and random (never zeros).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_cafin import AdaFisher
from lightning_cafin.capture import taps

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the deferred norms need a CUDA device"),
]
DEV = "cuda"


class Mixed(nn.Module):
    """A channels_last convolution and batch norm under bf16 autocast, a layer norm on
    (batch, tokens, features), and a batch norm whose parameters are bf16 (its bias
    gradient bf16 beside the others' float32, in one launch)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 32, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(32)
        self.fc = nn.Linear(32, 48)
        self.ln = nn.LayerNorm(48)
        self.bn_bf16 = nn.BatchNorm1d(48).to(torch.bfloat16)
        self.head = nn.Linear(48, 10)

    def forward(self, x):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = torch.relu(self.bn(self.conv(x)))  # (B, 32, 8, 8)
            tokens = y.flatten(2).transpose(1, 2)  # (B, 64, 32)
            t = torch.tanh(self.ln(self.fc(tokens)))  # (B, 64, 48)
        t = t.mean(1).bfloat16()
        return self.head(torch.tanh(self.bn_bf16(t)).float())


NORMS = ("bn", "ln", "bn_bf16")


def _model():
    torch.manual_seed(0)
    return Mixed().to(DEV).to(memory_format=torch.channels_last)


def _batch(seed):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(16, 3, 8, 8, device=DEV, generator=gen).contiguous(memory_format=torch.channels_last)
    return x, torch.randint(0, 10, (16,), device=DEV, generator=gen)


def _sums(model, defer, backward=None):
    """Each norm's pending (calls, h, s, deferred taps) after one backward, with the taps'
    statistics deferred or not."""
    with taps.deferred_norms(defer):
        m = copy.deepcopy(model)
        opt = AdaFisher(m, TCov=1)
        x, y = _batch(1)
        loss = nn.functional.cross_entropy(m(x), y)
        (backward or torch.Tensor.backward)(loss)
        torch.cuda.synchronize()
    out = {}
    for name in NORMS:
        cap = opt.binding.captures[name]
        p = cap.pending
        deferred = sum(plan.deferred_norm_taps for plan in cap.tap_plans.values() if plan is not None)
        out[name] = (p.calls, p.h.clone(), p.s.clone(), deferred)
    return out


def test_deferred_norms_equal_the_hooks_launches_bit_for_bit(ext):
    model = _model()
    now, later = _sums(model, False), _sums(model, True)
    for name in NORMS:
        calls, h, s, taps = later[name]
        assert calls == now[name][0] == 1 and taps == 1 and now[name][3] == 0, name
        assert h.abs().sum() > 0 and s.abs().sum() > 0, name
        assert torch.equal(h, now[name][1]), name
        assert torch.equal(s, now[name][2]), name


def _norm_launches(model, defer):
    with taps.deferred_norms(defer):
        m = copy.deepcopy(model)
        AdaFisher(m, TCov=1)
        x, y = _batch(2)
        loss = nn.functional.cross_entropy(m(x), y)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            loss.backward()
            torch.cuda.synchronize()
    return sum(1 for e in prof.events() if "norm_stats_kernel" in e.name)


def test_a_backwards_deferred_norms_take_one_launch(ext):
    model = _model()
    assert _norm_launches(model, False) == len(NORMS)
    assert _norm_launches(model, True) == 1


def test_a_backward_on_another_stream_than_the_forward_reads_the_same_sums(ext):
    # the forward on the default stream, the backward called on another: autograd runs each
    # node on its forward's stream, the end of the backward on the caller's (made to wait for
    # the gradients), so the deferred launch reads the means and bias gradients made on the first
    model = _model()
    work = torch.cuda.Stream()

    def elsewhere(loss):
        work.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(work):
            torch.cuda._sleep(50_000_000)  # (the launch waits behind it)
            loss.backward()
        torch.cuda.current_stream().wait_stream(work)

    now, later = _sums(model, False), _sums(model, True, elsewhere)
    for name in NORMS:
        assert later[name][3] == 1, name
        assert torch.equal(later[name][1], now[name][1]), name
        assert torch.equal(later[name][2], now[name][2]), name
