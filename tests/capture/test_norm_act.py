"""timm's norm + activation modules (``GroupNormAct``, ``BatchNormAct2d``, ``LayerNormAct2d``):
the norm's own statistics, i.e. the module's input and the gradient with respect to the
norm's affine output (before dropout and the activation, in place or not), against the
float64 oracle of ``spec.py``."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_cafin import AdaFisher, spec
from lightning_cafin.capture import hook_count, rule_for

from .test_gradient_taps import backward_under_compiled_autograd

norm_act = pytest.importorskip("timm.layers.norm_act")
D = torch.float64


class Half(nn.Module):
    """A deterministic stand-in for the dropout slot: the tap must sit before it."""

    def forward(self, x):
        return 0.5 * x


def _affine_output(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The norm's affine output, written out (the oracle's own forward, no hooks)."""
    if isinstance(norm, nn.GroupNorm):
        return F.group_norm(x, norm.num_groups, norm.weight, norm.bias, norm.eps)
    if isinstance(norm, nn.BatchNorm2d):
        return F.batch_norm(x, None, None, norm.weight, norm.bias, True, 0.0, norm.eps)
    z = F.layer_norm(x.permute(0, 2, 3, 1), norm.normalized_shape, norm.weight, norm.bias, norm.eps)
    return z.permute(0, 3, 1, 2)


