"""A captured layer's forward that repeats the last one's tap takes it again in the C++
forward hook (``LayerCapture.fast_tap``, the extension's ``ForwardTapHook``), after the
same checks as the general path: it must give the general path's statistics bit for bit,
and any forward that differs (shapes, a ``no_capture()`` block, an evaluation forward, a
frozen weight, taps off, a saved-tensor hook, a compile started) must take the general
path, which decides as before.

Runs on the CPU with the stand-in extension of ``test_kept_launch`` (the real taps, sinks
and forward hook, the factor update restated in torch).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_cafin import AdaFisher, no_capture
from lightning_cafin.capture import kernels as ck
from lightning_cafin.capture import hooks, taps
from lightning_cafin.capture.hooks import keep_hooks_in_place
from lightning_cafin.capture.layer_capture import LayerCapture

from .test_fused_stats import _Float
from .test_gradient_taps import ext, tap_setting  # noqa: F401  (fixtures)
from .test_kept_launch import Tapped, _assert_same, kernels_on_cpu  # noqa: F401  (kernels_on_cpu: a fixture)

STEPS = 8


@pytest.fixture(autouse=True)
def nothing_compiled():
    """Once anything compiled in the process the Python hooks stay (``keep_hooks_in_place``):
    these tests start as a process that compiled nothing."""
    previous = keep_hooks_in_place(False)
    yield
    keep_hooks_in_place(previous)


def _plans_asked(monkeypatch) -> set[str]:
    """The names of the layers whose forward asked the general path for a tap plan
    (``LayerCapture.tap_plan``) since the set was last cleared: a repeated tap asks none."""
    asked: set[str] = set()
    plan_for = LayerCapture.tap_plan

    def counted_tap_plan(self, *args):
        asked.add(self.name)
        return plan_for(self, *args)

    monkeypatch.setattr(LayerCapture, "tap_plan", counted_tap_plan)
    return asked


def _train(model: Tapped, general_only: bool, monkeypatch) -> tuple[AdaFisher, list[set[str]], list[tuple]]:
    """``STEPS`` capture steps (TCov 1) with a different kind of forward at some of them;
    ``general_only`` forgets every layer's fast tap before each forward.  Returns the
    optimizer, per step the layers whose training forward was tapped without asking the
    general path for a plan (``LayerCapture.tap_plan``), and per step the health counters."""
    torch.manual_seed(1)
    opt = AdaFisher(model, lr=1e-3, TCov=1, backend="foreach")
    caps = opt.binding.captures
    asked = _plans_asked(monkeypatch)
    fast, health = [], []

    def forward(x: torch.Tensor) -> torch.Tensor:
        if general_only:
            for cap in caps.values():
                cap.fast_tap = None
        return model(x)

    for step in range(STEPS):
        opt.zero_grad()
        batch = 6 if step == 2 else 4  # new shapes at step 2, and back at step 3
        x, y = torch.randn(batch, 3, 5, 5), torch.randint(0, 5, (batch,))
        if step == 4:  # a validation forward in between: declined, no statistics
            model.eval()
            with torch.no_grad():
                forward(x)
            model.train()
        if step == 5:
            model.conv.weight.requires_grad_(False)  # its input is then read in the forward
        asked.clear()
        out_before = {name: cap.taps_out for name, cap in caps.items()}
        with taps.using(step != 6):  # step 6: Python hooks
            loss = nn.functional.cross_entropy(forward(x), y)
        fast.append({n for n, cap in caps.items() if cap.taps_out > out_before[n] and n not in asked})
        if step == 3:  # an auxiliary loss from a forward inside no_capture(): no statistics
            with no_capture():
                loss = loss + 0.01 * forward(x).mean()
            assert all(cap.excluded_forwards == 1 for cap in caps.values())  # reached, counted, not tapped
        loss.backward()
        opt.step()
        model.conv.weight.requires_grad_(True)
        h = opt.health
        health.append((h["capture_steps"], tuple(h["modules_not_fired"])))
    return opt, fast, health


def test_the_fast_tap_gives_the_general_paths_factors_and_is_taken_when_nothing_changed(
    kernels_on_cpu, monkeypatch  # noqa: F811
):
    torch.manual_seed(0)
    model = Tapped()
    ref, ref_fast, ref_health = _train(copy.deepcopy(model), True, monkeypatch)
    got, fast, health = _train(model, False, monkeypatch)
    _assert_same(got, ref)
    assert health == ref_health
    assert ref_fast == [set()] * STEPS  # forgotten before every forward: never taken
    # Each step's first forward (conv's) asks the general path, which opens the step's gate;
    # the other layers repeat their last tap while it stays open.
    layers = set(got.binding.captures)
    assert fast[0] == set()  # the first forward takes the general path and records the taps
    assert fast[1] == layers - {"conv"}  # then every other layer repeats its tap
    assert fast[2] == set() and fast[3] == set()  # new shapes, then the old ones again
    assert fast[4] == layers - {"conv"}  # the validation forward before it changed nothing
    assert fast[5] == layers - {"conv"}  # (a frozen weight: conv's input is read in the forward)
    assert fast[6] == set()  # Python hooks
    assert fast[7] == layers - {"conv"}
    assert all(cap.refused == 0 for cap in got.binding.captures.values())


def test_a_layer_computing_on_an_autocast_copy_repeats_its_read_in_the_forward(kernels_on_cpu, monkeypatch):  # noqa: F811
    """Under autocast a Linear given float32 computes on a bfloat16 copy (``TapPlan.tap_read``:
    the copy autograd saved, or the input read in the forward where the graph does not show
    the cast), one given bfloat16 takes the plain tap: both repeat their tap, and the factors
    equal the general path's.  (The first Linear, the step's first
    forward, asks the general path at every step: that opens the step's gate.)"""
    lowp = (torch.float32, torch.bfloat16)
    monkeypatch.setattr(ck, "ext_for", lambda *t: kernels_on_cpu.fake if all(v.dtype in lowp for v in t) else None)

    def train(general_only: bool) -> tuple[AdaFisher, list[set[str]]]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), _Float(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
        opt = AdaFisher(model, lr=1e-3, TCov=1, backend="foreach")
        caps = opt.binding.captures
        asked = _plans_asked(monkeypatch)
        fast = []
        for _ in range(4):
            opt.zero_grad()
            if general_only:
                for cap in caps.values():
                    cap.fast_tap = None
            asked.clear()
            out_before = {n: cap.taps_out for n, cap in caps.items()}
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(torch.randn(5, 6)).float().square().mean()
            fast.append({n for n, cap in caps.items() if cap.taps_out > out_before[n] and n not in asked})
            loss.backward()
            opt.step()
        return opt, fast

    ref, ref_fast = train(general_only=True)
    got, fast = train(general_only=False)
    for name, cap in got.binding.captures.items():
        want = ref.binding.captures[name]
        assert torch.equal(cap.H, want.H) and torch.equal(cap.S, want.S), name
    assert ref_fast == [set()] * 4
    assert fast == [set(), {"3", "5"}, {"3", "5"}, {"3", "5"}]


def test_a_read_tap_reads_its_input_as_given_in_the_forward(kernels_on_cpu, monkeypatch):  # noqa: F811
    """A ``tap_read`` (a Linear computing on an autocast copy), repeated by the C++ hook or
    taken by the general path, hands its input to the statistics as it is (no ``detach`` per
    layer): where it reads it in the forward, inside no backward node, and where autograd
    saved the copy, holding that (the factors still equal the general path's: the test above)."""
    from torch.profiler import ProfilerActivity, profile

    lowp = (torch.float32, torch.bfloat16)
    monkeypatch.setattr(ck, "ext_for", lambda *t: kernels_on_cpu.fake if all(v.dtype in lowp for v in t) else None)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), _Float(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = AdaFisher(model, lr=1e-3, TCov=1, backend="foreach")

    def step() -> None:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.randn(5, 6, requires_grad=True)).float().square().mean()
        loss.backward()
        opt.step()

    for _ in range(2):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    reads = [e for e in prof.events() if e.name == "lightning_cafin::tap_read"]
    # Linears "0" (the step's first forward: the general path) and "3" (repeated by its C++
    # hook) call tap_read: "0" reads its float32 input (a leaf: no graph node shows the cast),
    # "3" holds the bfloat16 copy autograd saved; "5" is given bfloat16 and takes the plain tap
    assert len(reads) == 2
    assert [sum(p.cast_taps for p in opt.binding.captures[n].tap_plans.values()) for n in ("0", "3")] == [0, 3]

    def below(event) -> list[str]:
        return [c.name for c in event.cpu_children] + [n for c in event.cpu_children for n in below(c)]

    hooks = [e for e in prof.events() if e.name == "lightning_cafin::ForwardTapHook"]  # (the general path's call too)
    assert hooks and not any("aten::detach" in below(e) for e in hooks), [below(e) for e in hooks]
    assert not any(e.name.endswith("Backward0") and "lightning_cafin::tap_read" in below(e) for e in prof.events())


