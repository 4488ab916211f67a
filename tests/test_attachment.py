"""Binding an optimizer to a model and releasing it: hooks, pairing and kept factors.

(Step observers, which register through the same mixin, are tested in test_observers.py.)
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_cafin import AdaFisher, AdaFisherW
from lightning_cafin.capture import hook_count


def net():
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def step(model, opt):
    opt.zero_grad()
    model(torch.randn(6, 3)).pow(2).sum().backward()
    opt.step()


@pytest.mark.parametrize("opt_cls", [AdaFisher, AdaFisherW])
def test_bind_returns_the_optimizer_and_unbind_releases_every_hook(opt_cls):
    model = net()
    opt = opt_cls(model.parameters(), TCov=1)
    assert not opt.is_bound and opt.bound_model is None
    assert opt.bind(model) is opt
    assert opt.is_bound and opt.bound_model is model
    assert [hook_count(m) for m in model.modules()] == [0, 1, 0, 1]
    opt.unbind()
    assert not opt.is_bound and opt.bound_model is None
    assert all(hook_count(m) == 0 for m in model.modules())


def test_unbind_keeps_the_factors_and_a_new_bind_uses_them_again():
    model = net()
    opt = AdaFisher(model, TCov=1)
    step(model, opt)
    kept = {n: f.S.clone() for n, f in opt.factors().items()}
    assert set(kept) == {"0", "2"}
    opt.unbind()
    assert {n: f.S for n, f in opt.factors().items()}.keys() == kept.keys()
    opt.bind(model)
    assert all(torch.equal(opt.factors()[n].S, S) for n, S in kept.items())
    before = [p.detach().clone() for p in model.parameters()]
    step(model, opt)
    assert opt.health["capture_steps"] == 2  # the hooks feed the factors again
    assert all(not torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_a_param_group_added_after_binding_is_preconditioned():
    model = net()
    opt = AdaFisher(list(model[0].parameters()), TCov=1, backend="foreach")
    opt.bind(model)
    step(model, opt)
    assert opt.fisher_view(model[2].weight) is None  # not the optimizer's yet
    opt.add_param_group({"params": list(model[2].parameters())})
    step(model, opt)
    assert opt.fisher_view(model[2].weight) is not None
    assert opt.summary().startswith("AdaFisher [foreach]: 4 parameter tensors (26 elements) in 2 layers are preconditioned")
