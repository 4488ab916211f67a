"""A capture step that repeats the previous one takes its kept launch (``factors.KeptLaunch``).

On the CPU, with the extension's real taps and sinks and its ``take_single`` and
``SinkSet`` (the factor update, ``FactorLaunch``, is the kernel's torch restatement): the sums it takes are each sink's one result or
nothing; training through kept launches gives the factors and weights of training without
them, bit for bit, and every step that differs from the one kept (micro-batches, a layer
that did not run, a new loss scale, statistics from the Python hooks, new layers) takes the
general path with the same result.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch
from torch import nn

from lightning_cafin import AdaFisher
from lightning_cafin.capture import kernels as ck
from lightning_cafin.capture import taps
from lightning_cafin.capture.factors import LaunchKeeper, update_factors

from .test_capture_impl import fake_factor_update_
from .test_gradient_taps import ext, tap_setting  # noqa: F401  (fixtures)


class Tapped(nn.Module):
    """Only layers every step taps (conv, batch norm, a layer norm on 3-D tokens, linear), and
    an optional branch a step may skip."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.ln = nn.LayerNorm(4)
        self.fc = nn.Linear(4, 5)
        self.extra = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, skip_extra: bool = False) -> torch.Tensor:
        y = torch.relu(self.bn(self.conv(x))).flatten(2).transpose(1, 2)  # (B, HW, 4)
        y = self.ln(y)
        if not skip_extra:
            y = self.extra(y)
        return self.fc(y.mean(1))


@pytest.fixture
def kernels_on_cpu(ext, monkeypatch, tap_setting):  # noqa: F811
    """The capture path sees a stand-in extension for float32 CPU tensors: the real taps,
    sinks and ``SinkSet``, the factor update restated in torch (also ``FactorLaunch``, for
    the sums a ``SinkSet`` took); ``calls`` counts the layers whose sums each kept launch
    took (0: refused).
    ``with_take_single(False)`` leaves both out (no launch is then ever kept: the general
    path alone)."""
    calls: list[int] = []

    class CountedSinkSet:  # the extension's SinkSet (host code), its takes counted
        def __init__(self, *args):
            self.set = ext.SinkSet(*args)

        def take(self):
            taken = self.set.take()
            calls.append(0 if taken is None else len(taken))
            return taken

    class FactorLaunch:  # the extension's contract, with the update restated in torch
        def __init__(self, *args):
            self.args = args

        def run(self, taken, c_old, c_new):
            return fake_factor_update_(taken.h, taken.s, *self.args, c_old, c_new)

    def stand_in(with_take_single: bool) -> types.SimpleNamespace:
        fake = types.SimpleNamespace(layer_stats=ext.layer_stats, TapPlan=ext.TapPlan, TapSink=ext.TapSink,
                                     ForwardTapHook=ext.ForwardTapHook, factor_update_=fake_factor_update_)
        if with_take_single:
            fake.SinkSet, fake.FactorLaunch = CountedSinkSet, FactorLaunch
        return fake

    state = types.SimpleNamespace(calls=calls, fake=stand_in(True))

    def with_take_single(on: bool) -> None:
        state.fake = stand_in(on)

    monkeypatch.setattr(ck, "ext_for", lambda *t: state.fake if all(v.dtype == torch.float32 for v in t) else None)
    state.with_take_single = with_take_single
    taps.set_enabled(True)
    return state


def _train(model, steps, micro_batches=lambda step: 1, skip_extra=lambda step: False, scale=None):
    """``steps`` capture steps (TCov 1) of AdaFisher with the foreach step; returns the optimizer
    and each step's (layers updated, layers not fired)."""
    torch.manual_seed(1)
    opt = AdaFisher(model, lr=1e-2, TCov=1, backend="foreach")
    reports = []
    for step in range(steps):
        opt.zero_grad()
        for _ in range(micro_batches(step)):
            x, y = torch.randn(4, 3, 5, 5), torch.randint(0, 5, (4,))
            loss = nn.functional.cross_entropy(model(x, skip_extra(step)), y)
            (loss * scale(step) if scale else loss).backward()
        if scale:
            opt.grad_scale = torch.tensor(scale(step))
        opt.step()
        health = opt.health
        reports.append((health["capture_steps"], tuple(health["modules_not_fired"])))
    return opt, reports


