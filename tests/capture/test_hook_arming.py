"""Capture hooks are called at their modules' forwards only for steps that may capture.

Between capture steps ``nn.Module.__call__`` must take its no-hook path (the hook's cost
was measured on the host-bound step); at a capture step the hooks are back, as the module's
forward override where that is safe (torch's no-hook path still) and first in the hook dicts
elsewhere; once dynamo compiles anything they must stay in the dicts for good.
"""

from __future__ import annotations

import copy
import inspect
import io

import pytest
import torch
from torch import nn

from lightning_cafin import AdaFisher
from lightning_cafin.capture import hook_count, hooks
from lightning_cafin.capture.hooks import is_armed


@pytest.fixture
def no_compile_seen():
    """As if nothing had been compiled in this process yet (another test may have)."""
    previous = hooks.keep_hooks_in_place(False)
    yield
    hooks.keep_hooks_in_place(previous)


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.LayerNorm(8), nn.Linear(8, 3))


def _step(model, opt, x):
    opt.zero_grad()
    model(x).square().sum().backward()
    opt.step()


def _after_a_capture_step(TCov: int):
    """A net, its optimizer and a batch, after capture step 0: the hooks are out."""
    model = _net()
    opt = AdaFisher(model, TCov=TCov, backend="foreach")
    x = torch.randn(4, 5)
    _step(model, opt, x)
    assert not is_armed(model[0])
    return model, opt, x


def test_hooks_are_out_between_capture_steps_and_back_for_each(no_compile_seen):
    model = _net()
    opt = AdaFisher(model, TCov=3, backend="foreach")
    x = torch.randn(4, 5)
    seen = []
    for _ in range(7):
        seen.append((is_armed(model[0]), len(model[0]._forward_hooks), "forward" in vars(model[0])))
        _step(model, opt, x)
    armed, out = (True, 0, True), (False, 0, False)  # armed: the forward overridden, no hook in the dict
    assert seen == [armed, out, out, armed, out, out, armed]
    assert all(hook_count(m) == 1 for m in model)  # held, armed or not: never stacked


def test_factors_match_hooks_that_never_leave(no_compile_seen):
    """The same run with the hooks kept in place throughout gives the same factors and weights."""
    x = [torch.randn(4, 5) for _ in range(7)]
    runs = []
    for keep in (False, True):
        if keep:
            hooks.keep_hooks_in_place(True)  # what a compile does: never disarm
        model = _net()
        opt = AdaFisher(model, TCov=3, backend="foreach")
        for xi in x:
            _step(model, opt, xi)
        assert is_armed(model[0]) == keep
        runs.append(({n: (c.S.clone(), c.H.clone()) for n, c in opt.factors().items()},
                     [p.detach().clone() for p in model.parameters()]))
    assert runs[0][0].keys() == runs[1][0].keys() == {"0", "1", "2"}
    for n in runs[0][0]:
        for a, b in zip(runs[0][0][n], runs[1][0][n]):
            assert torch.equal(a, b), n
    for a, b in zip(runs[0][1], runs[1][1]):
        assert torch.equal(a, b)


def test_forced_capture_and_a_loaded_count_arm_the_hooks(no_compile_seen):
    model, opt, x = _after_a_capture_step(TCov=2)
    opt.schedule.force_next()
    assert is_armed(model[0])
    opt.schedule.force_next(False)
    assert not is_armed(model[0])
    _step(model, opt, x)
    state = opt.state_dict()  # count 2: the next step captures
    _step(model, opt, x)
    assert not is_armed(model[0])
    opt.load_state_dict(state)
    assert is_armed(model[0])


def test_our_hook_runs_before_hooks_registered_earlier(no_compile_seen):
    """A user hook that replaces the output does not change what the layer's statistics see:
    ours runs first (as registered, and again after every re-arming)."""
    x = torch.randn(4, 5)
    factors = []
    for user_hook in (False, True):
        model = _net()
        if user_hook:
            model[2].register_forward_hook(lambda m, a, out: out * 3.0)
        opt = AdaFisher(model, TCov=2, backend="foreach")
        for _ in range(3):  # captures at steps 0 and 2: re-armed once
            opt.zero_grad()
            out = model(x)
            (out / 3.0 if user_hook else out).square().sum().backward()  # the same loss of the layer's output
            opt.step()
        factors.append(opt.factors()["2"].S.clone())
    torch.testing.assert_close(factors[1], factors[0], rtol=1e-6, atol=0)


def test_a_compile_arms_every_hook_for_good(no_compile_seen):
    """Compiled while the hooks are out (a normal step), the model still captures at the next
    capture step: the compile's start put every hook back before dynamo traced."""
    pytest.importorskip("torch._dynamo")
    torch._dynamo.reset()
    model, opt, x = _after_a_capture_step(TCov=2)  # capture step 0 (eager)
    before = opt.factors()["0"].S.clone()
    compiled = torch.compile(model, backend="eager")
    _step(compiled, opt, x)  # step 1, compiled now
    assert is_armed(model[0])
    _step(compiled, opt, x)  # step 2 captures through the compiled graph
    assert not torch.equal(opt.factors()["0"].S, before)
    _step(compiled, opt, x)
    assert is_armed(model[0])  # never disarmed again
    torch._dynamo.reset()