def _capture_step(model: nn.Module, opt: AdaFisher, asked: set[str]) -> set[str]:
    """One capture step; returns the layers whose tap was repeated by the C++ hook."""
    caps = opt.binding.captures
    opt.zero_grad()
    asked.clear()
    out_before = {n: cap.taps_out for n, cap in caps.items()}
    x, y = torch.randn(4, 3, 5, 5), torch.randint(0, 5, (4,))
    loss = nn.functional.cross_entropy(model(x), y)
    repeated = {n for n, cap in caps.items() if cap.taps_out > out_before[n] and n not in asked}
    loss.backward()
    opt.step()
    return repeated


def test_forwards_under_a_saved_tensor_hook_and_after_a_compile_take_the_python_hook(
    kernels_on_cpu, monkeypatch  # noqa: F811
):
    """Under a saved-tensor hook (checkpointing, CPU offload) the input is read in the forward,
    which the repeat never does; once a compile starts, the Python hooks are back in every
    hook dict (dynamo must meet the hook it never traces).  Both take the general path, with
    the general path's factors."""
    torch.manual_seed(0)
    model = Tapped()
    ref_model = copy.deepcopy(model)
    opt = AdaFisher(model, lr=1e-3, TCov=1, backend="foreach")
    ref = AdaFisher(ref_model, lr=1e-3, TCov=1, backend="foreach")
    asked = _plans_asked(monkeypatch)
    layers = set(opt.binding.captures)
    repeated = []
    for step in range(5):
        seed = torch.seed()
        for cap in ref.binding.captures.values():
            cap.fast_tap = None  # (the reference takes the general path throughout)
        for m, o in ((ref_model, ref), (model, opt)):
            torch.manual_seed(seed)
            if step == 2:
                with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                    got = _capture_step(m, o, asked)
            else:
                if step == 3 and o is opt:
                    keep_hooks_in_place(True)  # what a compile starting does
                got = _capture_step(m, o, asked)
        repeated.append(got)
        hook_type = type(hooks.forward_hook(model.fc)).__name__
        assert (hook_type == "ForwardTapHook") == (step < 3), (step, hook_type)
    _assert_same(opt, ref)
    assert repeated == [set(), layers - {"conv"}, set(), set(), set()]


