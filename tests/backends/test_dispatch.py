"""The dispatcher: per-tensor routing with the reason, grouping, one plan cache, state in one place.

The fused kernel needs a GPU; a stand-in with the fused backend's contract (takes only
some tensors, honours found_inf on the device, keeps the step count on the device) and
the oracle's arithmetic shows on the CPU what the dispatcher does with it.
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

from lightning_cafin import AdaFisher
from lightning_cafin.backends import ForeachBackend, ReferenceBackend, StepBackend
from lightning_cafin.backends.base import group_by_device_and_dtype
from lightning_cafin.backends.dispatch import DeviceScalars, StepDispatcher
from lightning_cafin.backends.state import ensure_state


class StandInFused(StepBackend):
    name = "fused"
    device_step = True
    skips_on_device = True

    def __init__(self) -> None:
        self.prepared = 0
        self.stepped: list[list[torch.Tensor]] = []
        self._oracle = ReferenceBackend()

    def unsupported_reason(self, param, grad=None):
        if not param.is_contiguous():
            return f"it is not contiguous (strides {tuple(param.stride())}, e.g. channels_last)"
        if param.dtype == torch.float64:
            return "its dtype torch.float64 is not float32, float16 or bfloat16"
        return None

    def prepare(self, batch, previous=None):
        self.prepared += 1
        return ("prepared", len(batch.params))

    def step(self, batch, hyper, grad_scale=None, found_inf=None, prepared=None):
        assert prepared == ("prepared", len(batch.params))
        self.stepped.append(list(batch.params))
        self._oracle.step(batch, hyper, grad_scale, found_inf)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.conv(x)).mean((2, 3)))


def run(opt, model, steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        x = torch.randn(5, 3, 6, 6, generator=gen).contiguous(memory_format=torch.channels_last)
        model(x).pow(2).sum().backward()
        opt.step()


def test_channels_last_weight_falls_back_with_the_reason_and_matches_the_oracle():
    model = Net().to(memory_format=torch.channels_last)
    twin = copy.deepcopy(model)
    opt = AdaFisher(model, TCov=3, weight_decay=1e-2, backend="foreach")
    stand_in = StandInFused()
    opt.set_backend(stand_in)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(opt, model, 7)
    messages = [str(w.message) for w in caught if "stepped by" in str(w.message)]
    assert messages == ["AdaFisher: conv.weight is stepped by 'foreach': it is not contiguous "
                        "(strides (27, 1, 9, 3), e.g. channels_last)"]
    fused_params = {id(p) for params in stand_in.stepped for p in params}
    assert id(model.conv.weight) not in fused_params
    assert {id(model.conv.bias), id(model.head.weight), id(model.head.bias)} <= fused_params
    # state: made by the optimizer, momentum in the parameter's memory format
    assert opt.state[model.conv.weight]["exp_avg"].is_contiguous(memory_format=torch.channels_last)
    # one plan: steps 1, 4 and 7 capture (7 steps at TCov=3), the first one creating the
    # factors, the later ones updating them in place (the plan's views stay valid)
    assert stand_in.prepared == 1
    ref = AdaFisher(twin, TCov=3, weight_decay=1e-2, backend="reference")
    run(ref, twin, 7)
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_a_replaced_factor_tensor_is_planned_again_and_read_by_the_step():
    # the plan keeps views of the factors while they are updated in place; a factor tensor
    # replaced by another (a reload with new shapes, a re-initialisation) must not leave the
    # step reading the orphan
    torch.manual_seed(0)
    model = Net()
    twin = copy.deepcopy(model)
    opt = AdaFisher(model, TCov=1000, backend="foreach")
    stand_in = StandInFused()
    opt.set_backend(stand_in)
    ref = AdaFisher(twin, TCov=1000, backend="reference")
    run(opt, model, 2)
    run(ref, twin, 2)
    planned = stand_in.prepared
    cap, ref_cap = opt.binding.captures["head"], ref.binding.captures["head"]
    cap.S = cap.S * 3.0  # another tensor: the plan's view of the old one is stale
    ref_cap.S = ref_cap.S * 3.0
    run(opt, model, 1, seed=5)
    run(ref, twin, 1, seed=5)
    assert stand_in.prepared == planned + 1
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_plan_groups_by_backend_device_and_dtype_once_and_is_cached():
    stand_in = StandInFused()
    dispatch = StepDispatcher(stand_in, ForeachBackend())
    params = [torch.randn(3, 2, requires_grad=True), torch.randn(4, dtype=torch.float64, requires_grad=True),
              torch.randn(2, 3).t().requires_grad_(), torch.randn(5, requires_grad=True),
              torch.randn(2, requires_grad=True)]
    for p in params[:4]:
        p.grad = torch.randn_like(p)
    states: dict = {}

    def state_for(p, backend):
        st = states.setdefault(id(p), {})
        ensure_state(p, st, device_step=backend.device_step)
        return st["exp_avg"], st["step"]

    plan = dispatch.plan(0, params, 0, state_for, lambda p: None)
    layout = [(b.backend.name, b.dtype, [next(i for i, q in enumerate(params) if q is p) for p in b.params])
              for b in plan.batches]
    assert layout == [("fused", torch.float32, [0, 3]), ("foreach", torch.float64, [1]), ("foreach", torch.float32, [2])]
    assert [(f.param is params[i], f.reason.split(" (")[0]) for f, i in zip(plan.fallbacks, (1, 2))] == [
        (True, "its dtype torch.float64 is not float32, float16 or bfloat16"), (True, "it is not contiguous")]
    assert not plan.skips_on_device and stand_in.prepared == 1
    assert dispatch.plan(0, params, 0, state_for, lambda p: None) is plan
    assert dispatch.plan(0, params, 1, state_for, lambda p: None) is not plan  # factors changed
    params[4].grad = torch.randn(2)
    assert 4 in [i for b in dispatch.plan(0, params, 1, state_for, lambda p: None).batches
                 for i, q in enumerate(params) for p in b.params if p is q]
    dispatch.invalidate()
    assert dispatch.plan(0, params, 1, state_for, lambda p: None) is not plan
    assert list(group_by_device_and_dtype(params).values()) == [[0, 2, 3, 4], [1]]


def test_device_scalars_are_cached_buffers():
    scalars = DeviceScalars()
    f32 = torch.tensor([2.0])
    assert scalars.on("grad_scale", f32, f32.device) is f32 and scalars.on("x", None, f32.device) is None
    first = scalars.on("found_inf", torch.tensor([1.0], dtype=torch.float64), torch.device("cpu"))
    second = scalars.on("found_inf", torch.tensor([0.0], dtype=torch.float64), torch.device("cpu"))
    assert first is second and second.dtype == torch.float32 and second.item() == 0.0


def test_state_is_the_same_whichever_backend_runs_first():
    p = torch.randn(4, 3, 2, 2).contiguous(memory_format=torch.channels_last)
    a: dict = {}
    ensure_state(p, a, device_step=False)
    b: dict = {}
    ensure_state(p, b, device_step=True)
    for st in (a, b):
        assert st["step"].dtype == torch.float32 and st["step"].shape == ()
        assert st["exp_avg"].is_contiguous(memory_format=torch.channels_last) and st["exp_avg"].dtype == p.dtype
    old = {"step": 17, "exp_avg": torch.zeros_like(p)}  # a plain number from an older checkpoint
    ensure_state(p, old, device_step=True)
    assert isinstance(old["step"], torch.Tensor) and old["step"].item() == 17.0
    half: dict = {}
    ensure_state(p.half(), half, device_step=True, momentum_dtype=torch.float32)
    assert half["exp_avg"].dtype == torch.float32
