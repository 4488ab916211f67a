"""The oracle against values worked out by hand from docs/ADAFISHER_SPEC.md, on tiny layers."""

import math

import pytest
import torch
from torch import nn

from lightning_cafin import spec

D = torch.float64


def t(*rows):
    return torch.tensor(rows, dtype=D)


def test_linear_with_bias_appends_a_ones_column():
    layer = nn.Linear(2, 2).double()
    H, S = spec.linear_stats(layer, t([1, 2], [3, 4]), t([1, 0], [2, 1]))
    assert torch.equal(H, t(5.0, 10.0, 1.0))
    assert torch.equal(S, t(2.5, 0.5))


def test_linear_flattens_leading_dims():
    layer = nn.Linear(1, 1, bias=False).double()
    H, S = spec.linear_stats(layer, torch.tensor([[[1.0], [2.0]], [[3.0], [4.0]]], dtype=D), torch.ones(2, 2, 1, dtype=D))
    assert torch.equal(H, t(30 / 4))
    assert torch.equal(S, t(1.0))


def test_conv2d_divides_by_batch_positions_and_K():
    layer = nn.Conv2d(1, 1, 2, bias=True).double()
    x = torch.arange(1.0, 10.0, dtype=D).reshape(1, 1, 3, 3)
    s = torch.arange(1.0, 5.0, dtype=D).reshape(1, 1, 2, 2)
    H, S = spec.conv2d_stats(layer, x, s)
    # taps (0,0) (0,1) (1,0) (1,1) over the four 2x2 windows; B*L*K = 1*4*4; bias entry g/K
    assert torch.allclose(H, t(46 / 16, 74 / 16, 154 / 16, 206 / 16, 1 / 4), rtol=0, atol=1e-15)
    assert torch.equal(S, t(30 / 4))


def test_conv2d_pools_groups_and_zero_pads():
    layer = nn.Conv2d(2, 2, 1, groups=2, padding=1, bias=True).double()
    x = torch.tensor([[[[1.0]], [[2.0]]]], dtype=D)  # B=1, C=2, 1x1 -> padded 3x3, L=9
    H, _ = spec.conv2d_stats(layer, x, torch.ones(1, 2, 3, 3, dtype=D))
    # rows: 2 groups x 9 positions; one column (K=1): (1 + 4) / (1*9*1); bias: g/K = 2
    assert torch.allclose(H, t(5 / 9, 2.0), rtol=0, atol=1e-15)


def test_batchnorm2d_quirks():
    layer = nn.BatchNorm2d(1).double()
    x = torch.tensor([[[[1.0, 2.0]]], [[[3.0, 4.0]]]], dtype=D)  # B=2, C=1, 1x2
    s = torch.tensor([[[[1.0, 1.0]]], [[[1.0, -1.0]]]], dtype=D)
    H, S = spec.batchnorm2d_stats(layer, x, s)
    # a = 10 / (2)^2 = 2.5; H = [a^2 / B^2, C / B^2]; S = (sum s)^2 / B
    assert torch.equal(H, t(2.5**2 / 4, 0.25))
    assert torch.equal(S, t(2.0))


def test_layernorm_reduces_all_but_dim_one():
    layer = nn.LayerNorm(2).double()
    H, S = spec.layernorm_stats(layer, t([1, 2], [3, 4]), t([1, 2], [3, -1]))
    assert torch.equal(H, t((16 + 36) / 4, 2 / 4))
    assert torch.equal(S, t(16 / 2, 1 / 2))
    layer3 = nn.LayerNorm(3).double()
    x = torch.arange(6.0, dtype=D).reshape(1, 2, 3)  # dims (0, 2) reduced; dn = 3
    H3, _ = spec.layernorm_stats(layer3, x, torch.ones(1, 2, 3, dtype=D))
    a = torch.tensor([3.0, 12.0], dtype=D) / 9
    assert torch.allclose(H3, t(float((a * a).sum()), 2.0), rtol=0, atol=1e-15)


def test_normalise_maps_infinities_then_min_max():
    v = spec.normalise(t(1.0, 3.0, math.inf, -math.inf))
    assert torch.allclose(v, t(1 / (3 + 1e-6), 3 / (3 + 1e-6), 1 / (3 + 1e-6), 0.0), rtol=0, atol=1e-15)


def test_average_starts_from_ones_and_is_not_convex():
    raw = t(0.0, 2.0)
    first = spec.average(None, raw, gamma=0.8)
    assert torch.allclose(first, t(0.08, 0.08 + 0.008 * 2 / (2 + 1e-6)), rtol=0, atol=1e-15)
    second = spec.average(first, raw, gamma=0.8)
    assert torch.allclose(second, 0.08 * first + 0.008 * spec.normalise(raw), rtol=0, atol=1e-15)


def test_fisher_is_outer_product_plus_damping():
    F = spec.fisher(t(1.0, 2.0), t(3.0, 4.0, 5.0), Lambda=0.5)
    assert torch.equal(F, t([3.5, 4.5, 5.5], [6.5, 8.5, 10.5]))