def test_the_cpp_hook_lets_a_dropped_model_go_and_a_deep_copy_adds_nothing(kernels_on_cpu):  # noqa: F811
    """The hook holds its Python hook, module, capture and weight weakly: a model and
    optimizer dropped after repeated taps free their weights.  A deep copy of the model (an
    EMA) made while the hook is armed carries the forward override, rebound to the copy,
    and its forwards add nothing."""
    import gc
    import weakref

    model = Tapped()
    opt = AdaFisher(model, lr=1e-3, TCov=1, backend="foreach")
    x, y = torch.randn(4, 3, 5, 5), torch.randint(0, 5, (4,))
    for _ in range(3):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    assert opt.binding.captures["fc"].fast_tap is not None
    copied = copy.deepcopy(model)
    assert type(hooks.forward_hook(model.fc)).__name__ == "ForwardTapHook" and "forward" in vars(copied.fc)
    taps_before = {n: cap.taps_out for n, cap in opt.binding.captures.items()}
    copied(x).sum().backward()
    assert {n: cap.taps_out for n, cap in opt.binding.captures.items()} == taps_before
    weight = weakref.ref(model.fc.weight)
    del model, opt, copied
    gc.collect()
    assert weight() is None


def test_a_profiled_capture_step_records_the_extensions_host_calls(kernels_on_cpu):  # noqa: F811
    """Under ``torch.profiler`` the extension's host calls are recorded operations named
    ``lightning_cafin::<op>`` (``csrc/record_op.h``), with the torch operations they run
    inside them: at a capture step every layer's forward calls its C++ forward hook, which
    taps the layer (the first layer's through the Python hook, which opens the step's gate);
    in the backward each tap computes its layer's statistics, a norm's from the means its
    op saved; the step takes every layer's sums at once."""
    from torch.profiler import ProfilerActivity, profile

    model = Tapped()
    opt = AdaFisher(model, lr=1e-3, TCov=1, backend="foreach")
    x, y = torch.randn(4, 3, 5, 5), torch.randint(0, 5, (4,))

    def step() -> None:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    for _ in range(3):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    calls = {e.key: e.count for e in prof.key_averages() if e.key.startswith("lightning_cafin::")}
    layers = len(opt.binding.captures)  # conv, bn, ln, extra, fc
    assert calls == {"lightning_cafin::ForwardTapHook": layers, "lightning_cafin::tap": layers,
                     "lightning_cafin::layer_stats": 3, "lightning_cafin::norm_stats": 2,
                     "lightning_cafin::take_single": 1}, calls
    # a tap runs no torch operation: the conv's and the linears' hold their input as it is,
    # the norms' keep the means their op saved
    tapping = [e for e in prof.events() if e.name == "lightning_cafin::tap"]
    assert len(tapping) == layers and all(not e.cpu_children for e in tapping), [
        child.name for e in tapping for child in e.cpu_children]


