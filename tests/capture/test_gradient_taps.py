"""C++ gradient taps (``csrc/capture_tap.h``, ``capture/taps.py``) on the CPU, with the compiled
extension: its ``layer_stats`` on CPU tensors (the ATen reference the taps call here)
computes each rule's two partial sums, and a capture through taps gives the factors and
weights of a capture through the Python hooks, bit for bit, with every C++ path a tap
has (micro-batches, a retained graph, activation checkpointing, an error, layers that
are not fusable).

The CUDA kernels behind ``layer_stats`` are compared with the rules in ``tests/kernels``.
These tests need the extension built (``python -m lightning_cafin.kernels.loader --build``;
``.ci/run`` builds it and sets ``CAFIN_REQUIRE_EXTENSION=1``, which makes a missing one a
failure instead of a skip); they never build it themselves.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_cafin import AdaFisher, no_capture
from lightning_cafin.capture import kernels as ck
from lightning_cafin.capture import taps
from lightning_cafin.capture.layers import rule_for
from lightning_cafin.kernels.loader import extension_if_built

from .test_activation_checkpointing import Net, factors_after_two_captures
from .test_capture_impl import fake_factor_update_
from .test_fused_stats import CASES, _Float, _Net
from .test_rules_kernels import fake_channel_stats, fake_conv_input_stats

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ext():
    module = extension_if_built()
    if module is None or not hasattr(module, "TapPlan"):
        why = "the CUDA extension is not built here (python -m lightning_cafin.kernels.loader --build)"
        if os.environ.get("CAFIN_REQUIRE_EXTENSION") == "1":
            pytest.fail(why + ", and CAFIN_REQUIRE_EXTENSION=1 requires it")
        pytest.skip(why)
    return module


@pytest.fixture
def tap_setting():
    previous = taps.set_enabled(False)
    yield
    taps.set_enabled(previous)


def test_using_sets_the_taps_inside_the_block_and_restores_them_after_it():
    previous = taps.set_enabled(False)
    try:
        with taps.using(True):
            assert taps.enabled() is True
        assert taps.enabled() is False
        with pytest.raises(KeyError), taps.using(True):
            raise KeyError("an error inside the block")
        assert taps.enabled() is False  # restored on the way out of an error too
    finally:
        taps.set_enabled(previous)


@pytest.fixture
def on_cpu(ext, monkeypatch, tap_setting):
    """The capture path sees the extension for float32 CPU tensors (layer_stats' CPU reference,
    the taps), with the factor update's stand-in; counts the ops the Python hooks call."""
    calls: list[str] = []
    monkeypatch.setattr(ck, "ext_for", cpu_ext_for(ext, calls))
    return calls


def cpu_ext_for(ext, calls: list[str]):
    """A stand-in for ``capture.kernels.ext_for`` that gives float32 CPU tensors the
    extension's layer_stats and taps (each layer_stats call noted in ``calls``) and the
    factor update's stand-in (also used by spawned processes, where no fixture reaches)."""

    def layer_stats(*args):
        calls.append("layer_stats")
        return ext.layer_stats(*args)

    stand_in = types.SimpleNamespace(layer_stats=layer_stats, TapPlan=ext.TapPlan, TapSink=ext.TapSink,
                                     channel_stats=fake_channel_stats, conv_input_stats=fake_conv_input_stats,
                                     factor_update_=fake_factor_update_, autocast_copy=ext.autocast_copy)
    return lambda *t: stand_in if all(v.dtype == torch.float32 for v in t) else None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(n for n, case in CASES.items() if case[2]))
