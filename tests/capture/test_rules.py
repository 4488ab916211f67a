"""The generalised rules (N-d convolutions, per-channel and per-feature norms, transposed
linears) against their float64 oracles in ``spec.py``, and which rule each module gets."""

import pytest
import torch
from torch import nn

from lightning_cafin import spec
from lightning_cafin.capture.layers import rule_for

D = torch.float64


def rule_stats(module, x, s, layers="all"):
    rule = rule_for(module, layers)
    h, hn = rule.input_partial(module, x)
    sv, sn = rule.output_partial(module, s)
    return rule.finalize(module, h, hn, sv, sn)


def assert_matches(got, ref, rtol=1e-12):
    for g, r in zip(got, ref):
        assert g.shape == r.shape
        torch.testing.assert_close(g, r, rtol=rtol, atol=1e-300)


CONV1D = {
    "k3_pad1": dict(in_channels=3, out_channels=5, kernel_size=3, padding=1),
    "strided_dilated": dict(in_channels=2, out_channels=4, kernel_size=3, stride=2, dilation=2, padding=2),
    "grouped_same": dict(in_channels=4, out_channels=6, kernel_size=4, groups=2, padding="same"),
    "depthwise": dict(in_channels=5, out_channels=5, kernel_size=5, groups=5, padding=2),
    "reflect": dict(in_channels=2, out_channels=3, kernel_size=3, padding=1, padding_mode="reflect"),
    "circular": dict(in_channels=2, out_channels=3, kernel_size=3, padding=2, padding_mode="circular"),
}
CONV3D = {
    "k3_pad1": dict(in_channels=2, out_channels=3, kernel_size=3, padding=1),
    "rect_strided": dict(in_channels=2, out_channels=2, kernel_size=(1, 2, 3), stride=(1, 2, 1), padding=(0, 1, 1)),
    "grouped_dilated": dict(in_channels=4, out_channels=4, kernel_size=2, groups=2, dilation=2, padding=1),
    "same": dict(in_channels=2, out_channels=2, kernel_size=(2, 3, 2), padding="same"),
    "replicate": dict(in_channels=1, out_channels=2, kernel_size=3, padding=1, padding_mode="replicate"),
}


def _conv_case(cls, kwargs, bias, spatial):
    conv = cls(**kwargs, bias=bias).double()
    x = torch.randn(3, conv.in_channels, *spatial, dtype=D)
    s = torch.randn_like(conv(x))
    return conv, x, s


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("name", sorted(CONV1D))
def test_conv1d_matches_im2col(name, bias):
    conv, x, s = _conv_case(nn.Conv1d, CONV1D[name], bias, (11,))
    H, S = rule_stats(conv, x, s)
    assert H.shape == (conv.weight[0].numel() + bias,)
    assert_matches((H, S), spec.conv_stats(conv, x, s))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("name", sorted(CONV3D))
def test_conv3d_matches_im2col(name, bias):
    conv, x, s = _conv_case(nn.Conv3d, CONV3D[name], bias, (5, 6, 4))
    H, S = rule_stats(conv, x, s)
    assert H.shape == (conv.weight[0].numel() + bias,)
    assert_matches((H, S), spec.conv_stats(conv, x, s))


@pytest.mark.parametrize("cls,kwargs,spatial", [(nn.Conv1d, c, (11,)) for c in CONV1D.values()]
                         + [(nn.Conv3d, c, (5, 6, 4)) for c in CONV3D.values()]
                         + [(nn.Conv2d, dict(in_channels=4, out_channels=2, kernel_size=3, groups=2, stride=2,
                                             padding=1), (7, 6))])
