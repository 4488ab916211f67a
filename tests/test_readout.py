"""What tools read from the optimizer: copies, live read-only factors, memory by kind."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from lightning_cafin import AdaFisher
from lightning_cafin.optimizer import LayerFactors


def trained(backend="foreach", steps=2):
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Flatten(), nn.Linear(12, 2), nn.Linear(2, 2, bias=False))
    opt = AdaFisher(model, TCov=1, backend=backend)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 2, 4, 4)).sum().backward()
        opt.step()
    return model, opt


def test_health_is_a_copy():
    _, opt = trained()
    h = opt.health
    h["capture_steps"] = -5
    h["modules_not_fired"].append("made-up")
    again = opt.health
    assert again["capture_steps"] == 2 and again["modules_not_fired"] == [] and again is not h


def test_factors_are_the_live_tensors_by_layer_with_their_type():
    model, opt = trained()
    factors = opt.factors()
    assert set(factors) == {"0", "2", "3"}
    assert [f.layer_type for f in factors.values()] == ["Conv2d", "Linear", "Linear"]
    live = opt.binding.captures["2"]
    assert factors["2"].S is live.S and factors["2"].H is live.H
    with pytest.raises(dataclasses.FrozenInstanceError):
        factors["2"].S = torch.zeros(2)  # type: ignore[misc]
    opt.unbind()
    kept = opt.factors()  # kept by name for a later bind
    assert set(kept) == {"0", "2", "3"} and isinstance(kept["0"], LayerFactors) and kept["0"].layer_type == "Conv2d"
    assert kept["2"].S is live.S


@pytest.mark.parametrize("backend", ["foreach", "reference"])
def test_memory_usage_counts_each_kind(backend):
    model, opt = trained(backend)
    usage = opt.memory_usage()
    momentum = sum(p.numel() * 4 for p in model.parameters())
    factors = sum(f.S.numel() * 4 + f.H.numel() * 4 for f in opt.factors().values())
    fisher = momentum if backend == "foreach" else 0  # every parameter here reads a materialised F
    assert usage == {"momentum": momentum, "factors": factors, "cached_fisher": fisher,
                     "total": momentum + factors + fisher}


def test_param_name_and_summary():
    model, opt = trained()
    assert opt.param_name(model[2].weight) == "2.weight"
    assert opt.param_name(torch.zeros(1)) == "<unknown parameter>"
    assert "5 parameter tensors" in opt.summary() and "[foreach]" in opt.summary()
