"""``no_capture()``: forwards whose gradient is not the loss's (a gradient penalty, a teacher)
add no factor statistics, and a layer reached only there is neither warned about nor unbound."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
from torch import nn

from lightning_cafin import AdaFisher, no_capture
from lightning_cafin.capture import exclusion


def _critic() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))


def _penalty(critic: nn.Module, x_hat: torch.Tensor) -> torch.Tensor:
    """WGAN-GP's: the critic's input-gradient norm pulled to 1 (its first backward runs first)."""
    x_hat = x_hat.requires_grad_(True)
    (grad,) = torch.autograd.grad(critic(x_hat).sum(), x_hat, create_graph=True)
    return (grad.norm(2, dim=1) - 1).square().mean()


def _factors_after_a_capture(penalty: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    critic = _critic()
    opt = AdaFisher(critic, lr=1e-3, TCov=1, backend="foreach", capture="torch")
    torch.manual_seed(1)
    real, x_hat = torch.randn(5, 6), torch.randn(5, 6)
    loss = critic(real).mean()
    if penalty == "excluded":
        with no_capture():
            loss = loss + 10 * _penalty(critic, x_hat)
    elif penalty == "captured":
        loss = loss + 10 * _penalty(critic, x_hat)
    loss.backward()
    opt.step()
    return {name: (f.S.clone(), f.H.clone()) for name, f in opt.factors().items()}


def test_a_gradient_penalty_under_no_capture_leaves_the_factors_of_the_loss_alone():
    want = _factors_after_a_capture("none")
    got = _factors_after_a_capture("excluded")
    captured = _factors_after_a_capture("captured")
    assert set(want) == set(got) == {"0", "2"}
    for name in want:
        assert torch.equal(got[name][0], want[name][0]) and torch.equal(got[name][1], want[name][1]), name
    # without no_capture the penalty's forward adds a pair, with its own first backward's gradient
    assert any(not torch.equal(captured[n][0], want[n][0]) for n in want)


def test_a_layer_reached_only_inside_no_capture_is_neither_warned_about_nor_unbound():
    model = nn.ModuleDict({"body": nn.Linear(4, 4), "teacher": nn.Linear(4, 4)})
    opt = AdaFisher(model, lr=1e-3, TCov=1, backend="foreach", capture="torch")
    for _ in range(2):
        opt.zero_grad()
        x = torch.randn(3, 4)
        with no_capture():
            t = model["teacher"](x)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a "no training forward reached" warning would fail here
            (model["body"](x) - t).square().mean().backward()
            opt.step()
    assert set(opt.binding.captures) == {"body", "teacher"}  # both still bound (not taken for functional use)
    assert set(opt.factors()) == {"body"}  # the teacher learned nothing: it stays on F = 1 until a captured forward
    assert opt.health["modules_not_fired"] == []
    assert opt.binding.captures["teacher"].excluded_forwards == 0  # counted per capture step


def test_blocks_nest_restore_on_errors_and_stay_on_their_thread():
    assert not exclusion.excluded()
    with no_capture():
        with no_capture():
            assert exclusion.excluded()
        assert exclusion.excluded()
        seen = []
        worker = threading.Thread(target=lambda: seen.append(exclusion.excluded()))
        worker.start()
        worker.join()
        assert seen == [False]
    assert not exclusion.excluded()
    with pytest.raises(KeyError), no_capture():
        raise KeyError("inside")
    assert not exclusion.excluded()