def _assert_same(got, ref):
    for name, cap in got.binding.captures.items():
        want = ref.binding.captures[name]
        assert torch.equal(cap.H, want.H) and torch.equal(cap.S, want.S), name
    for p, q in zip(got.binding.model.parameters(), ref.binding.model.parameters()):
        assert torch.equal(p, q)


def _both_ways(kernels_on_cpu, **schedule):
    torch.manual_seed(0)
    model = Tapped()
    kernels_on_cpu.with_take_single(False)
    ref, ref_reports = _train(copy.deepcopy(model), **schedule)
    assert kernels_on_cpu.calls == []
    kernels_on_cpu.with_take_single(True)
    got, got_reports = _train(model, **schedule)
    _assert_same(got, ref)
    assert got_reports == ref_reports
    return got


def test_repeated_capture_steps_take_the_kept_launch_and_change_nothing(kernels_on_cpu):
    """Step 1 creates the factors, step 2 makes every slot and keeps the launch, steps 3-6 take it."""
    _both_ways(kernels_on_cpu, steps=6)
    assert kernels_on_cpu.calls == [5] * 4  # every layer's sums, in one call per step


@pytest.mark.parametrize("differs, takes", [("micro_batches", [5, 5, 5]), ("skipped_layer", [5, 5, 5, 5]),
                                            ("loss_scale", [5, 5, 5])])
def test_a_step_unlike_the_kept_one_takes_the_general_path(kernels_on_cpu, differs, takes):
    """The fourth step differs from the third (two micro-batches, a layer that did not run, a
    new loss scale): the kept launch refuses it in Python, before asking the extension, and
    the general path gives the factors, weights and report of a run without kept launches.
    Two micro-batches' counts and a new loss scale give every layer a new slot, so that
    launch can never serve again: the fifth step keeps one anew and the last two take it.
    A skipped layer changes no slot: the launch stays kept and the fifth step takes it too."""
    odd = lambda step: step == 3  # noqa: E731
    schedule = {"micro_batches": {"micro_batches": lambda step: 2 if odd(step) else 1},
                "skipped_layer": {"skip_extra": odd},
                "loss_scale": {"scale": lambda step: 8.0 if odd(step) else 4.0}}[differs]
    _both_ways(kernels_on_cpu, steps=7, **schedule)
    assert kernels_on_cpu.calls == takes  # all five layers each time, nothing refused by the extension


def test_statistics_from_the_python_hooks_take_the_general_path(kernels_on_cpu):
    """A step whose statistics came from the Python hooks (taps off) has no taps out: the kept
    launch is not taken, and the factors are those of a run without kept launches.  It
    changes no layer's slot, so the launch stays kept for the next step with taps."""
    torch.manual_seed(0)
    model = Tapped()
    ref_model, got_model = copy.deepcopy(model), model
    results = []
    for take_single, m in ((False, ref_model), (True, got_model)):
        kernels_on_cpu.with_take_single(take_single)
        torch.manual_seed(1)
        opt = AdaFisher(m, lr=1e-2, TCov=1, backend="foreach")
        for step in range(5):
            taps.set_enabled(step != 3)
            opt.zero_grad()
            nn.functional.cross_entropy(m(torch.randn(4, 3, 5, 5)), torch.randint(0, 5, (4,))).backward()
            opt.step()
        results.append(opt)
    _assert_same(results[1], results[0])
    assert kernels_on_cpu.calls == [5, 5]  # the third and fifth steps: the fourth was refused in Python


def test_a_kept_launch_outlives_a_step_unlike_it_only_while_it_can_serve(kernels_on_cpu):
    """A step that keeps no launch of its own leaves the kept one in place while every layer
    still holds the slot it was kept with and no factor tensor was replaced; otherwise the
    launch is dropped (it could never serve again, and would hold the old factors)."""
    torch.manual_seed(0)
    model = Tapped()
    opt = AdaFisher(model, lr=1e-2, TCov=1, backend="foreach")
    keeper = opt.binding.launch_keeper

    def step(micro_batches: int = 1, with_taps: bool = True) -> None:
        taps.set_enabled(with_taps)
        opt.zero_grad()
        for _ in range(micro_batches):
            nn.functional.cross_entropy(model(torch.randn(4, 3, 5, 5)), torch.randint(0, 5, (4,))).backward()
        opt.step()
        taps.set_enabled(True)

    step()
    step()  # the first step made the factors, the second every slot: its launch is kept
    first = keeper.launch
    assert first is not None and kernels_on_cpu.calls == []
    step(with_taps=False)  # the Python hooks' statistics: the general path, every slot kept
    assert keeper.launch is first and kernels_on_cpu.calls == []
    step()
    assert keeper.launch is first and kernels_on_cpu.calls == [5]  # taken again
    step(micro_batches=2)  # twice the counts: a new slot per layer, nothing to keep
    assert keeper.launch is None and kernels_on_cpu.calls == [5]
    step()
    second = keeper.launch
    assert second is not None and second is not first
    step(with_taps=False)
    assert keeper.launch is second
    cap = opt.binding.captures["conv"]
    cap.S = cap.S.clone()  # a factor tensor replaced: no kept slot is valid any more
    step(with_taps=False)
    assert keeper.launch is None and kernels_on_cpu.calls == [5]