def test_nd_patches_reproduce_the_convolution(cls, kwargs, spatial):
    """The N-d im2col of the oracle, checked against the convolution itself."""
    conv = cls(**kwargs, bias=False).double()
    x = torch.randn(2, conv.in_channels, *spatial, dtype=D)
    out = conv(x)
    B, O, g = out.shape[0], out.shape[1], conv.groups
    patches = spec.conv_patches(conv, x).reshape(B, g, out[0, 0].numel(), -1)
    w = conv.weight.reshape(g, O // g, -1)
    rebuilt = torch.einsum("bglk,gok->bgol", patches, w).reshape(out.shape)
    torch.testing.assert_close(rebuilt, out, rtol=1e-12, atol=1e-12)


def test_conv2d_oracles_agree():
    conv, x, s = _conv_case(nn.Conv2d, dict(in_channels=4, out_channels=6, kernel_size=3, groups=2, padding=2,
                                            dilation=2), True, (8, 9))
    assert_matches(spec.conv_stats(conv, x, s), spec.conv2d_stats(conv, x, s))


@pytest.mark.parametrize("module,shape", [
    (nn.BatchNorm1d(4), (5, 4)),
    (nn.BatchNorm1d(4), (5, 4, 7)),
    (nn.BatchNorm2d(4), (5, 4, 3, 2)),
    (nn.BatchNorm3d(4), (5, 4, 3, 2, 2)),
    (nn.SyncBatchNorm(4), (5, 4, 3, 2)),
    (nn.GroupNorm(2, 4), (5, 4, 3, 3)),
    (nn.GroupNorm(4, 4), (5, 4, 6)),
])
def test_channel_norms_match_oracle(module, shape):
    module = module.double()
    x, s = torch.randn(*shape, dtype=D), torch.randn(*shape, dtype=D)
    H, S = rule_stats(module, x, s)
    assert H.shape == (2,) and S.shape == (4,)
    assert_matches((H, S), spec.channel_norm_stats(module, x, s))


def test_batchnorm2d_keeps_the_paper_oracle():
    bn = nn.BatchNorm2d(3).double()
    x, s = torch.randn(4, 3, 5, 2, dtype=D), torch.randn(4, 3, 5, 2, dtype=D)
    assert_matches(spec.channel_norm_stats(bn, x, s), spec.batchnorm2d_stats(bn, x, s), rtol=1e-14)


@pytest.mark.parametrize("normalized,shape", [((4,), (6, 4)), ((3, 4), (2, 5, 3, 4)), ((3, 4), (2, 3, 4)),
                                              ((2, 2, 3), (3, 2, 2, 3))])
@pytest.mark.parametrize("bias", [True, False])
def test_layernorm_any_normalised_shape(normalized, shape, bias):
    ln = nn.LayerNorm(normalized, bias=bias).double()
    x = torch.randn(*shape, dtype=D)
    s = torch.randn_like(ln(x))
    H, S = rule_stats(ln, x, s)
    assert S.numel() == ln.weight.numel()
    assert_matches((H, S), spec.layernorm_stats(ln, x, s))
    assert [slot.role for slot in rule_for(ln).slots(ln)] == (["weight", "bias"] if bias else ["weight"])


class ChannelsFirstLayerNorm(nn.LayerNorm):
    """A LayerNorm2d as transformers' ConvNext writes it: ``data_format`` says the layout."""

    data_format = "channels_first"

    def forward(self, x):
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class UnknownLayerNorm(nn.LayerNorm):
    def forward(self, x):
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def _layernorm2d_classes():
    out = [ChannelsFirstLayerNorm]
    try:
        from torchvision.models.convnext import LayerNorm2d
        out.append(LayerNorm2d)
    except ImportError:
        pass
    try:
        from timm.layers import LayerNorm2d as TimmLayerNorm2d
        out.append(TimmLayerNorm2d)
    except ImportError:
        pass
    return out


@pytest.mark.parametrize("cls", _layernorm2d_classes(), ids=lambda c: f"{c.__module__}.{c.__name__}")
@pytest.mark.parametrize("hw", [(5, 3), (4, 6)], ids=["W==C", "W!=C"])
def test_channels_first_layernorm_gets_channel_statistics(cls, hw):
    """The silent wrong result of the old rule: with W == C it took width statistics."""
    ln = cls(6 if hw[1] == 6 else 3).double()
    C = ln.weight.numel()
    x = torch.randn(2, C, *hw, dtype=D)
    out = ln(x)
    s = torch.randn_like(out)
    H, S = rule_stats(ln, x, s)
    H_ref, S_ref = spec.layernorm_stats(ln, x, s, channels_first=True)
    assert_matches((H, S), (H_ref, S_ref))
    # S is the per-channel sum of the gradient over batch and space, squared, over B
    torch.testing.assert_close(S, s.sum((0, 2, 3)) ** 2 / 2, rtol=1e-12, atol=0)
    if hw[1] == C:  # the width statistics (the old rule) differ
        assert not torch.allclose(S, s.sum((0, 1, 2)) ** 2 / 2)


def test_layernorm_subclass_with_unknown_forward_is_not_guessed():
    assert rule_for(UnknownLayerNorm(4)) is None
    assert rule_for(ChannelsFirstLayerNorm(4)).channels_first
    assert not rule_for(nn.LayerNorm(4)).channels_first


class PlainLinear(nn.Linear):
    pass


def test_rule_sets():
    paper = {nn.Linear(2, 2), nn.Conv2d(1, 1, 1), nn.BatchNorm2d(2), nn.LayerNorm(2)}
    for m in paper:
        assert rule_for(m, "paper") is rule_for(m, "all")
    extra = [PlainLinear(2, 2), nn.Conv1d(1, 1, 1), nn.Conv3d(1, 1, 1), nn.BatchNorm1d(2), nn.BatchNorm3d(2),
             nn.SyncBatchNorm(2), nn.GroupNorm(1, 2), nn.LayerNorm((2, 2)), nn.RMSNorm(3), ChannelsFirstLayerNorm(2)]
    for m in extra:
        assert rule_for(m, "paper") is None, type(m).__name__
        assert rule_for(m, "all") is not None, type(m).__name__
    for m in (nn.ConvTranspose2d(1, 1, 1), nn.GroupNorm(1, 2, affine=False), nn.RMSNorm(3, elementwise_affine=False),
              nn.Embedding(3, 2), nn.InstanceNorm2d(2, affine=True)):
        assert rule_for(m) is None, type(m).__name__
    with pytest.raises(ValueError, match="layers must be one of"):
        rule_for(nn.Linear(2, 2), "everything")


@pytest.mark.parametrize("shape", [(6, 4), (2, 5, 4)])
def test_rmsnorm_matches_oracle(shape):
    rms = nn.RMSNorm(4).double()
    x = torch.randn(*shape, dtype=D)
    s = torch.randn(*shape, dtype=D)
    H, S = rule_stats(rms, x, s)
    assert_matches((H, S), spec.layernorm_stats(rms, x, s))
    assert [slot.role for slot in rule_for(rms).slots(rms)] == ["weight"]


def test_library_rmsnorms_are_recognised_by_name():
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    for module in (llama.LlamaRMSNorm(4), t5.T5LayerNorm(4)):
        module = module.double()
        x = torch.randn(3, 5, 4, dtype=D)
        s = torch.randn(3, 5, 4, dtype=D)
        rule = rule_for(module)
        assert rule is not None and not rule.channels_first
        assert_matches(rule_stats(module, x, s), spec.layernorm_stats(module, x, s))


def test_transformers_conv1d_is_a_transposed_linear():
    pytorch_utils = pytest.importorskip("transformers.pytorch_utils")
    conv = pytorch_utils.Conv1D(5, 3).double()  # weight (in=3, out=5)
    x = torch.randn(2, 4, 3, dtype=D)
    s = torch.randn_like(conv(x))
    rule = rule_for(conv)
    assert rule.transposed
    slots = rule.slots(conv)
    assert slots[0].transposed and slots[0].ncols == 3 and slots[1].col_offset == 3
    assert_matches(rule_stats(conv, x, s), spec.linear_stats(conv, x, s))
