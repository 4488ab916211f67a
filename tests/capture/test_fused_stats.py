"""One extension call per layer in the backward pass: each built-in rule's ``fused_stats``
describes exactly what its ``input_partial`` / ``output_partial`` compute, and the hooks
use it (one ``layer_stats`` call per layer and capture) with the same factors as the
torch ops.  On the CPU a stand-in extension restates ``layer_stats``' contract with the
two kernels' stand-ins; the real kernel is compared in ``tests/kernels``.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch
from torch import nn

from lightning_cafin import AdaFisher
from lightning_cafin.capture import kernels as ck
from lightning_cafin.capture.layers import rule_for

from .test_capture_impl import fake_factor_update_
from .test_rules import ChannelsFirstLayerNorm
from .test_rules_kernels import fake_channel_stats, fake_conv_input_stats


def fake_layer_stats(x, grad, input_op, input_div, grad_dim, grad_square, grad_div, side):
    """``layer_stats``' contract (csrc/capture_ops.h) from the two kernels' stand-ins."""
    if input_op[0] == 1:
        kh, kw, sh, sw, pt, pl, dh, dw, groups, ho, wo = input_op[1:]
        x4 = x.unsqueeze(2) if x.dim() == 3 else x
        h = fake_conv_input_stats(x4, (kh, kw), (sh, sw), (pt, pl), (dh, dw), groups, (ho, wo), side)
    else:
        assert len(input_op) == 3
        h = fake_channel_stats(x, input_op[1], bool(input_op[2]), input_div, side)
    return h, fake_channel_stats(grad, grad_dim, grad_square, grad_div, side)


#: name -> (module factory, input shape, whether the rule describes it as one call)
CASES = {
    "conv2d_3x3": (lambda: nn.Conv2d(4, 6, 3, padding=1), (2, 4, 7, 6), True),
    "conv2d_strided_dilated_grouped": (lambda: nn.Conv2d(6, 4, 3, stride=2, padding=2, dilation=2, groups=2),
                                       (3, 6, 9, 8), True),
    "conv2d_same_even": (lambda: nn.Conv2d(3, 2, (4, 2), padding="same"), (2, 3, 7, 5), True),
    "conv2d_no_bias_1x1": (lambda: nn.Conv2d(5, 3, 1, bias=False), (2, 5, 4, 4), True),
    "conv1d": (lambda: nn.Conv1d(4, 6, 3, stride=2, padding=2, dilation=2, groups=2), (3, 4, 13), True),
    "conv2d_reflect": (lambda: nn.Conv2d(3, 2, 3, padding=1, padding_mode="reflect"), (2, 3, 5, 5), False),
    "conv3d": (lambda: nn.Conv3d(2, 3, 3, padding=1), (2, 2, 4, 5, 3), False),
    "linear": (lambda: nn.Linear(5, 3), (4, 5), True),
    "linear_tokens": (lambda: nn.Linear(6, 4, bias=False), (2, 3, 5, 6), True),
    "batchnorm1d_2d": (lambda: nn.BatchNorm1d(5), (6, 5), True),
    "batchnorm2d": (lambda: nn.BatchNorm2d(3), (4, 3, 5, 2), True),
    "batchnorm3d": (lambda: nn.BatchNorm3d(3), (2, 3, 4, 2, 3), True),
    "groupnorm": (lambda: nn.GroupNorm(2, 4), (3, 4, 5, 5), True),
    "layernorm": (lambda: nn.LayerNorm(8), (3, 4, 8), True),
    "layernorm_2d_input": (lambda: nn.LayerNorm(8), (5, 8), True),
    "rmsnorm": (lambda: nn.RMSNorm(8), (3, 4, 8), True),
    "layernorm_2dims": (lambda: nn.LayerNorm((3, 4)), (2, 5, 3, 4), False),
    "layernorm_channels_first": (lambda: ChannelsFirstLayerNorm(6), (2, 6, 5, 6), False),
}


def _case(name):
    make, shape, fusable = CASES[name]
    torch.manual_seed(0)
    module = make().double()
    x = torch.randn(*shape, dtype=torch.float64)
    with torch.no_grad():
        grad = torch.randn_like(module(x))
    return module, x, grad, fusable


@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_description_computes_the_two_partials(name):
    module, x, grad, fusable = _case(name)
    rule = rule_for(module)
    fused = rule.fused_stats(module, x.shape, grad.shape)
    if not fusable:
        assert fused is None
        return
    assert fused is not None
    saved = ck.ext_for
    ck.ext_for = lambda *t: None  # the partials on the torch ops
    try:
        h_want, hn_want = rule.input_partial(module, x)
        s_want, sn_want = rule.output_partial(module, grad)
    finally:
        ck.ext_for = saved
    h, s = fake_layer_stats(x, grad, fused.input_op, fused.input_div, fused.grad_dim, fused.grad_square,
                            fused.grad_div, False)
    assert (fused.hn, fused.sn) == (hn_want, sn_want)
    torch.testing.assert_close(h.double(), h_want.double(), rtol=1e-5, atol=0)
    torch.testing.assert_close(s.double(), s_want.double(), rtol=1e-5, atol=0)


class _Float(nn.Module):
    """Hands the next layer float32 (under autocast it then computes on a cast copy)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float()