def test_reference_layer_stats_compute_the_rules_partials(ext, name, dtype):
    make, shape, _ = CASES[name]
    torch.manual_seed(0)
    module = make().double()
    x = torch.randn(*shape, dtype=torch.float64).to(dtype)
    with torch.no_grad():
        grad = torch.randn_like(module(x.double())).to(dtype)
    rule = rule_for(module)
    fused = rule.fused_stats(module, x.shape, grad.shape)
    saved = ck.ext_for
    ck.ext_for = lambda *t: None  # the partials on the torch ops, in float64
    try:
        h_want, _ = rule.input_partial(module, x.double())
        s_want, _ = rule.output_partial(module, grad.double())
    finally:
        ck.ext_for = saved
    h, s = ext.layer_stats(x, grad, fused.input_op, fused.input_div, fused.grad_dim, fused.grad_square,
                           fused.grad_div, False)
    assert h.dtype == s.dtype == torch.float32 and h.is_contiguous() and s.is_contiguous()
    torch.testing.assert_close(h.double(), h_want.double().flatten(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s.double(), s_want.double().flatten(), rtol=1e-5, atol=1e-6)


def _train(model, steps, taps_on, micro_batches=1):
    taps.set_enabled(taps_on)
    torch.manual_seed(1)
    opt = AdaFisher(model, lr=1e-2, TCov=1, backend="foreach")
    for _ in range(steps):
        opt.zero_grad()
        for _ in range(micro_batches):
            x, y = torch.randn(4, 3, 6, 6), torch.randint(0, 5, (4,))
            nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return opt


@pytest.mark.parametrize("steps", [1, 3])
def test_taps_give_the_python_hooks_factors_and_weights(on_cpu, steps):
    """The first capture: the same layer_stats call on both paths, bitwise, and the norms'
    sums from autograd's (test_norm_taps.py) equal up to rounding.  Later captures see weights
    that those roundings (through the factors) moved by ~1e-7, so every layer is then equal
    up to rounding: whether a rounding shows in a later float32 sum depends on the CPU's
    vector kernels."""
    torch.manual_seed(0)
    model = _Net()
    hooked, tapped = copy.deepcopy(model), copy.deepcopy(model)
    ref = _train(hooked, steps, taps_on=False)
    python_calls = on_cpu.count("layer_stats")
    got = _train(tapped, steps, taps_on=True)
    fusable = {"conv", "bn", "conv1d", "ln", "fc"}
    assert python_calls == steps * len(fusable)
    assert on_cpu.count("layer_stats") == python_calls  # no Python hook called it for the tapped run
    norms = {"bn", "ln"}  # their taps take autograd's sums (test_norm_taps.py): equal up to rounding
    for name, cap in got.binding.captures.items():
        assert (cap.sink is not None) == (name in fusable), name
        want = ref.binding.captures[name]
        if name in norms or steps > 1:
            rtol = 1e-6 if steps == 1 else 1e-5
            torch.testing.assert_close(cap.H, want.H, rtol=rtol, atol=1e-8, msg=name)
            torch.testing.assert_close(cap.S, want.S, rtol=rtol, atol=1e-8, msg=name)
        else:  # the same layer_stats call on both paths, on the same weights
            assert torch.equal(cap.H, want.H) and torch.equal(cap.S, want.S), name
    for p, q in zip(tapped.parameters(), hooked.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


def test_an_extension_built_before_the_taps_leaves_every_layer_to_the_python_hooks(ext, on_cpu, monkeypatch):
    torch.manual_seed(0)
    model = _Net()
    hooked, untapped = copy.deepcopy(model), copy.deepcopy(model)
    ref = _train(hooked, 2, taps_on=False)
    python_calls = on_cpu.count("layer_stats")
    stand_in = ck.ext_for(torch.zeros(1))
    old_build = types.SimpleNamespace(**{k: v for k, v in vars(stand_in).items() if k not in ("TapPlan", "TapSink")})
    monkeypatch.setattr(ck, "ext_for", lambda *t: old_build if all(v.dtype == torch.float32 for v in t) else None)
    got = _train(untapped, 2, taps_on=True)
    assert on_cpu.count("layer_stats") == 2 * python_calls  # every statistic by a Python hook's call
    for name, cap in got.binding.captures.items():
        assert cap.sink is None and cap.taps_out == 0, name
        want = ref.binding.captures[name]
        assert torch.equal(cap.H, want.H) and torch.equal(cap.S, want.S), name


def test_a_layer_keeps_its_tap_plan_per_shapes_and_its_sink_per_extension(on_cpu, monkeypatch):
    """The forward of a capture step makes one call per tapped layer: the plan is made on
    the first capture with those shapes and kept; another batch size gets a plan of its own;
    another extension gets new plans and a sink of its own, the old sink's results kept."""
    torch.manual_seed(0)
    model = _Net()
    opt = _train(model, 1, taps_on=True)
    fc = opt.binding.captures["fc"]
    (first,) = fc.tap_plans.values()
    sink = fc.sink

    def forward_backward(batch):
        nn.functional.cross_entropy(model(torch.randn(batch, 3, 6, 6)), torch.randint(0, 5, (batch,))).backward()

    opt.zero_grad()
    forward_backward(4)
    assert list(fc.tap_plans.values()) == [first] and fc.sink is sink and len(sink) == 1  # kept, by identity
    forward_backward(2)  # a second micro-batch of another size
    assert len(fc.tap_plans) == 2 and first in fc.tap_plans.values() and len(sink) == 2
    other = types.SimpleNamespace(**vars(ck.ext_for(torch.ones(1))))  # the same ops, another extension object
    monkeypatch.setattr(ck, "ext_for", lambda *t: other if all(v.dtype == torch.float32 for v in t) else None)
    forward_backward(4)
    assert fc.sink is not sink and len(fc.sink) == 1 and list(fc.tap_plans.values()) != [first]
    assert fc.pending.calls == 3  # the first sink's two results were moved to the pending sums, then the new one's
    opt.step()


def test_the_sinks_are_asked_only_while_taps_are_out(on_cpu):
    """A step without a capture asks no sink (``taps_out`` is 0 on every layer), and a tap
    still out when the pending sums are read adds its result when it fires."""
    torch.manual_seed(0)
    model = _Net()
    opt = _train(model, 2, taps_on=True)
    caps = opt.binding.captures.values()
    assert any(c.sink is not None for c in caps) and all(c.taps_out == 0 for c in caps)
    opt.capture_next_step()
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(torch.randn(4, 3, 6, 6)), torch.randint(0, 5, (4,)))
    tapped = [c for c in caps if c.taps_out]
    assert len(tapped) == 5 and all(c.pending.calls == 0 for c in tapped)  # read before the backward
    loss.backward()
    assert all(c.pending.calls == 1 and c.taps_out == 0 for c in tapped)
    opt.step()


def test_micro_batches_add_up_as_with_the_python_hooks(on_cpu):
    torch.manual_seed(0)
    model = _Net()
    hooked, tapped = copy.deepcopy(model), copy.deepcopy(model)
    ref = _train(hooked, 2, taps_on=False, micro_batches=3)
    got = _train(tapped, 2, taps_on=True, micro_batches=3)
    for name, cap in got.binding.captures.items():
        want = ref.binding.captures[name]
        torch.testing.assert_close(cap.H, want.H, rtol=1e-6, atol=0)
        torch.testing.assert_close(cap.S, want.S, rtol=1e-6, atol=0)


def test_pending_holds_what_the_taps_took_and_a_retained_graph_adds_nothing(on_cpu):
    taps.set_enabled(True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 3))
    opt = AdaFisher(model, lr=1e-3, TCov=1, backend="foreach")
    loss = model(torch.randn(5, 6)).square().mean()
    loss.backward(retain_graph=True)
    loss.backward()  # the taps' inputs are gone: nothing more
    caps = list(opt.binding.captures.values())
    assert [len(c.sink) for c in caps] == [1, 1]
    pending = [c.pending for c in caps]  # reading takes the results from the sink
    assert [p.calls for p in pending] == [1, 1] and [len(c.sink) for c in caps] == [0, 0]
    assert pending[0].hn == 5 and pending[0].sn == 5 and pending[0].h.shape == (6,) and pending[0].s.shape == (4,)


