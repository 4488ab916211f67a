"""The optimizer's named ranges in a torch.profiler trace, and none while nothing records."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

import lightning_cafin as lc
from lightning_cafin.profiling import profiled


def _ranges(opt: torch.optim.Optimizer, model: nn.Module, x: torch.Tensor) -> list[str]:
    """The names of the ranges one traced train step opened that mention the optimizer's class."""
    with profile(activities=[ProfilerActivity.CPU]) as trace:
        opt.zero_grad()
        model(x).square().sum().backward()
        opt.step()
    owner = type(opt).__name__
    return [e.name for e in trace.events() if e.name.startswith(owner + ".")]


@pytest.mark.filterwarnings("ignore:.*backend='auto' uses 'foreach'")
@pytest.mark.parametrize("cls", [lc.AdaFisher, lc.AdaFisherW])
def test_a_capture_step_names_its_factor_update_and_every_step_its_parameter_update(cls: type) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = cls(model, TCov=2)
    x = torch.randn(5, 8)
    name = cls.__name__
    capture, normal = _ranges(opt, model, x), _ranges(opt, model, x)  # steps 0 (captures) and 1
    assert capture == [f"{name}.update_factors", f"{name}.update_parameters"]
    assert normal == [f"{name}.update_parameters"]
    assert opt.health["capture_steps"] == 1


def test_a_range_is_opened_only_while_a_profiler_records() -> None:
    assert isinstance(profiled("idle"), contextlib.nullcontext)
    with profile(activities=[ProfilerActivity.CPU]) as trace:
        context = profiled("recorded")
        assert isinstance(context, record_function)
        with context:
            torch.ones(3).sum()
    assert [e.name for e in trace.events() if e.name == "recorded"] == ["recorded"]
