"""The taps' worker thread (``csrc/tap_thread.h``, ``taps.set_thread``) on the CPU, with the
compiled extension: its taps' statistics on CPU tensors (the ATen reference) run on the
worker, and a capture gives the factors and weights of a capture without it, bit for bit;
the backward waits for the worker at its end (the sums are in their sinks when it returns)
and raises a failing tap's error; the setting comes from its environment variable and
reaches the extension once per change.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch
from torch import nn

from lightning_cafin.capture import taps

from .test_fused_stats import _Net
from .test_gradient_taps import _train, ext, on_cpu, setting_in_a_fresh_process, tap_setting  # noqa: F401


@pytest.fixture
def thread(ext):  # noqa: F811
    """The worker thread on for the test (the extension's own setting), off again after it."""
    ext.set_tap_thread(True)
    yield ext
    ext.set_tap_thread(False)


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_the_worker_gives_the_taps_results_bit_for_bit(on_cpu, ext, micro_batches):  # noqa: F811
    torch.manual_seed(0)
    model = _Net()
    jobs = ext.tap_thread_jobs()
    ref = _train(copy.deepcopy(model), 3, taps_on=True, micro_batches=micro_batches)
    assert ext.tap_thread_jobs() == jobs  # (off: every tap ran its statistics itself)
    ext.set_tap_thread(True)
    try:
        got = _train(model, 3, taps_on=True, micro_batches=micro_batches)
    finally:
        ext.set_tap_thread(False)
    # the five tapped layers (conv, bn, conv1d, ln, fc), per micro-batch of each step, on the worker
    assert ext.tap_thread_jobs() - jobs == 3 * micro_batches * 5
    for name, cap in got.binding.captures.items():
        want = ref.binding.captures[name]
        assert torch.equal(cap.H, want.H) and torch.equal(cap.S, want.S), name
    for p, q in zip(got.binding.model.parameters(), ref.binding.model.parameters()):
        assert torch.equal(p, q)


def test_the_sums_are_in_the_sink_when_the_backward_returns(thread):
    x = torch.randn(64, 32)
    w = torch.randn(32, 16, requires_grad=True)
    sinks = []
    outs = []
    for _ in range(20):  # queued one after the other, in the order the taps fire
        out = x @ w
        sink = thread.TapSink()
        thread.TapPlan(sink, [0, 1, 1], 0.0, 1, True, 0.0, 64.0, 64.0).tap(x, out)
        sinks.append(sink)
        outs.append(out)
    jobs = thread.tap_thread_jobs()
    torch.stack(outs).square().sum().backward()
    assert [len(s) for s in sinks] == [1] * 20  # no wait of the test's own: the backward's
    assert thread.tap_thread_jobs() - jobs == 20
    want_h, want_s = thread.layer_stats(x, 2 * outs[0].detach(), [0, 1, 1], 0.0, 1, True, 0.0, False)
    for sink in sinks:
        ((h, hn, s, sn),) = sink.take()
        assert torch.equal(h, want_h) and torch.equal(s, want_s) and (hn, sn) == (64.0, 64.0)


def test_a_failing_tap_on_the_worker_raises_from_the_backward_call_once(thread):
    x = torch.randn(3, 4)
    w = torch.randn(4, 2, requires_grad=True)
    out = x @ w
    sink = thread.TapSink()
    thread.TapPlan(sink, [0, 7, 1], 0.0, 1, True, 0.0, 3.0, 3.0).tap(x, out)  # dim 7 of a 2-D input
    with pytest.raises((RuntimeError, IndexError), match="[Dd]imension|dim"):
        out.sum().backward()
    assert len(sink) == 0
    thread.tap_thread_drain()  # (the error was raised once: nothing left to raise)
    out = x @ w
    thread.TapPlan(sink, [0, 1, 1], 0.0, 1, True, 0.0, 3.0, 3.0).tap(x, out)
    out.sum().backward()
    assert len(sink) == 1


def test_the_setting_reaches_an_extension_once_per_change():
    given = []
    fake = types.SimpleNamespace(set_tap_thread=given.append)
    previous = taps.set_thread(False)
    try:
        taps.give_thread_setting(fake)
        taps.give_thread_setting(fake)
        taps.set_thread(True)
        assert taps.thread_enabled() is True
        taps.give_thread_setting(fake)
        taps.give_thread_setting(fake)
        assert given == [False, True]
        taps.give_thread_setting(types.SimpleNamespace())  # an extension built before the thread: nothing
    finally:
        taps.set_thread(previous)


@pytest.mark.parametrize("value, want", [("1", "True"), ("on", "True"), ("0", "False"), ("", "False"), (None, "False"),
                                         ("often", "ValueError")])
def test_the_thread_setting_comes_from_its_environment_variable(value, want):
    """Off unless the variable turns it on (no benchmark has measured it yet)."""
    out = setting_in_a_fresh_process("taps.thread_enabled()", taps.THREAD_ENV_VAR, value)
    assert out.startswith(want)
    if want == "ValueError":
        assert taps.THREAD_ENV_VAR in out


def test_a_model_captures_through_the_worker_under_a_loss_that_needs_no_taps(thread):
    """A backward whose graph has no tapped layer (the worker idle) returns as before."""
    layer = nn.Linear(4, 2)
    layer(torch.randn(3, 4)).sum().backward()
    assert layer.weight.grad is not None
    thread.tap_thread_drain()


class _ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn(self.conv(x)))
        return self.fc(torch.relu(self.conv2(y)).mean((2, 3)))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA kernels behind the taps need a CUDA device")
@pytest.mark.parametrize("side", [False, True])
def test_on_the_gpu_the_worker_gives_the_same_factors_in_bf16_channels_last(ext, side):  # noqa: F811
    """Capture steps of a conv / batch norm / linear model in bf16 autocast and channels_last,
    with the statistics on the current stream or the side stream: the worker launches the
    same kernels on the same tensors, so the factors and weights are equal bit for bit."""
    from lightning_cafin import AdaFisher
    from lightning_cafin.capture import streams

    def train(worker: bool) -> AdaFisher:
        torch.manual_seed(0)
        model = _ConvNet().cuda().to(memory_format=torch.channels_last)
        opt = AdaFisher(model, lr=1e-2, TCov=1)
        ext.set_tap_thread(worker)
        try:
            for _ in range(4):
                opt.zero_grad()
                x = torch.randn(32, 3, 16, 16, device="cuda").to(memory_format=torch.channels_last)
                y = torch.randint(0, 10, (32,), device="cuda")
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
        finally:
            ext.set_tap_thread(False)
        return opt

    previous = streams.set_enabled(side)
    try:
        ref, got = train(False), train(True)
    finally:
        streams.set_enabled(previous)
    assert ref.health["capture_steps"] == got.health["capture_steps"] == 4
    for name, cap in got.binding.captures.items():
        want = ref.binding.captures[name]
        assert cap.H is not None and torch.equal(cap.H, want.H) and torch.equal(cap.S, want.S), name
    for p, q in zip(got.binding.model.parameters(), ref.binding.model.parameters()):
        assert torch.equal(p, q)
