"""The capture rules (window sums, partial sums) against the oracle's im2col statistics."""

import pytest
import torch
from torch import nn

from lightning_cafin import spec
from lightning_cafin.capture.layers import rule_for

D = torch.float64


def rule_stats(module, x, s):
    rule = rule_for(module)
    h, hn = rule.input_partial(module, x)
    sv, sn = rule.output_partial(module, s)
    return rule.finalize(module, h, hn, sv, sn)


def output_grad(module, x):
    out = module(x)
    return torch.randn_like(out)


CONVS = {
    "3x3_pad1": dict(in_channels=3, out_channels=5, kernel_size=3, padding=1),
    "1x1": dict(in_channels=4, out_channels=6, kernel_size=1),
    "strided": dict(in_channels=3, out_channels=4, kernel_size=3, stride=2, padding=1),
    "rect": dict(in_channels=2, out_channels=3, kernel_size=(2, 3), stride=(1, 2), padding=(1, 0)),
    "grouped": dict(in_channels=6, out_channels=4, kernel_size=3, groups=2, padding=2),
    "depthwise": dict(in_channels=5, out_channels=5, kernel_size=3, groups=5, padding=1),
    "dilated": dict(in_channels=3, out_channels=4, kernel_size=3, dilation=2, padding=2),
    "same_even": dict(in_channels=3, out_channels=2, kernel_size=4, padding="same"),
    "same_dilated": dict(in_channels=2, out_channels=2, kernel_size=3, padding="same", dilation=3),
    "valid": dict(in_channels=3, out_channels=2, kernel_size=3, padding="valid", stride=2),
    "reflect": dict(in_channels=2, out_channels=3, kernel_size=3, padding=1, padding_mode="reflect"),
    "circular": dict(in_channels=2, out_channels=3, kernel_size=3, padding=2, padding_mode="circular"),
}


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("name", sorted(CONVS))
def test_conv2d_window_sums_match_im2col(name, bias):
    conv = nn.Conv2d(**CONVS[name], bias=bias).double()
    x = torch.randn(3, conv.in_channels, 9, 11, dtype=D)
    s = output_grad(conv, x)
    H, S = rule_stats(conv, x, s)
    H_ref, S_ref = spec.conv2d_stats(conv, x, s)
    assert H.shape == H_ref.shape == (conv.weight[0].numel() + bias,)
    torch.testing.assert_close(H, H_ref, rtol=1e-12, atol=0)
    torch.testing.assert_close(S, S_ref, rtol=1e-12, atol=0)


@pytest.mark.parametrize("layout", ["channels_last", "non_contiguous", "batch1"])
def test_conv2d_awkward_inputs(layout):
    conv = nn.Conv2d(4, 3, 3, stride=2, padding=1).double()
    x = torch.randn(2 if layout != "batch1" else 1, 4, 10, 10, dtype=D)
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last)
    elif layout == "non_contiguous":
        x = torch.randn(2, 10, 4, 10, dtype=D).transpose(1, 2)
        assert not x.is_contiguous()
    s = output_grad(conv, x)
    H, S = rule_stats(conv, x, s)
    H_ref, S_ref = spec.conv2d_stats(conv, x.contiguous(), s.contiguous())
    torch.testing.assert_close(H, H_ref, rtol=1e-12, atol=0)
    torch.testing.assert_close(S, S_ref, rtol=1e-12, atol=0)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(7, 5), (3, 4, 5), (2, 3, 4, 5)])
def test_linear_matches_oracle(shape, bias):
    lin = nn.Linear(shape[-1], 3, bias=bias).double()
    x = torch.randn(*shape, dtype=D)
    s = output_grad(lin, x)
    for got, ref in zip(rule_stats(lin, x, s), spec.linear_stats(lin, x, s)):
        torch.testing.assert_close(got, ref, rtol=1e-13, atol=0)


def test_batchnorm2d_matches_oracle():
    bn = nn.BatchNorm2d(5).double()
    x = torch.randn(4, 5, 3, 6, dtype=D)
    s = output_grad(bn, x)
    for got, ref in zip(rule_stats(bn, x, s), spec.batchnorm2d_stats(bn, x, s)):
        torch.testing.assert_close(got, ref, rtol=1e-13, atol=0)


@pytest.mark.parametrize("shape", [(6, 4), (2, 5, 4), (2, 3, 5, 4)])
def test_layernorm_matches_oracle(shape):
    ln = nn.LayerNorm(shape[-1]).double()
    x = torch.randn(*shape, dtype=D)
    s = output_grad(ln, x)
    for got, ref in zip(rule_stats(ln, x, s), spec.layernorm_stats(ln, x, s)):
        torch.testing.assert_close(got, ref, rtol=1e-13, atol=0)


def test_partial_sums_of_two_halves_equal_the_whole_batch():
    conv = nn.Conv2d(3, 4, 3, padding=1).double()
    rule = rule_for(conv)
    x = torch.randn(6, 3, 7, 7, dtype=D)
    s = output_grad(conv, x)
    halves = [rule.input_partial(conv, x[:3]), rule.input_partial(conv, x[3:])]
    shalves = [rule.output_partial(conv, s[:3]), rule.output_partial(conv, s[3:])]
    h = halves[0][0] + halves[1][0]
    sv = shalves[0][0] + shalves[1][0]
    H, S = rule.finalize(conv, h, halves[0][1] + halves[1][1], sv, shalves[0][1] + shalves[1][1])
    H_ref, S_ref = spec.conv2d_stats(conv, x, s)
    torch.testing.assert_close(H, H_ref, rtol=1e-12, atol=0)
    torch.testing.assert_close(S, S_ref, rtol=1e-12, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_activations_are_summed_in_float32(dtype):
    lin = nn.Linear(8, 4)
    x = (torch.randn(512, 8) * 300).to(dtype)  # squares overflow float16 sums
    s = (torch.randn(512, 4) * 300).to(dtype)
    H, S = rule_stats(lin, x, s)
    assert H.dtype == S.dtype == torch.float32
    assert torch.isfinite(H).all() and torch.isfinite(S).all()
    H_ref, S_ref = spec.linear_stats(lin, x.float(), s.float())
    torch.testing.assert_close(H, H_ref, rtol=1e-5, atol=0)
    torch.testing.assert_close(S, S_ref, rtol=1e-5, atol=0)


def test_unsupported_modules_have_no_rule():
    for layers in ("paper", "all"):
        assert rule_for(nn.Embedding(3, 2), layers) is None
        assert rule_for(nn.BatchNorm2d(3, affine=False), layers) is None
    # the authors' set: one normalised dim only, no Conv1d
    assert rule_for(nn.LayerNorm((2, 3)), "paper") is None
    assert rule_for(nn.Conv1d(2, 2, 3), "paper") is None


@pytest.mark.parametrize("name", sorted(CONVS))
def test_oracle_patches_reproduce_the_convolution(name):
    """The patch geometry (padding modes, 'same', dilation, groups) checked against conv2d itself."""
    conv = nn.Conv2d(**CONVS[name], bias=False).double()
    x = torch.randn(2, conv.in_channels, 9, 11, dtype=D)
    out = conv(x)
    B, O, Ho, Wo = out.shape
    g = conv.groups
    patches = spec.conv2d_patches(conv, x).reshape(B, g, Ho * Wo, -1)  # rows (b, group, position)
    w = conv.weight.reshape(g, O // g, -1)  # (group, out within group, K)
    rebuilt = torch.einsum("bglk,gok->bgol", patches, w).reshape(B, O, Ho, Wo)
    torch.testing.assert_close(rebuilt, out, rtol=1e-12, atol=1e-12)