def test_take_single_takes_every_sinks_one_result_or_nothing(ext):  # noqa: F811
    torch.manual_seed(0)
    sinks = [ext.TapSink() for _ in range(3)]
    plans = [ext.TapPlan(sink, [0, -1, 1], 0.0, -1, True, 0.0, 4.0, 4.0) for sink in sinks]
    lins = [nn.Linear(3, 2) for _ in sinks]

    def tap_all(times=1):
        for plan, lin in zip(plans, lins):
            for _ in range(times):
                x = torch.randn(4, 3)
                out = lin(x)
                plan.tap(x, out, False)
                out.sum().backward()

    like = [torch.zeros(1)] * 3
    args = ([3, 3, 3], [4.0] * 3, [2, 2, 2], [4.0] * 3)
    tap_all()
    assert ext.take_single(sinks, like, [3, 3, 2], *args[1:]) is None  # a size that does not fit
    assert ext.take_single(sinks, like, args[0], [4.0, 8.0, 4.0], *args[2:]) is None  # a count
    assert ext.take_single(sinks, [torch.zeros(1, dtype=torch.float64).to("meta")] * 3, *args) is None  # a device
    assert [len(s) for s in sinks] == [1, 1, 1]  # nothing taken
    taken = ext.take_single(sinks, like, *args)
    assert [len(sink) for sink in sinks] == [0, 0, 0] and len(taken) == 3
    assert [t.shape for t in taken.h] == [(3,)] * 3 and [t.shape for t in taken.s] == [(2,)] * 3
    assert ext.take_single(sinks, like, *args) is None  # empty sinks
    tap_all(times=2)
    assert ext.take_single(sinks, like, *args) is None and [len(sink) for sink in sinks] == [2, 2, 2]
    with pytest.raises(RuntimeError, match="one entry per sink"):
        ext.take_single(sinks, like[:2], *args)
    with pytest.raises(RuntimeError, match=r"sinks\[2\] appears twice"):
        ext.take_single([sinks[0], sinks[1], sinks[0]], like, *args)
    # a SinkSet: the same arguments checked and converted once, the same contract per take
    with pytest.raises(RuntimeError, match=r"sinks\[2\] appears twice"):
        ext.SinkSet([sinks[0], sinks[1], sinks[0]], like, *args)
    with pytest.raises(RuntimeError, match="one entry per sink"):
        ext.SinkSet(sinks, like, [3, 3], *args[1:])
    for s in sinks:
        s.take()
    wrong, right = ext.SinkSet(sinks, like, [3, 3, 2], *args[1:]), ext.SinkSet(sinks, like, *args)
    assert len(right) == 3 and right.take() is None  # empty sinks
    tap_all()
    assert wrong.take() is None and [len(s) for s in sinks] == [1, 1, 1]
    taken = right.take()
    assert len(taken) == 3 and [len(s) for s in sinks] == [0, 0, 0]
    tap_all()
    assert len(right.take()) == 3  # again, next step


def test_a_keeper_is_dropped_when_the_layers_change(kernels_on_cpu):
    """Re-pairing the optimizer's parameters (a new param group) drops the kept launch."""
    torch.manual_seed(0)
    model = Tapped()
    opt, _ = _train(model, steps=3)
    keeper = opt.binding.launch_keeper
    assert isinstance(keeper, LaunchKeeper) and keeper.launch is not None
    extra = nn.Parameter(torch.zeros(2))
    opt.add_param_group({"params": [extra]})
    assert keeper.launch is None
    assert update_factors([], 0.8, None, keeper).not_fired == []
