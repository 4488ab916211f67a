"""Which capture kernel each new rule uses, and that it computes the rule.

Conv1d runs the 2-D window-sum kernel as a convolution of height 1; every norm (any rank,
channels-first LayerNorms, RMSNorm) runs the per-channel kernel on the right dim; Conv3d
uses the torch ops.  On the CPU a stand-in extension restates the two kernels' contracts
with torch ops, so the routing (dims, divisors, the Conv1d -> 2-D mapping) is checked here;
on a GPU (``cuda``) the real kernels are compared with the float64 rules.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_cafin.capture import kernels as ck
from lightning_cafin.capture.layers import rule_for

from .test_capture_impl import fake_factor_update_
from .test_rules import ChannelsFirstLayerNorm


def fake_channel_stats(t, dim, square, divisor, side):
    dims = [d for d in range(t.dim()) if d != dim % t.dim()]
    v = t.float()
    out = (v.square() if square else v).sum(dims)
    return out / divisor if divisor > 0 else out


def fake_conv_input_stats(x, kernel, stride, padding, dilation, groups, out_hw, side):
    """Sum over batch, groups and output positions of the squared input under each tap."""
    B, C, H, W = x.shape
    need = [(o - 1) * s + d * (k - 1) + 1 for o, s, d, k in zip(out_hw, stride, dilation, kernel)]
    pads = (padding[1], max(0, need[1] - W - padding[1]), padding[0], max(0, need[0] - H - padding[0]))
    xp = F.pad(x.float(), pads)[:, :, : need[0], : need[1]]
    cols = F.unfold(xp, kernel, dilation=dilation, stride=stride)  # (B, C*kh*kw, L)
    cols = cols.reshape(B, groups, -1, cols.shape[-1])
    return cols.square().sum((0, 1, 3))


CALLS: list = []


def recording(fn, name):
    def wrapped(*args):
        CALLS.append(name)
        return fn(*args)

    return wrapped


@pytest.fixture
def stand_in(monkeypatch):
    fake = types.SimpleNamespace(channel_stats=recording(fake_channel_stats, "channel_stats"),
                                 conv_input_stats=recording(fake_conv_input_stats, "conv_input_stats"),
                                 factor_update_=fake_factor_update_)
    monkeypatch.setattr(ck, "ext_for", lambda *t: fake if all(x.dtype == torch.float32 for x in t) else None)
    CALLS.clear()
    return fake


CASES = {
    "conv1d": (lambda: nn.Conv1d(4, 6, 3, stride=2, padding=2, dilation=2, groups=2), (3, 4, 13), "conv_input_stats"),
    "conv1d_same": (lambda: nn.Conv1d(3, 2, 4, padding="same"), (2, 3, 9), "conv_input_stats"),
    "conv3d": (lambda: nn.Conv3d(2, 3, 3, padding=1), (2, 2, 4, 5, 3), None),
    "batchnorm1d_2d": (lambda: nn.BatchNorm1d(5), (6, 5), "channel_stats"),
    "batchnorm1d_3d": (lambda: nn.BatchNorm1d(5), (6, 5, 7), "channel_stats"),
    "batchnorm3d": (lambda: nn.BatchNorm3d(3), (2, 3, 4, 2, 3), "channel_stats"),
    "groupnorm": (lambda: nn.GroupNorm(2, 4), (3, 4, 5, 5), "channel_stats"),
    "layernorm_2dims": (lambda: nn.LayerNorm((3, 4)), (2, 5, 3, 4), "channel_stats"),
    "layernorm_channels_first": (lambda: ChannelsFirstLayerNorm(6), (2, 6, 5, 6), "channel_stats"),
    "rmsnorm": (lambda: nn.RMSNorm(8), (3, 4, 8), "channel_stats"),
}


def _stats(module, x, s):
    rule = rule_for(module)
    h, hn = rule.input_partial(module, x)
    sv, sn = rule.output_partial(module, s)
    return rule.finalize(module, h, hn, sv, sn)


def _case(name, device="cpu"):
    make, shape, _ = CASES[name]
    torch.manual_seed(0)
    module = make().to(device)
    x = torch.randn(*shape, device=device)
    with torch.no_grad():
        s = torch.randn_like(module(x))
    return module, x, s


def _close(got, want, rtol):
    for g, w in zip(got, want):
        g, w = g.double().cpu(), w.double().cpu()
        assert g.shape == w.shape
        err = ((g - w).abs().max() / w.abs().max().clamp_min(1e-300)).item()
        assert err <= rtol, err


@pytest.mark.parametrize("name", sorted(CASES))
def test_rules_route_to_the_kernel_contracts(name, stand_in):
    module, x, s = _case(name)
    got = _stats(module, x, s)
    kernel = CASES[name][2]
    assert (kernel in CALLS) if kernel else ("conv_input_stats" not in CALLS), CALLS
    want = _stats(module.double(), x.double(), s.double())  # float64: the torch ops
    _close(got, want, 1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the capture kernels need a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(CASES))
def test_kernels_match_the_float64_rules(name, dtype):
    module, x, s = _case(name, "cuda")
    x, s = x.to(dtype), s.to(dtype)
    got = _stats(module, x, s)
    want = _stats(module.double().cpu(), x.double().cpu(), s.double().cpu())
    _close(got, want, 1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the capture kernels need a CUDA device")
def test_channels_last_and_sliced_inputs_on_the_kernels():
    ln = ChannelsFirstLayerNorm(6).cuda()
    x = torch.randn(2, 6, 5, 6, device="cuda").contiguous(memory_format=torch.channels_last)
    s = torch.randn(4, 6, 5, 6, device="cuda")[::2]
    _close(_stats(ln, x, s), _stats(ln.double().cpu(), x.double().cpu(), s.double().cpu()), 1e-5)