class _Net(nn.Module):
    """Every fusable family once, and a LayerNorm over two dims (not fusable: its input needs a view)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.conv1d = nn.Conv1d(4, 4, 3, padding=1)
        self.ln = nn.LayerNorm(4)
        self.ln2 = nn.LayerNorm((4, 6))
        self.fc = nn.Linear(4 * 6, 5)

    def forward(self, x):
        y = torch.relu(self.bn(self.conv(x)))  # (B, 4, 6, 6)
        y = self.conv1d(y.mean(2))  # (B, 4, 6)
        y = self.ln(y.transpose(1, 2)).transpose(1, 2)
        return self.fc(self.ln2(y).flatten(1))


@pytest.fixture
def stand_in(monkeypatch):
    return counting_stand_in(monkeypatch)


def counting_stand_in(monkeypatch) -> list[str]:
    """The capture path sees the stand-in extension for float32 tensors; returns the list
    of op names it is called with, in call order."""
    calls: list[str] = []

    def record(fn, name):
        def wrapped(*args):
            calls.append(name)
            return fn(*args)

        return wrapped

    fake = types.SimpleNamespace(layer_stats=record(fake_layer_stats, "layer_stats"),
                                 channel_stats=record(fake_channel_stats, "channel_stats"),
                                 conv_input_stats=record(fake_conv_input_stats, "conv_input_stats"),
                                 factor_update_=fake_factor_update_)
    monkeypatch.setattr(ck, "ext_for", lambda *t: fake if all(v.dtype == torch.float32 for v in t) else None)
    return calls


def _factors(model, x, y):
    opt = AdaFisher(model, lr=1e-3, TCov=100, backend="foreach")
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    return opt, {n: (c.H.clone(), c.S.clone()) for n, c in opt.binding.captures.items()}


def test_hooks_make_one_call_per_layer_and_match_the_torch_ops(stand_in):
    torch.manual_seed(0)
    base = _Net()
    x, y = torch.randn(4, 3, 6, 6), torch.randint(0, 5, (4,))
    opt, got = _factors(copy.deepcopy(base), x, y)
    # every layer but the two-dim LayerNorm in one call; that one by its two partials
    assert stand_in.count("layer_stats") == len(got) - 1 == 5
    assert stand_in.count("channel_stats") == 2 and "conv_input_stats" not in stand_in
    saved = ck.ext_for
    ck.ext_for = lambda *t: None
    try:
        _, want = _factors(copy.deepcopy(base), x, y)
    finally:
        ck.ext_for = saved
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n][0], want[n][0], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(got[n][1], want[n][1], rtol=1e-5, atol=1e-7)


def test_descriptions_are_cached_per_shapes(stand_in):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    opt = AdaFisher(model, lr=1e-3, TCov=1, backend="foreach")
    cap = next(iter(opt.binding.captures.values()))
    for rows in (2, 2, 5):
        opt.zero_grad()
        model(torch.randn(rows, 4)).sum().backward()
        opt.step()
    assert sorted(k[0][0] for k in cap.fused) == [2, 5]
    assert stand_in.count("layer_stats") == 3


@pytest.mark.parametrize("make, shape, pointwise", [
    (lambda: nn.Conv2d(5, 3, 1), (2, 5, 4, 3), True),
    (lambda: nn.Conv2d(5, 3, 1, padding=2), (2, 5, 4, 3), True),  # zero padding adds nothing
    (lambda: nn.Conv1d(4, 2, 1), (3, 4, 7), True),
    (lambda: nn.Conv2d(6, 4, 1, stride=2), (2, 6, 5, 5), False),  # positions skipped
    (lambda: nn.Conv2d(6, 4, 1, groups=2), (2, 6, 3, 3), False),  # taps pooled over the groups
    (lambda: nn.Conv2d(6, 4, 1, padding=1, padding_mode="reflect"), (2, 6, 3, 3), False),
])
def test_pointwise_convolutions_take_one_per_channel_pass(make, shape, pointwise, stand_in):
    torch.manual_seed(0)
    module = make()
    x = torch.randn(*shape)
    rule = rule_for(module)
    h, hn = rule.input_partial(module, x)
    assert ("conv_input_stats" not in stand_in) == pointwise or module.padding_mode != "zeros"
    fused = rule.fused_stats(module, x.shape, module(x).shape)
    if module.padding_mode == "zeros":
        assert fused is not None and (fused.input_op == (0, 1, 1)) == pointwise
    saved = ck.ext_for
    ck.ext_for = lambda *t: None
    try:
        want, want_n = rule.input_partial(module.double(), x.double())
    finally:
        ck.ext_for = saved
    assert hn == want_n
    torch.testing.assert_close(h.double(), want, rtol=1e-5, atol=0)