CASES = {
    "groupnorm_relu_inplace": lambda: norm_act.GroupNormAct(6, num_groups=3),
    "groupnorm_silu_half": lambda: norm_act.GroupNormAct(6, num_groups=2, act_layer=nn.SiLU, drop_layer=Half),
    "groupnorm1_gelu": lambda: norm_act.GroupNorm1Act(6, act_layer=nn.GELU),
    "batchnorm_relu_inplace": lambda: norm_act.BatchNormAct2d(6),
    "layernorm2d_gelu": lambda: norm_act.LayerNormAct2d(6, act_layer=nn.GELU),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_norm_act_factors_are_the_norms_own(case):
    torch.manual_seed(0)
    norm = CASES[case]()
    with torch.no_grad():  # affine parameters away from 1 and 0, so the activation masks something
        norm.weight.normal_()
        norm.bias.normal_()
    model = nn.Sequential(norm, nn.Flatten(), nn.Linear(6 * 3 * 4, 5)).double()
    x = torch.randn(4, 6, 3, 4, dtype=D)
    y = torch.randint(0, 5, (4,))
    before = copy.deepcopy(model)

    opt = AdaFisher(model, backend="reference", gamma=0.8, TCov=1)
    assert hook_count(norm) == 1
    F.cross_entropy(model(x), y).backward()
    opt.step()
    got = opt.factors()["0"]

    # oracle: the gradient with respect to the affine output, through the rest of the model
    ref = before[0]
    z = _affine_output(ref, x).detach().requires_grad_()
    out = before[2](before[1](ref.act(ref.drop(z.clone()))))
    s = torch.autograd.grad(F.cross_entropy(out, y), z)[0]
    channels_first = getattr(rule_for(ref), "channels_first", False)
    H_raw, S_raw = spec.raw_stats(ref, x, s, channels_first=channels_first)
    torch.testing.assert_close(got.S, spec.average(None, S_raw, 0.8), rtol=1e-12, atol=0)
    torch.testing.assert_close(got.H, spec.average(None, H_raw, 0.8), rtol=1e-12, atol=0)
    # the activation's output gradient (what the module's own output hook would see) differs
    y_out = ref.act(ref.drop(z.detach().clone())).requires_grad_()
    s_after = torch.autograd.grad(F.cross_entropy(before[2](before[1](y_out)), y), y_out)[0]
    _, S_after = spec.raw_stats(ref, x, s_after, channels_first=channels_first)
    assert not torch.allclose(S_after, S_raw)


def test_norm_act_factors_under_compiled_autograd_are_eager_modes():
    """Under compiled autograd the tap on the norm's affine output runs eagerly (not traced
    with its Python state), and gives the factors of an eager backward."""
    torch.manual_seed(0)
    model = nn.Sequential(norm_act.GroupNormAct(6, num_groups=3), nn.Flatten(), nn.Linear(6 * 3 * 4, 5)).double()
    x, y = torch.randn(4, 6, 3, 4, dtype=D), torch.randint(0, 5, (4,))
    factors = []
    for compiled in (False, True):
        m = copy.deepcopy(model)
        opt = AdaFisher(m, backend="reference", TCov=1)
        if compiled:
            backward_under_compiled_autograd(lambda m=m: F.cross_entropy(m(x), y))
        else:
            F.cross_entropy(m(x), y).backward()
        opt.step()
        factors.append(opt.factors()["0"])
    eager, compiled_ = factors
    torch.testing.assert_close(compiled_.S, eager.S, rtol=1e-12, atol=0)
    torch.testing.assert_close(compiled_.H, eager.H, rtol=1e-12, atol=0)


def test_norm_act_rules_and_the_unknown_fused_norm():
    assert rule_for(norm_act.GroupNormAct(4, num_groups=2)).kind == "groupnorm"
    assert rule_for(norm_act.BatchNormAct2d(4)).kind == "batchnorm"
    assert rule_for(norm_act.LayerNormAct2d(4)).channels_first
    assert not rule_for(norm_act.LayerNormAct(4)).channels_first

    class OwnNormAct(nn.GroupNorm):  # an activation inside, its affine output not known
        def __init__(self):
            super().__init__(2, 4)
            self.act = nn.ReLU()

        def forward(self, x):
            return self.act(super().forward(x))

    assert rule_for(OwnNormAct()) is None


def test_a_forward_without_graph_leaves_no_tap_behind():
    """A call that captures nothing (no grad) must not hand its tap to the next call."""
    torch.manual_seed(0)
    base = norm_act.GroupNormAct(6, num_groups=3, act_layer=nn.SiLU).double()
    x1, x2 = torch.randn(2, 6, 3, 3, dtype=D), torch.randn(2, 6, 3, 3, dtype=D)
    factors = []
    for first_without_grad in (True, False):
        norm = copy.deepcopy(base)
        opt = AdaFisher(norm, TCov=2, backend="reference")
        if first_without_grad:
            with torch.no_grad():
                norm(x1)
        norm(x2).square().sum().backward()
        opt.step()
        assert opt.health["modules_not_fired"] == []
        factors.append((opt.factors()[""].S.clone(), opt.factors()[""].H.clone()))
    for a, b in zip(*factors):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_deep_copy_of_a_bound_norm_act_does_no_capture_work_for_the_original():
    """The copy's pre-hook on the tap submodule and its forward hook (both copied with the hook
    dicts) leave the original's capture alone: no schedule question, no statistics."""
    torch.manual_seed(0)
    norm = norm_act.GroupNormAct(6, num_groups=3, act_layer=nn.SiLU, drop_layer=Half).double()
    opt = AdaFisher(norm, TCov=1, backend="reference")
    norm(torch.randn(2, 6, 3, 3, dtype=D)).square().sum().backward()
    opt.step()
    twin = copy.deepcopy(norm)
    assert len(twin.drop._forward_pre_hooks) == 1  # the copy carries the tap's pre-hook
    cap = opt.binding.captures[""]
    asked = []
    is_capturing = cap.is_capturing
    cap.is_capturing = lambda: asked.append(1) or is_capturing()
    opt.zero_grad()
    twin(torch.randn(2, 6, 3, 3, dtype=D)).square().sum().backward()
    assert asked == [] and cap.pending.calls == 0
    norm(torch.randn(2, 6, 3, 3, dtype=D)).square().sum().backward()
    assert len(asked) >= 1 and cap.pending.calls == 1
    opt.step()