class _ReadInTheForward(nn.Module):
    """Layers whose input statistics are read in the forward: a frozen weight (its bias
    trains), and a Linear computing on a cast copy (a float64 input, cast by the module)."""

    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(6, 5)
        self.frozen.weight.requires_grad_(False)
        self.cast = _CastLinear(5, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.relu(self.cast(torch.relu(self.frozen(x)).double())))


class _CastLinear(nn.Linear):
    def forward(self, x):
        return super().forward(x.float())


def _train_read_in_forward(model, taps_on, retain=False):
    taps.set_enabled(taps_on)
    torch.manual_seed(1)
    opt = AdaFisher(model, lr=1e-2, TCov=1, backend="foreach")
    for _ in range(3):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(torch.randn(7, 6)), torch.randint(0, 3, (7,)))
        loss.backward(retain_graph=retain)
        if retain:  # a second backward through the retained graph adds no pair
            loss.backward()
        opt.step()
    return opt


@pytest.mark.parametrize("retain", [False, True])
def test_gradient_taps_where_the_input_is_read_in_the_forward(on_cpu, retain):
    torch.manual_seed(0)
    model = _ReadInTheForward()
    hooked, tapped = copy.deepcopy(model), copy.deepcopy(model)
    ref = _train_read_in_forward(hooked, False, retain)
    got = _train_read_in_forward(tapped, True, retain)
    assert all(c.sink is not None for c in got.binding.captures.values())  # frozen and cast layers too
    assert all(c.sink is None for c in ref.binding.captures.values())
    for name, cap in got.binding.captures.items():
        want = ref.binding.captures[name]
        assert torch.equal(cap.H, want.H) and torch.equal(cap.S, want.S), name
    for p, q in zip(tapped.parameters(), hooked.parameters()):
        assert torch.equal(p, q)