def test_a_second_optimizer_taking_over_keeps_one_hook(no_compile_seen):
    model, first, x = _after_a_capture_step(TCov=4)
    with pytest.warns(UserWarning, match="bound to another live AdaFisher"):
        second = AdaFisher(model, TCov=4, backend="foreach")
    assert is_armed(model[0]) and hook_count(model[0]) == 1  # the new owner's first step captures
    _step(model, second, x)
    assert not is_armed(model[0]) and hook_count(model[0]) == 1
    first.schedule.force_next()  # no longer the owner: changes nothing
    assert not is_armed(model[0])


def test_only_the_current_owner_arms_the_hooks(no_compile_seen):
    """A second optimizer bound to the same model takes the hooks over: the first one's
    schedule (arming at its own capture steps) no longer moves them, and unbinding the
    first leaves the second's hooks in place."""
    model, first, x = _after_a_capture_step(TCov=2)
    second = AdaFisher(model, TCov=3, backend="foreach")  # its first step captures: armed
    assert is_armed(model[0])
    first.schedule.force_next()  # the old owner arming ...
    first.schedule.force_next(False)  # ... and disarming: not its hooks any more
    assert is_armed(model[0])
    _step(model, second, x)  # the new owner's capture step, then its own schedule
    assert not is_armed(model[0])
    first.schedule.force_next()
    assert not is_armed(model[0])
    second.schedule.force_next()
    assert is_armed(model[0]) and all(hook_count(m) == 1 for m in model)


def test_an_armed_hook_keeps_the_forward_signature_and_leaves_no_trace_when_out(no_compile_seen):
    """Armed as an override, the forward still shows the class's signature (code inspecting
    ``module.forward`` sees what it did), and disarming leaves the instance as it was."""
    model = _net()
    opt = AdaFisher(model, TCov=2, backend="foreach")
    assert "forward" in vars(model[0]) and is_armed(model[0])
    assert inspect.signature(model[0].forward) == inspect.signature(nn.Linear(2, 2).forward)
    _step(model, opt, torch.randn(4, 5))
    assert not is_armed(model[0]) and "forward" not in vars(model[0]) and hook_count(model[0]) == 1
    opt.unbind()
    assert all(hook_count(m) == 0 and "forward" not in vars(m) for m in model)


def test_a_deep_copy_made_while_armed_computes_with_its_own_weights(no_compile_seen):
    """The override is bound to its module through a ``functools.partial``, which
    ``copy.deepcopy`` rebinds to the copy: a copy made on a capture step (an EMA, a teacher)
    computes with its own weights and adds no statistics to the original's layers."""
    model = _net()
    opt = AdaFisher(model, TCov=1, backend="foreach")
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin[0].weight.add_(1.0)
    x = torch.randn(4, 5)
    torch.testing.assert_close(twin[0](x), nn.functional.linear(x, twin[0].weight, twin[0].bias), rtol=0, atol=0)
    assert not torch.allclose(twin[0](x), model[0](x))
    twin(x).square().sum().backward()
    assert all(c.pending.calls == 0 for c in opt.binding.captures.values())


def test_a_model_pickled_while_armed_loads_and_runs(no_compile_seen):
    """``torch.save(model)`` on a capture step (a whole-model checkpoint) pickles the override
    with its module; the loaded model computes as the original and carries no hook."""
    model = _net()
    AdaFisher(model, TCov=1, backend="foreach")
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    x = torch.randn(4, 5)
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)
    assert all(hook_count(m) == 0 for m in loaded)


def test_a_forward_set_on_the_instance_is_kept_and_the_hook_goes_in_the_dict(no_compile_seen):
    """A module whose instance has a forward of its own (a library's wrapper, as accelerate
    sets) is not overridden: the hook is armed first in its dict and that forward runs."""
    model = _net()
    inner = model[0].forward
    calls = []

    def wrapped(x):
        calls.append(1)
        return inner(x)

    model[0].forward = wrapped
    opt = AdaFisher(model, TCov=2, backend="foreach")
    assert is_armed(model[0]) and vars(model[0])["forward"] is wrapped and len(model[0]._forward_hooks) == 1
    _step(model, opt, torch.randn(4, 5))
    assert calls == [1] and opt.factors()["0"].S is not None
    assert not is_armed(model[0]) and vars(model[0])["forward"] is wrapped and len(model[0]._forward_hooks) == 0


def test_a_compile_starting_moves_an_override_into_the_dict(no_compile_seen):
    model = _net()
    AdaFisher(model, TCov=2, backend="foreach")
    assert "forward" in vars(model[0])
    hooks.keep_hooks_in_place(True)  # what a compile starting does
    assert "forward" not in vars(model[0]) and len(model[0]._forward_hooks) == 1 and is_armed(model[0])
    assert hook_count(model[0]) == 1