@pytest.mark.parametrize("decoupled", [False, True])
def test_reference_step_by_hand(decoupled):
    from lightning_cafin.backends import FactorView, ReferenceBackend, StepBatch, StepHyper

    p, g, m, k = t([1.0, -2.0]), t([0.5, 0.25]), t([0.0, 1.0]), torch.zeros((), dtype=torch.float32)
    S, H = t(2.0), t(0.5, 3.0, 0.1)  # row 0; this parameter takes columns 1..2
    view = FactorView(S, H, col_offset=1, ncols=2)
    lr, beta, lam, wd = 0.1, 0.9, 1e-3, 0.01
    p0 = p.clone()
    ReferenceBackend().step(StepBatch([p], [g], [m], [k], [view]), StepHyper(lr, beta, lam, wd, decoupled))
    F = t(2 * 3.0 + lam, 2 * 0.1 + lam)
    bc = 1 - beta
    if decoupled:
        m_new = t(0.9 * 0 + 0.1 * 0.5, 0.9 * 1 + 0.1 * 0.25)
        expect = p0 - lr * (m_new / bc / F + wd * p0)
    else:
        g2 = t(0.5, 0.25) + wd * p0
        m_new = 0.9 * t(0.0, 1.0) + 0.1 * g2
        expect = p0 - (lr / bc) * m_new / F
    assert k.item() == 1
    assert torch.allclose(m, m_new, rtol=1e-15, atol=0)
    assert torch.allclose(p, expect, rtol=1e-14, atol=0)


# ---------------------------------------------------------------- the generalised rules


def test_conv1d_window_sums_by_hand():
    layer = nn.Conv1d(1, 1, 2, bias=True).double()
    x = torch.tensor([[[1.0, 2.0, 3.0]]], dtype=D)  # B=1, C=1, L=3 -> windows (1,2), (2,3): L_out=2
    s = torch.tensor([[[1.0, 2.0]]], dtype=D)
    H, S = spec.conv_stats(layer, x, s)
    # tap 0: 1 + 4, tap 1: 4 + 9; B*L*K = 1*2*2; bias g/K = 1/2
    assert torch.allclose(H, t(5 / 4, 13 / 4, 1 / 2), rtol=0, atol=1e-15)
    assert torch.equal(S, t(5 / 2))


def test_conv3d_window_sums_by_hand():
    layer = nn.Conv3d(1, 1, (2, 1, 1), bias=False).double()
    x = torch.arange(1.0, 5.0, dtype=D).reshape(1, 1, 2, 1, 2)  # depth 2, 1x2 -> L_out = 1*1*2, K = 2
    s = torch.ones(1, 1, 1, 1, 2, dtype=D)
    H, S = spec.conv_stats(layer, x, s)
    # tap d=0 sees 1, 2; tap d=1 sees 3, 4; B*L*K = 4
    assert torch.allclose(H, t(5 / 4, 25 / 4), rtol=0, atol=1e-15)
    assert torch.equal(S, t(1.0))


def test_batchnorm1d_and_groupnorm_by_hand():
    x = t([1.0, 2.0], [3.0, 5.0])  # (B=2, C=2): spatial size 1
    s = t([1.0, -1.0], [2.0, 1.0])
    H, S = spec.channel_norm_stats(nn.BatchNorm1d(2).double(), x, s)
    # a = column sums = (4, 7); H = [(16 + 49) / 4, 2 / 4]; S = (3, 0)^2 / 2
    assert torch.equal(H, t(65 / 4, 0.5))
    assert torch.equal(S, t(4.5, 0.0))
    x3 = torch.tensor([[[1.0, 3.0]], [[2.0, 2.0]]], dtype=D)  # (B=2, C=1, L=2)
    H3, _ = spec.channel_norm_stats(nn.GroupNorm(1, 1).double(), x3, torch.ones_like(x3))
    assert torch.equal(H3, t((8 / 4) ** 2 / 4, 1 / 4))


def test_channels_first_layernorm_by_hand():
    layer = nn.LayerNorm(2).double()
    x = torch.tensor([[[[1.0]], [[2.0]]]], dtype=D)  # (N=1, C=2, 1, 1)
    s = torch.tensor([[[[3.0]], [[-1.0]]]], dtype=D)
    H, S = spec.layernorm_stats(layer, x, s, channels_first=True)
    # permuted (1, 1, 1, 2): a sums dims (0, 2, 3) -> one entry 3, dn = 1*2 -> a = 3/4
    assert torch.equal(H, t((3 / 4) ** 2, 1.0))
    assert torch.equal(S, t(9.0, 1.0))  # one entry per channel


def test_layernorm_over_two_dims_flattens_them():
    layer = nn.LayerNorm((1, 2)).double()
    x = torch.tensor([[[1.0, 2.0]], [[3.0, 4.0]]], dtype=D)  # (B=2, 1, 2) -> (2, 2)
    s = torch.tensor([[[1.0, 2.0]], [[3.0, -1.0]]], dtype=D)
    H, S = spec.layernorm_stats(layer, x, s)
    assert torch.equal(H, t((16 + 36) / 4, 2 / 4))
    assert torch.equal(S, t(16 / 2, 1 / 2))