@pytest.fixture
def on_cpu_bf16(on_cpu, ext, monkeypatch):
    """As ``on_cpu``, the extension also seen for bfloat16 CPU tensors (an autocast layer's
    float32 input and bfloat16 output), counting the statistics ops the Python hooks call."""
    stand_in = ck.ext_for(torch.zeros(1))
    counted = types.SimpleNamespace(**vars(stand_in))

    def channel_stats(*args):
        on_cpu.append("channel_stats")
        return fake_channel_stats(*args)

    counted.channel_stats = channel_stats
    monkeypatch.setattr(ck, "ext_for", lambda *t: counted if all(v.dtype in (torch.float32, torch.bfloat16) for v in t) else None)
    return on_cpu


def _train_autocast(model, taps_on):
    taps.set_enabled(taps_on)
    torch.manual_seed(1)
    opt = AdaFisher(model, lr=1e-2, TCov=1, backend="foreach")
    for _ in range(3):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(torch.randn(7, 6))
        nn.functional.cross_entropy(out.float(), torch.randint(0, 3, (7,))).backward()
        opt.step()
    return opt


def test_a_layer_computing_on_an_autocast_copy_reads_its_input_in_the_tap_call(on_cpu_bf16):
    """Under autocast a Linear computes on a bfloat16 copy of its float32 input, so the input
    is read in the forward: by the tap's own call (``TapPlan.tap_read``), not by a Python
    statistics op beside it; the factors are the Python hooks'."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    hooked, tapped = copy.deepcopy(model), copy.deepcopy(model)
    ref = _train_autocast(hooked, False)
    python_ops = len(on_cpu_bf16)
    assert python_ops > 0  # the Python hooks' own statistics ops, counted
    got = _train_autocast(tapped, True)
    assert len(on_cpu_bf16) == python_ops  # no statistics op called from Python with the taps
    for name, cap in got.binding.captures.items():
        assert cap.sink is not None, name
        want = ref.binding.captures[name]
        torch.testing.assert_close(cap.H, want.H, rtol=1e-5, atol=1e-7, msg=name)
        torch.testing.assert_close(cap.S, want.S, rtol=1e-5, atol=1e-7, msg=name)


def _capture_forward(model, opt):
    """A capture step's forward and loss (for the caller to run the backward of)."""
    opt.capture_next_step()
    opt.zero_grad()
    return nn.functional.cross_entropy(model(torch.randn(4, 3, 6, 6)), torch.randint(0, 5, (4,)))