def _after_repeated_taps() -> tuple[Tapped, AdaFisher]:
    """A model whose layers repeat their taps, armed for the next (capture) step."""
    torch.manual_seed(0)
    model = Tapped()
    opt = AdaFisher(model, lr=1e-3, TCov=1, backend="foreach")
    for _ in range(2):
        _capture_step(model, opt, set())
    opt.zero_grad()
    return model, opt


def _overridden_by_the_cpp_hook(module: nn.Module) -> bool:
    override = vars(module).get("forward")
    return override is not None and getattr(override.func, "__name__", "") == "forward_then_hook"


def test_an_armed_layer_runs_its_forward_and_its_cpp_hook_in_one_call(kernels_on_cpu, monkeypatch):  # noqa: F811
    """Once its hook is the C++ one, a layer's forward override is that hook's
    ``forward_then_hook``: the class's forward, then the hook.  A forward given its input by
    keyword is no repeat: the Python hook gets the keywords as nn.Module passes them and taps
    it itself.  Errors of the forward reach the caller unchanged."""
    model, opt = _after_repeated_taps()
    assert all(_overridden_by_the_cpp_hook(getattr(model, n)) for n in ("conv", "bn", "ln", "fc", "extra"))
    cap = opt.binding.captures["fc"]
    asked = _plans_asked(monkeypatch)
    _capture_step(model, opt, asked)  # (conv's forward opens the step's gate)
    opt.zero_grad()
    model(torch.randn(4, 3, 5, 5))  # the gate opened again
    before = cap.taps_out
    asked.clear()
    x = torch.randn(4, 4)  # (fc's input in the model's forward: the repeat's shapes)
    out = model.fc(x)
    torch.testing.assert_close(out, nn.functional.linear(x, model.fc.weight, model.fc.bias), rtol=0, atol=0)
    assert cap.taps_out == before + 1 and "fc" not in asked  # repeated in C++
    out = model.fc(input=x)
    torch.testing.assert_close(out, nn.functional.linear(x, model.fc.weight, model.fc.bias), rtol=0, atol=0)
    assert cap.taps_out == before + 2 and "fc" in asked  # the general path's tap
    with pytest.raises(RuntimeError) as got:
        model.fc(torch.randn(3, 7))
    with pytest.raises(RuntimeError) as want:
        nn.Linear.forward(model.fc, torch.randn(3, 7))
    assert str(got.value) == str(want.value)
    with pytest.raises(TypeError, match="forward"):
        model.fc()
    assert cap.taps_out == before + 2


def test_a_model_pickled_or_copied_with_the_cpp_override_gets_the_python_one(kernels_on_cpu):  # noqa: F811
    """``torch.save`` and ``copy.deepcopy`` of a model armed with the C++ hooks' overrides
    give overrides of ``_capturing_forward`` bound to the copy (a C++ hook can be neither):
    the loaded model computes as the original and adds no statistics to it."""
    import io

    model, opt = _after_repeated_taps()
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    twin = copy.deepcopy(model)
    x = torch.randn(4, 3, 5, 5)
    taps_before = {n: cap.taps_out for n, cap in opt.binding.captures.items()}
    want = model(x)
    for other in (loaded, twin):
        assert not _overridden_by_the_cpp_hook(other.fc) and vars(other.fc)["forward"].args == (other.fc,)
        torch.testing.assert_close(other(x), want, rtol=0, atol=0)
    caps = opt.binding.captures
    assert {n: caps[n].taps_out - taps_before[n] for n in caps} == {n: 1 for n in caps}  # model(x)'s only