def test_a_layer_with_its_plan_kept_still_takes_no_tap_where_the_forward_differs(on_cpu):
    """A kept tap plan decides nothing by itself: inside ``no_capture()`` or with taps
    turned off, a layer whose plan is kept takes no tap (a saved-tensor hook: below)."""
    torch.manual_seed(0)
    model = _Net()
    opt = _train(model, 1, taps_on=True)  # the plans are made and kept
    caps = opt.binding.captures
    tapped = [c for c in caps.values() if c.sink is not None]
    assert len(tapped) == 5 and all(len(c.tap_plans) == 1 for c in tapped)

    with no_capture():
        loss = _capture_forward(model, opt)
    assert all(c.taps_out == 0 and c.excluded_forwards == 1 for c in caps.values())
    loss.backward()
    opt.step()

    with taps.using(False):
        loss = _capture_forward(model, opt)
        assert all(c.taps_out == 0 for c in caps.values())
        loss.backward()
    assert all(len(c.sink) == 0 and c.pending.calls == 1 for c in tapped)  # the Python hooks' pairs
    opt.step()


class _ChangedAfterUse(nn.Module):
    """``fc2``'s input is changed in place after ``fc2`` used it: legal where a saved-tensor
    hook keeps copies, and the reason a layer then reads its input in the forward."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 5), nn.Linear(5, 3)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        out = self.fc2(h)
        h.mul_(3.0)
        return out


def test_under_a_saved_tensor_hook_a_kept_plan_still_reads_the_input_in_the_forward(on_cpu):
    torch.manual_seed(0)
    model = _ChangedAfterUse()
    runs = {}
    for taps_on in (False, True):
        taps.set_enabled(taps_on)
        net = copy.deepcopy(model)
        torch.manual_seed(1)
        opt = AdaFisher(net, lr=1e-2, TCov=1, backend="foreach")
        for _ in range(3):  # the first capture makes the plans; the later ones find them kept
            opt.zero_grad()
            with torch.autograd.graph.saved_tensors_hooks(torch.clone, lambda t: t):
                loss = net(torch.randn(7, 6)).square().mean()
            loss.backward()
            opt.step()
        runs[taps_on] = opt.binding.captures
    assert all(c.sink is not None and c.tap_plans for c in runs[True].values())
    for name, cap in runs[True].items():
        want = runs[False][name]
        assert torch.equal(cap.H, want.H) and torch.equal(cap.S, want.S), name


def test_a_second_backward_adds_no_pair_on_either_path(on_cpu):
    counts = {}
    for taps_on in (False, True):
        taps.set_enabled(taps_on)
        torch.manual_seed(0)
        model = _ReadInTheForward()
        opt = AdaFisher(model, lr=1e-3, TCov=1, backend="foreach")
        loss = model(torch.randn(4, 6)).square().mean()
        loss.backward(retain_graph=True)
        loss.backward()
        counts[taps_on] = [c.pending.calls for c in opt.binding.captures.values()]
    assert counts[False] == counts[True] == [1, 1, 1]


def test_a_failing_tap_raises_from_the_backward_call(ext):
    x = torch.randn(3, 4)
    w = torch.randn(4, 2, requires_grad=True)
    out = x @ w
    sink = ext.TapSink()
    ext.TapPlan(sink, [0, 7, 1], 0.0, 1, True, 0.0, 3.0, 3.0).tap(x, out)  # dim 7 of a 2-D input
    with pytest.raises((RuntimeError, IndexError), match="[Dd]imension|dim"):
        out.sum().backward()
    assert len(sink) == 0


def test_the_taps_refuse_an_output_without_grad(ext):
    x = torch.randn(3, 4)
    plan = ext.TapPlan(ext.TapSink(), [0, 1, 1], 0.0, 1, True, 0.0, 3.0, 3.0)
    with pytest.raises(RuntimeError, match="TapPlan.tap: output must require grad"):
        plan.tap(x, x * 2)
    with pytest.raises(RuntimeError, match="TapPlan.tap_gradient: output must require grad"):
        plan.tap_gradient(x * 2, torch.ones(4), 3.0)
    with pytest.raises(RuntimeError, match="TapPlan.tap_read: output must require grad"):
        plan.tap_read(x, x * 2)


def test_tap_read_reads_the_input_in_the_call_and_checks_its_input_op(ext):
    x = torch.randn(3, 4)
    w = torch.randn(4, 2, requires_grad=True)
    out = x.clone() @ w  # (autograd keeps the copy, as under autocast)
    sink = ext.TapSink()
    ext.TapPlan(sink, [0, 1, 1], 0.0, 1, True, 0.0, 3.0, 3.0).tap_read(x, out)
    want_h, want_s = ext.layer_stats(x.clone(), 2 * out.detach(), [0, 1, 1], 0.0, 1, True, 0.0, False)
    x.zero_()  # changed after the call: the tap read it already
    out.square().sum().backward()
    ((h, hn, s, sn),) = sink.take()
    assert (hn, sn) == (3.0, 3.0) and torch.equal(h, want_h) and torch.equal(s, want_s) and h.abs().sum() > 0
    with pytest.raises(RuntimeError, match="input_op must be"):
        ext.TapPlan(ext.TapSink(), [2, 1, 1], 0.0, 1, True, 0.0, 3.0, 3.0).tap_read(x, x @ w)
    with pytest.raises(RuntimeError, match="TapPlan: sink must be a TapSink"):
        ext.TapPlan(None, [0, 1, 1], 0.0, 1, True, 0.0, 3.0, 3.0)


def _norm_then_linear(bias: bool, leading: tuple[int, ...]):
    """A float32 LayerNorm's output (a graph node of its own) and a Linear on it under bf16
    autocast: the Linear computes on a bfloat16 copy of it (a GPT block's attention and MLP inputs)."""
    torch.manual_seed(0)
    norm, linear = nn.LayerNorm(6), nn.Linear(6, 4, bias=bias)
    z = norm(torch.randn(*leading, 6))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = linear(z)
    assert z.dtype == torch.float32 and out.dtype == torch.bfloat16
    return z, out, linear


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("leading", [(10,), (2, 5), (2, 1, 5)])
def test_autocast_copy_is_the_copy_autograd_saved_for_the_weight(ext, bias, leading):
    """2-D input: the product's own node; 3-D and more: a view of it (flattened first)."""
    z, out, _ = _norm_then_linear(bias, leading)
    copy = ext.autocast_copy(z, out)
    assert copy is not None and copy.dtype == torch.bfloat16 and copy.shape == (10, 6)
    assert torch.equal(copy, z.detach().to(torch.bfloat16).reshape(10, 6))
    # the very tensor autograd saved (no copy of ours)
    node = out.grad_fn
    if type(node).__name__ in ("ViewBackward0", "UnsafeViewBackward0"):
        node = node.next_functions[0][0]
    want = node._saved_mat1 if bias else node._saved_self
    assert copy.data_ptr() == want.data_ptr()


def test_autocast_copy_of_a_hugging_face_conv1d_casts_after_its_view(ext):
    """GPT-2's ``Conv1D`` flattens its input before ``addmm`` (autocast then casts the view):
    the walk passes the cast first, then the view."""
    conv1d = pytest.importorskip("transformers.pytorch_utils").Conv1D
    torch.manual_seed(0)
    norm, layer = nn.LayerNorm(6), conv1d(4, 6)
    z = norm(torch.randn(2, 5, 6))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(z)
    copy = ext.autocast_copy(z, out)
    assert copy is not None and torch.equal(copy, z.detach().reshape(10, 6).to(torch.bfloat16))


def test_autocast_copy_is_none_where_the_graph_does_not_show_the_cast(ext):
    z, out, linear = _norm_then_linear(True, (2, 5))
    assert ext.autocast_copy(z.detach(), out) is None  # no graph node of its own
    assert ext.autocast_copy(z * 1.0, out) is None  # not the tensor that was cast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        leaf = torch.randn(3, 6, requires_grad=True)
        assert ext.autocast_copy(leaf, linear(leaf)) is None  # a leaf
        assert ext.autocast_copy(z, linear(z.transpose(0, 1).transpose(0, 1))) is None  # views the walk does not know
        assert ext.autocast_copy(z, linear(z) * 2) is None  # not the product's output
        assert ext.autocast_copy(z, torch.relu(z.to(torch.bfloat16))) is None  # no product
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            assert ext.autocast_copy(z, linear(z)) is None  # the saved copy is the hooks'
        linear.weight.requires_grad_(False)
        assert ext.autocast_copy(z, linear(z)) is None  # a frozen weight: nothing saved
    assert ext.autocast_copy(z, nn.Linear(6, 4)(z)) is None  # no cast (float32 throughout)


def test_tap_read_on_an_autocast_copy_reads_it_with_the_gradient(ext):
    """tap_read holds the saved copy instead of reading x: x changed in place after the forward
    changes nothing, and h is the copy's sums (x's values rounded to bfloat16), with the
    plan's counts, from the same call as s."""
    z, out, _ = _norm_then_linear(True, (2, 5))
    sink = ext.TapSink()
    plan = ext.TapPlan(sink, [0, -1, 1], 0.0, -1, True, 0.0, 10.0, 10.0)
    plan.tap_read(z, out)
    assert plan.cast_taps == 1
    copy = z.detach().to(torch.bfloat16)
    want_h = copy.float().square().sum((0, 1))
    with torch.no_grad():
        z.mul_(3.0)  # legal (autograd saved the copy), and not what the layer multiplied
    grad = torch.randn_like(out)
    out.backward(grad)
    ((h, hn, s, sn),) = sink.take()
    assert (hn, sn) == (10.0, 10.0)
    torch.testing.assert_close(h, want_h, rtol=1e-6, atol=0)
    torch.testing.assert_close(s, grad.float().square().sum((0, 1)), rtol=1e-6, atol=0)
    # where nothing is found, x is read in the call, as before
    x = torch.randn(3, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = nn.Linear(6, 4)(x)
    plan.tap_read(x, out)
    assert plan.cast_taps == 1


def test_a_linear_called_twice_taps_each_calls_own_copy(ext):
    """Two calls of one Linear before one backward (a block applied twice): each call's tap
    holds its own saved copy, and the sink gets each call's sums."""
    torch.manual_seed(0)
    norm, linear = nn.LayerNorm(6), nn.Linear(6, 4)
    z1, z2 = norm(torch.randn(3, 6)), norm(torch.randn(3, 6)) * 3.0  # (h nine times z1's: told apart below)
    sink = ext.TapSink()
    plan = ext.TapPlan(sink, [0, -1, 1], 0.0, -1, True, 0.0, 3.0, 3.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out1, out2 = linear(z1), linear(z2)
    plan.tap_read(z1, out1)
    plan.tap_read(z2, out2)
    assert plan.cast_taps == 2
    (out1.float().sum() + 2 * out2.float().sum()).backward()
    results = sink.take()
    assert len(results) == 2
    for z, (h, hn, _, _) in zip((z1, z2), sorted(results, key=lambda r: float(r[0].sum()))):
        torch.testing.assert_close(h, z.detach().to(torch.bfloat16).float().square().sum(0), rtol=1e-6, atol=0)
        assert hn == 3.0


def test_python_hooks_take_the_autocast_copy_the_taps_take(on_cpu_bf16):
    """A Linear after a float32 LayerNorm under autocast (its input a graph node, values that
    bfloat16 rounds, cast to bfloat16): the taps hold the saved copy (``cast_taps``) and the
    Python hooks take the same copy (``autocast_copy``), both reading it with the gradient;
    the factors agree.  (Python hooks reading the float32 input instead gave H 1.4e-3 apart
    here, past the tolerance.)"""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), _Float(), nn.LayerNorm(5), nn.Linear(5, 3))
    hooked, tapped = copy.deepcopy(model), copy.deepcopy(model)
    ref = _train_autocast(hooked, False)
    got = _train_autocast(tapped, True)
    plans = got.binding.captures["4"].tap_plans.values()
    assert sum(p.cast_taps for p in plans) == 3  # every capture step's forward
    for name, cap in got.binding.captures.items():
        want = ref.binding.captures[name]
        torch.testing.assert_close(cap.H, want.H, rtol=1e-5, atol=1e-7, msg=name)
        torch.testing.assert_close(cap.S, want.S, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("value, want", [("yes", "True"), ("0", "False"), ("off", "False"), ("", "True"), (None, "True"),
                                         ("sometimes", "ValueError")])
def test_the_setting_comes_from_its_environment_variable(value, want):
    """On unless the variable turns it off (taps are the default: the bench measured them)."""
    code = ("from lightning_cafin.capture import taps\n"
            "try:\n    print(taps.enabled())\nexcept ValueError as e:\n    print('ValueError', e)")
    env = {k: v for k, v in os.environ.items() if k != taps.ENV_VAR}
    env.update({"PYTHONPATH": str(ROOT)} if value is None else {taps.ENV_VAR: value, "PYTHONPATH": str(ROOT)})
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.stdout.startswith(want), out.stderr
    if want == "ValueError":
        assert taps.ENV_VAR in out.stdout


@pytest.mark.parametrize("reentrant", [False, True])
def test_taps_under_activation_checkpointing(on_cpu, reentrant):
    torch.manual_seed(0)
    plain = Net()
    checkpointed = copy.deepcopy(plain)
    checkpointed.reentrant = reentrant
    want = factors_after_two_captures(plain)
    python_calls = on_cpu.count("layer_stats")
    taps.set_enabled(True)
    got = factors_after_two_captures(checkpointed)
    assert python_calls == 2 * 11 and on_cpu.count("layer_stats") == python_calls  # every layer tapped
    for name in want:
        torch.testing.assert_close(got[name][0], want[name][0], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(got[name][1], want[name][1], rtol=1e-5, atol=1e-7)


def backward_under_compiled_autograd(loss_of):
    """Run ``loss_of()`` (a forward and its loss) and its backward under compiled autograd,
    asserting that dynamo traced none of the package's Python: it warns where it traces into
    the hooks (a cached rule, the statistics op), which must run eagerly."""
    with warnings.catch_warnings(record=True) as seen, \
            torch._dynamo.compiled_autograd._enable(torch.compile(backend="eager")):
        warnings.simplefilter("always")
        loss_of().backward()
    assert not [w for w in seen if "lightning_cafin" in str(w.message) + str(w.filename)], [str(w.message) for w in seen]


def _step_under_compiled_autograd(model, opt):
    x, y = torch.randn(4, 3, 6, 6), torch.randint(0, 5, (4,))
    opt.zero_grad()
    backward_under_compiled_autograd(lambda: nn.functional.cross_entropy(model(x), y))
    opt.step()


def test_compiled_autograd_gets_python_hooks_run_eagerly(on_cpu):
    """Compiled autograd refuses C++ hooks (``compiled_args nyi``): while it is enabled the
    capture hooks register Python ones, which it runs eagerly (not traced with their Python
    state), and the factors are theirs."""
    torch.manual_seed(0)
    model = _Net()
    hooked = copy.deepcopy(model)
    taps.set_enabled(False)
    ref = AdaFisher(hooked, lr=1e-2, TCov=1, backend="foreach")
    torch.manual_seed(1)
    _step_under_compiled_autograd(hooked, ref)
    taps.set_enabled(True)
    got = AdaFisher(model, lr=1e-2, TCov=1, backend="foreach")
    torch.manual_seed(1)
    _step_under_compiled_autograd(model, got)  # raised NotImplementedError with the C++ taps
    assert got.health["capture_steps"] == 1
    for name, cap in got.binding.captures.items():
        assert cap.sink is None, name
        want = ref.binding.captures[name]
        assert torch.equal(cap.H, want.H) and torch.equal(cap.S, want.S), name


def test_compiled_autograd_configured_for_compiled_backwards_gets_python_hooks(on_cpu):
    """``torch._dynamo.config.compiled_autograd`` is read at every optimizer step: taps are
    off from the step after it is set to the step after it is unset."""
    torch.manual_seed(0)
    model = _Net()
    taps.set_enabled(True)

    def capture_step(opt):
        opt.zero_grad()
        nn.functional.cross_entropy(model(torch.randn(4, 3, 6, 6)), torch.randint(0, 5, (4,))).backward()
        tapped = sum(c.taps_out for c in opt.binding.captures.values())
        opt.step()
        return tapped

    with torch._dynamo.config.patch(compiled_autograd=True):
        opt = AdaFisher(model, lr=1e-2, TCov=1, backend="foreach")
        assert capture_step(opt) == 0
    assert capture_step(opt) == 0  # (the config is read at the step: this forward came before it)
    assert capture_step(opt) > 0
