"""The capture kernels against the torch rules and the oracle (GPU only).

Inputs are fresh and random (never zeros).  Statistics: the kernels' float32 sums
against the torch rules evaluated in float64 on the very same (possibly fp16/bf16)
values, and a subset against the im2col oracle (``lightning_cafin.spec``), to 1e-5
relative to the vector's scale.  The factor update: the one-launch kernel against the
torch loop of ``factors.py`` (the CPU/fallback path) to 1e-6 relative, NaN and inf cases
included.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_cafin import spec
from lightning_cafin._conv import conv_output_hw, conv_padding
from lightning_cafin.capture import kernels as ck
from lightning_cafin.capture.factors import update_factors
from lightning_cafin.capture.layer_capture import LayerCapture, PendingStats
from lightning_cafin.capture.layers import rule_for
from lightning_cafin.capture.rules.conv import conv_columns

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the capture kernels need a CUDA device"),
]

DEV = "cuda"
STAT_RTOL = 1e-5
FACTOR_RTOL = 1e-6
LOWP = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(scope="module")
def ext(fused_ok):
    from lightning_cafin.kernels import load_extension

    mod = load_extension()
    if not hasattr(mod, "channel_stats"):
        pytest.fail("the extension was built without the capture kernels")
    return mod


@pytest.fixture
def impl():
    """Switch the capture implementation inside a test; restored afterwards."""
    previous = ck.get_impl()
    yield ck.set_impl
    ck.set_impl(previous)


def close(got, want, rtol):
    got, want = got.double().cpu(), want.double().cpu()
    assert got.shape == want.shape, (got.shape, want.shape)
    scale = want.abs().max().clamp_min(1e-300)
    err = ((got - want).abs().max() / scale).item()
    assert err <= rtol, f"relative error {err:.3e} > {rtol:.1e}"


def randn(shape, dtype=torch.float32, layout="contiguous"):
    """Random values of the given layout: contiguous, channels_last, or a strided view."""
    if layout == "channels_last":
        return torch.randn(shape, device=DEV, dtype=dtype).contiguous(memory_format=torch.channels_last)
    if layout == "sliced":  # every other channel of a wider tensor, batch-strided
        wide = list(shape)
        wide[1] = 2 * shape[1] + 1
        return torch.randn(wide, device=DEV, dtype=dtype)[:, 1::2]
    if layout == "transposed":  # last two dims swapped in memory
        t = torch.randn(*shape[:-2], shape[-1], shape[-2], device=DEV, dtype=dtype)
        return t.transpose(-1, -2)
    if layout == "batch_sliced":  # rows of a bigger batch, contiguous per sample
        t = torch.randn(2 * shape[0] + 1, *shape[1:], device=DEV, dtype=dtype)
        return t[1::2]
    return torch.randn(shape, device=DEV, dtype=dtype)


def device_kernels(fn) -> list[str]:
    """The package's kernels that ``fn()`` launches, in order (after one call that makes the
    stream's counter pool)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
            and "lightning_cafin" in e.name]


def torch_rule(impl, module, x, side):
    """The torch rule on x upcast to float64 (the exact value of the same inputs)."""
    impl("torch")
    rule = rule_for(module)
    m64 = copy.deepcopy(module).double()
    fn = rule.input_partial if side == "in" else rule.output_partial
    return fn(m64, x.double())


def kernel_rule(impl, module, x, side):
    impl("kernels")
    rule = rule_for(module)
    fn = rule.input_partial if side == "in" else rule.output_partial
    return fn(module, x)


# --------------------------------------------------------------------------- conv inputs

CONVS = {
    "3x3_pad1": dict(in_channels=16, out_channels=8, kernel_size=3, padding=1),
    "1x1": dict(in_channels=12, out_channels=6, kernel_size=1),
    "1x1_strided": dict(in_channels=8, out_channels=6, kernel_size=1, stride=2),
    "strided": dict(in_channels=6, out_channels=4, kernel_size=3, stride=2, padding=1),
    "rect": dict(in_channels=5, out_channels=3, kernel_size=(2, 3), stride=(1, 2), padding=(1, 0)),
    "grouped": dict(in_channels=12, out_channels=8, kernel_size=3, groups=4, padding=2),
    "depthwise": dict(in_channels=10, out_channels=10, kernel_size=3, groups=10, padding=1),
    "depthwise_mult": dict(in_channels=6, out_channels=12, kernel_size=5, groups=6, padding=2, stride=2),
    "dilated": dict(in_channels=7, out_channels=4, kernel_size=3, dilation=2, padding=2),
    "dilated_rect": dict(in_channels=3, out_channels=4, kernel_size=(3, 2), dilation=(2, 3), padding=(3, 1), stride=(2, 1)),
    "same_even": dict(in_channels=3, out_channels=2, kernel_size=4, padding="same"),
    "same_dilated": dict(in_channels=5, out_channels=2, kernel_size=3, padding="same", dilation=3),
    "valid": dict(in_channels=3, out_channels=2, kernel_size=3, padding="valid", stride=2),
    "big_pad": dict(in_channels=3, out_channels=2, kernel_size=3, padding=4),
    "kernel_larger_than_input": dict(in_channels=2, out_channels=2, kernel_size=7, padding=3),
}


@pytest.mark.parametrize("name", sorted(CONVS))
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_conv_input_stats_match_the_torch_rule(ext, impl, name, layout):
    m = nn.Conv2d(**CONVS[name], bias=True).to(DEV)
    x = randn((3, m.in_channels, 11, 9), layout=layout)
    h, hn = kernel_rule(impl, m, x, "in")
    h_ref, hn_ref = torch_rule(impl, m, x, "in")
    assert h.dtype == torch.float32 and h.shape == (conv_columns(m),)
    assert hn == hn_ref
    close(h, h_ref, STAT_RTOL)


@pytest.mark.parametrize("name", ["3x3_pad1", "grouped", "depthwise", "dilated_rect", "same_even"])
def test_conv_stats_match_the_im2col_oracle(ext, impl, name):
    m = nn.Conv2d(**CONVS[name], bias=True).to(DEV)
    x = randn((4, m.in_channels, 10, 13))
    s = torch.randn_like(m(x))
    impl("kernels")
    rule = rule_for(m)
    h, hn = rule.input_partial(m, x)
    sv, sn = rule.output_partial(m, s)
    H, S = rule.finalize(m, h, hn, sv, sn)
    H_ref, S_ref = spec.conv2d_stats(copy.deepcopy(m).double(), x.double(), s.double())
    close(H, H_ref, STAT_RTOL)
    close(S, S_ref, STAT_RTOL)


@pytest.mark.parametrize("dtype", LOWP)
@pytest.mark.parametrize(
    "shape,layout",
    [
        ((1, 16, 9, 9), "contiguous"),  # batch 1
        ((1, 16, 9, 9), "channels_last"),
        ((300, 8, 6, 7), "contiguous"),  # large batch, odd spatial size
        ((300, 8, 6, 7), "channels_last"),
        ((5, 16, 9, 9), "sliced"),  # non-contiguous channels: copied once
        ((5, 16, 9, 9), "transposed"),
        ((5, 16, 9, 9), "batch_sliced"),  # dense samples, batch stride > C*H*W
        ((7, 3, 13, 5), "contiguous"),  # sizes not multiples of 4
    ],
)
def test_conv_input_stats_awkward_inputs_and_dtypes(ext, impl, dtype, shape, layout):
    m = nn.Conv2d(shape[1], 4, 3, stride=2, padding=1, groups=1 if shape[1] % 2 else 2).to(DEV)
    x = randn(shape, dtype=dtype, layout=layout)
    h, hn = kernel_rule(impl, m, x, "in")
    h_ref, hn_ref = torch_rule(impl, m, x, "in")
    assert h.dtype == torch.float32 and hn == hn_ref
    close(h, h_ref, STAT_RTOL)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_conv_input_stats_resnet_sizes(ext, impl, layout):
    """The benchmark's shapes (batch splits and phase-2 chunks engaged); channels_last maps
    of one group and kernels up to 3 x 3 take the channels-side-by-side phase 2: several
    channel tiles, a part-filled last tile (100, 48 channels), 1 x 1 and 2 x 2 kernels.
    channels_last maps of many batch splits cut the split maps into groups too (8 x 8 and
    4 x 4: groups of uneven sizes; 16 x 16: position chunks of several map groups each)."""
    for C, HW, k, st, p in [
        (3, 32, 3, 1, 1),
        (64, 32, 3, 1, 1),
        (64, 32, 1, 2, 0),
        (128, 16, 3, 2, 1),
        (256, 8, 3, 1, 1),
        (512, 4, 3, 1, 1),
        (256, 14, 1, 1, 0),
        (100, 15, 3, 1, 1),
        (48, 20, 2, 1, 0),
    ]:
        m = nn.Conv2d(C, 8, k, stride=st, padding=p, bias=False).to(DEV)
        x = randn((256, C, HW, HW), layout=layout)
        close(kernel_rule(impl, m, x, "in")[0], torch_rule(impl, m, x, "in")[0], STAT_RTOL)


def test_conv_input_stats_channels_last_bf16_wide_map(ext, impl):
    """A bf16 channels_last map big enough for many position chunks per channel tile, with
    a dilated 3 x 3 kernel and padding on one side only (taps near every edge)."""
    m = nn.Conv2d(96, 8, 3, stride=(2, 1), padding=(0, 2), dilation=(1, 2), bias=False).to(DEV)
    x = randn((6, 96, 57, 61), dtype=torch.bfloat16, layout="channels_last")
    close(kernel_rule(impl, m, x, "in")[0], torch_rule(impl, m, x, "in")[0], STAT_RTOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "B,C,H,W,conv",
    [
        # (3 x 3 with padding (1, 0): at padding 1 and stride 1 the border sums take them,
        # test_border_taps_match_the_torch_rule)
        (1, 64, 7, 7, dict(kernel_size=3, padding=(1, 0))),  # one split, one part-filled block
        (8, 8, 72, 72, dict(kernel_size=3, padding=(1, 0))),  # a position a thread (bf16), several groups of blocks
        (96, 64, 7, 7, dict(kernel_size=3, padding=(1, 0))),  # several splits into one block
        (40, 16, 23, 19, dict(kernel_size=3, stride=2, padding=1)),  # many blocks, a part-filled last one
        (33, 128, 9, 9, dict(kernel_size=(1, 3), padding=(0, 2), dilation=(1, 2))),
        (17, 32, 12, 12, dict(kernel_size=2, stride=2)),  # no padding, taps that skip rows
        # (1 x 1 at stride 2 on maps of odd size: where the tap rows tile the map, the
        # rows kernel reads the taps instead, test_strided_pointwise_conv_reads_only_its_taps)
        (20, 256, 7, 7, dict(kernel_size=1, stride=2)),  # 1 x 1: the one-tap fold
        (9, 512, 5, 5, dict(kernel_size=1, padding=1)),  # a thread a channel, taps past every edge
        (6, 1024, 5, 5, dict(kernel_size=1, stride=2)),  # 2-byte inputs: two channels a thread
    ],
)
def test_folded_window_sums_match_the_torch_rule(ext, impl, dtype, B, C, H, W, conv):
    """channels_last inputs of one group whose window sums fold into phase 1's launch
    (capture_launch.h, WindowFold): one split and several, one block along the map and
    many in several groups, part-filled blocks, every kernel shape up to 3 x 3 with
    strides, dilation and padding, and channels from a position a thread to two channels
    a thread (every case folds, in each dtype: their blocks' partial sums are at most
    half their map values); against the
    float64 rule, and a second call equal to the first bit for bit (the last blocks'
    counters are back at zero, and the order of the sums is the plan's, not the blocks')."""
    m = nn.Conv2d(C, 4, bias=False, **conv).to(DEV)
    x = randn((B, C, H, W), dtype=dtype, layout="channels_last")
    h, _ = kernel_rule(impl, m, x, "in")
    again, _ = kernel_rule(impl, m, x, "in")
    close(h, torch_rule(impl, m, x, "in")[0], STAT_RTOL)
    assert torch.equal(h, again)


def assert_one_border_launch(ext, impl, m, x, g):
    """A 3 x 3 layer's taps from its nine border or parity sums (capture_launch.h, BorderTaps)
    against the float64 rule (with a bias: the rule's ones column after them), the direct op
    and the op with its gradient's read in one launch the same, and a second call equal bit
    for bit (the counters back at zero, the taps a fixed expression of the sums whichever
    block finishes last)."""
    want = torch_rule(impl, m, x, "in")[0]
    h, _ = kernel_rule(impl, m, x, "in")
    close(h, want, STAT_RTOL)
    assert torch.equal(h, kernel_rule(impl, m, x, "in")[0])
    fused = rule_for(m).fused_stats(m, x.shape, g.shape)
    hf, sf = fused.run(ext, x, g, False)
    close(hf, want, STAT_RTOL)
    close(sf, torch_rule(impl, m, g, "out")[0], STAT_RTOL)
    again = fused.run(ext, x, g, False)
    assert torch.equal(hf, again[0]) and torch.equal(sf, again[1])
    kernels = device_kernels(lambda: fused.run(ext, x, g, False))
    assert len(kernels) == 1 and "border_taps_kernel" in kernels[0], kernels


@pytest.mark.parametrize("dtype", LOWP)
@pytest.mark.parametrize(
    "B,C,H,W",
    [
        (4, 16, 12, 10),  # one split a read
        (48, 64, 14, 14),  # the total's read split, the borders' too
        (32, 256, 14, 14),  # a ResNet-50 layer3 shape
        (8, 512, 7, 7),  # two channel tiles
        (2, 96, 9, 11),  # a part-filled tile (fp32: 24 vectors of 32 lanes)
        (1, 64, 7, 7),  # batch 1
        (3, 8, 1, 5),  # one row: the top row is the bottom row
        (3, 8, 6, 1),  # one column
        (2, 16, 2, 2),  # every position on the border, each a corner
        (16, 64, 56, 56),  # a ResNet-50 layer1 shape
    ],
)
def test_border_taps_match_the_torch_rule(ext, impl, dtype, B, C, H, W):
    """A 3 x 3 convolution at stride 1 with padding 1 on a channels_last input: its taps from
    the nine border sums in one launch with its gradient's read (assert_one_border_launch)."""
    m = nn.Conv2d(C, 8, 3, padding=1).to(DEV)
    x = randn((B, C, H, W), dtype=dtype, layout="channels_last")
    g = randn((B, 8, H, W), dtype=dtype, layout="channels_last")
    assert_one_border_launch(ext, impl, m, x, g)


@pytest.mark.parametrize("dtype", LOWP)
@pytest.mark.parametrize(
    "B,C,H,W",
    [
        (4, 16, 12, 10),  # one split a read
        (64, 128, 28, 28),  # the classes' reads split, the last row's and column's too
        (32, 256, 14, 14),  # a ResNet-50 layer3 shape (layer3.0.conv2's input, 28 x 28 at 128)
        (8, 512, 14, 14),  # two channel tiles
        (2, 96, 10, 12),  # a part-filled tile (fp32: 24 vectors of 32 lanes)
        (1, 64, 8, 8),  # batch 1: the classes' rows are the map's alone
        (3, 8, 2, 6),  # two rows: the odd row is the last
        (3, 8, 6, 2),  # two columns
        (2, 16, 2, 2),  # one position a class
        (16, 128, 56, 56),  # a ResNet-50 layer2.0.conv2 shape
    ],
)
def test_parity_taps_match_the_torch_rule(ext, impl, dtype, B, C, H, W):
    """A 3 x 3 convolution at stride 2 with padding 1 on a channels_last input of even H and
    W: its taps from the nine parity sums (the four row and column parity classes, the last
    row's and the last column's two, the last corner) in one launch with its gradient's read
    (assert_one_border_launch)."""
    m = nn.Conv2d(C, 8, 3, stride=2, padding=1).to(DEV)
    x = randn((B, C, H, W), dtype=dtype, layout="channels_last")
    g = randn((B, 8, H // 2, W // 2), dtype=dtype, layout="channels_last")
    assert_one_border_launch(ext, impl, m, x, g)


@pytest.mark.parametrize("stride", [1, 2])
def test_taps_of_what_the_sums_leave_out_are_not_negative(ext, impl, stride):
    """A map whose x^2 lies only in the last row and the last column, large against the rest:
    the taps that leave both out are exactly 0 by the rule, and their computed difference of
    sums could round below it; they are written as 0 or more, within the rule's tolerance.
    A NaN in the map still reaches every tap it is under (the factor update's check)."""
    m = nn.Conv2d(256, 8, 3, stride=stride, padding=1, bias=False).to(DEV)
    x = torch.zeros(8, 256, 12, 12, device=DEV)
    x[:, :, -1, :] = 1e3 * torch.rand(8, 256, 12, device=DEV)
    x[:, :, :, -1] = 1e3 * torch.rand(8, 256, 12, device=DEV)
    x = x.contiguous(memory_format=torch.channels_last)
    h, _ = kernel_rule(impl, m, x, "in")
    want = torch_rule(impl, m, x, "in")[0]
    close(h, want, STAT_RTOL)
    assert (want.view(256, 3, 3)[:, 0, 0] == 0).all()
    assert (h >= 0).all(), h.min()
    x[0, 5, 3, 4] = float("nan")
    h, _ = kernel_rule(impl, m, x, "in")
    taps = h.view(256, 3, 3)
    assert taps[5].isnan().any() and not taps[4].isnan().any()


@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("side", [False, True])
def test_border_taps_of_a_batch_strided_input_and_on_the_side_stream(ext, impl, side, stride):
    """Every other sample of a channels_last batch (the batch's stride twice a sample's) and
    the side stream: the border reads step by the batch's stride; the parity classes, whose
    rows merge the batch with the map's rows, leave such a batch to the map (no border
    launch); the float64 rule either way."""
    from lightning_cafin.capture import streams

    m = nn.Conv2d(32, 8, 3, stride=stride, padding=1, bias=False).to(DEV)
    x = randn((12, 32, 10, 10), torch.bfloat16, "channels_last")[::2]
    g = randn((6, 8, 10 // stride, 10 // stride), torch.bfloat16, "channels_last")
    fused = rule_for(m).fused_stats(m, x.shape, g.shape)
    h, s = fused.run(ext, x, g, side)
    if side:
        streams.join()
    close(h, torch_rule(impl, m, x, "in")[0], STAT_RTOL)
    close(s, torch_rule(impl, m, g, "out")[0], STAT_RTOL)
    kernels = device_kernels(lambda: fused.run(ext, x, g, False))
    assert any("border_taps_kernel" in k for k in kernels) == (stride == 1), kernels


@pytest.mark.parametrize(
    "C,dtype,conv",
    [
        (12, torch.bfloat16, dict(kernel_size=3, padding=1)),  # channels off the 16-byte grid
        (16, torch.bfloat16, dict(kernel_size=3, padding=1, dilation=2)),  # another geometry
        (16, torch.bfloat16, dict(kernel_size=3, padding=2)),
        (16, torch.float32, dict(kernel_size=3, padding=1, stride=2)),  # (an odd map)
        (16, torch.bfloat16, dict(kernel_size=3, padding=1, stride=(2, 1))),
        (16, torch.bfloat16, dict(kernel_size=3, padding=0, stride=2)),
    ],
)
def test_border_taps_only_where_they_fit(ext, impl, C, dtype, conv):
    """Elsewhere the map and its window sums (or the fold), as before: the float64 rule, and
    no border launch."""
    m = nn.Conv2d(C, 8, bias=False, **conv).to(DEV)
    x = randn((6, C, 9, 9), dtype=dtype, layout="channels_last")
    close(kernel_rule(impl, m, x, "in")[0], torch_rule(impl, m, x, "in")[0], STAT_RTOL)
    kernels = device_kernels(lambda: kernel_rule(impl, m, x, "in"))
    assert kernels and not any("border_taps_kernel" in k for k in kernels), kernels


@pytest.mark.parametrize("dtype", LOWP)
@pytest.mark.parametrize(
    "B,C,H,W,stride",
    [
        (32, 256, 28, 28, 2),  # a ResNet shortcut's shape (batch cut)
        (1, 64, 8, 9, 2),  # batch 1, odd width (the width needs no tiling: its own run)
        (5, 40, 12, 12, (2, 1)),  # rows only
        (7, 24, 9, 10, (3, 2)),  # stride 3 rows, 9 = 3 * 3
        (3, 1001, 4, 4, 2),  # channels off the 16-byte grid: the realigned read
        (2, 3, 6, 6, 2),  # fewer channels than a vector
    ],
)
def test_strided_pointwise_conv_reads_only_its_taps(ext, impl, dtype, B, C, H, W, stride):
    """A 1 x 1 convolution without padding at stride > 1 on a channels_last input whose tap
    rows tile the map (H = Ho * sh) reads only the positions under its tap, in one launch of
    the rows kernel with its gradient (a quarter of the input at stride 2, where phase 1 read
    all of it): against the float64 rule, for the direct op, ``layer_stats`` and the
    forward's read (``input_stats``), a second call equal bit for bit, and no copy of the
    input made."""
    m = nn.Conv2d(C, 8, 1, stride=stride, bias=False).to(DEV)
    x = randn((B, C, H, W), dtype=dtype, layout="channels_last")
    g = randn(tuple(m(x.float()).shape), dtype=dtype, layout="channels_last")
    want = torch_rule(impl, m, x, "in")[0]
    h, _ = kernel_rule(impl, m, x, "in")
    close(h, want, STAT_RTOL)
    assert torch.equal(h, kernel_rule(impl, m, x, "in")[0])
    fused = rule_for(m).fused_stats(m, x.shape, g.shape)
    assert fused.input_op[0] == 1  # (a convolution's op: the extension reads it as rows)
    hf, sf = fused.run(ext, x, g, False)
    close(hf, want, STAT_RTOL)
    close(sf, torch_rule(impl, m, g, "out")[0], STAT_RTOL)
    sink = ext.TapSink()  # the forward's read (TapPlan.tap_read: input_stats), with the gradient's later
    out = torch.ones(g.shape, dtype=g.dtype, device=DEV, requires_grad=True) * 1.0
    fused.tap_plan(ext, sink).tap_read(x, out)
    out.backward(g)
    ((h_read, _, _, _),) = sink.take()
    close(h_read, want, STAT_RTOL)
    kernels = device_kernels(lambda: fused.run(ext, x, g, False))
    # (one launch for both reads where both are 16-byte reads on the grid; channels off it
    # are read another way, each in a launch of its own)
    on_grid = C % (16 // x.element_size()) == 0
    assert len(kernels) == (1 if on_grid else 2) and all("channel_rows_kernel" in k for k in kernels), kernels
    if x.numel() * x.element_size() >= 1 << 20:  # (small inputs fit in blocks the allocator already has)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fused.run(ext, x, g, False)
        torch.cuda.synchronize()
        assert torch.cuda.max_memory_allocated() - before < x.numel() * x.element_size() // 8  # no copy of the taps


@pytest.mark.parametrize(
    "B,C,H,W,stride,layout",
    [
        (4, 32, 7, 7, 2, "channels_last"),  # 7 != 4 * 2: the batch and the tap rows do not merge
        (4, 32, 8, 8, 2, "contiguous"),  # channels not innermost
        (4, 32, 8, 8, 2, "channels_last_batch_sliced"),  # every other sample: the batch's stride merges nothing
    ],
)
def test_strided_pointwise_conv_elsewhere_takes_the_window_sums(ext, impl, B, C, H, W, stride, layout):
    """Where the taps are not two runs of rows, the statistics are phase 1's and the window
    sums' (or the fold's) as before: the float64 rule, and no rows kernel."""
    m = nn.Conv2d(C, 8, 1, stride=stride, bias=False).to(DEV)
    if layout == "channels_last_batch_sliced":
        x = randn((2 * B, C, H, W), dtype=torch.bfloat16, layout="channels_last")[::2]
    else:
        x = randn((B, C, H, W), dtype=torch.bfloat16, layout=layout)
    close(kernel_rule(impl, m, x, "in")[0], torch_rule(impl, m, x, "in")[0], STAT_RTOL)
    ho, wo = conv_output_hw(m, (H, W))
    kernels = device_kernels(lambda: ext.conv_input_stats(x, [1, 1], [stride, stride], [0, 0], [1, 1], 1, [ho, wo]))
    assert kernels and not any("channel_rows_kernel" in k for k in kernels), kernels


def test_channel_stats_reads_a_strided_view_as_rows_without_a_copy(ext):
    """A channels-innermost view whose dims before and after the channel dim do not each
    merge (every other row and column of a channels_last map) is read as two other runs of
    rows (``rows_runs``), not copied: the float64 sums, and no allocation of its size."""
    x = randn((16, 96, 20, 14), torch.bfloat16, "channels_last")
    v = x[:, :, ::2, ::2]
    want = v.double().square().sum((0, 2, 3))
    close(ext.channel_stats(v, 1, True, 0.0, False), want, STAT_RTOL)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    got = ext.channel_stats(v, 1, True, 0.0, False)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before < v.numel() * v.element_size() // 2
    close(got, want, STAT_RTOL)
    t = randn((6, 10, 12, 64), torch.bfloat16)[:, ::3, 1::2]  # (6, 4, 6, 64): channels last, rows in two runs
    close(ext.channel_stats(t, -1, True, 0.0, False), t.double().square().sum((0, 1, 2)), STAT_RTOL)


def test_conv_unbatched_input_and_other_padding_modes_fall_back(ext, impl):
    m = nn.Conv2d(3, 4, 3, padding=1).to(DEV)
    x = randn((3, 8, 8))  # unbatched
    close(kernel_rule(impl, m, x, "in")[0], torch_rule(impl, m, x, "in")[0], STAT_RTOL)
    r = nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect").to(DEV)
    x = randn((2, 3, 8, 8))
    close(kernel_rule(impl, r, x, "in")[0], torch_rule(impl, r, x, "in")[0], STAT_RTOL)


def test_conv_input_stats_direct_op(ext):
    """The op itself, geometry passed explicitly (padding top/left; bottom/right implied)."""
    m = nn.Conv2d(6, 3, (3, 4), stride=(2, 1), padding=(2, 1), dilation=(1, 2)).to(DEV)
    x = randn((4, 6, 9, 10))
    Ho, Wo = conv_output_hw(m, (9, 10))
    left, _, top, _ = conv_padding(m)
    h = ext.conv_input_stats(x, list(m.kernel_size), list(m.stride), [top, left], list(m.dilation), 1, [Ho, Wo])
    patches = spec.conv2d_patches(copy.deepcopy(m).double(), x.double())  # (rows, K [+1])
    K = 6 * 3 * 4
    close(h, patches[:, :K].square().sum(0), STAT_RTOL)


# --------------------------------------------------------------------------- per-channel stats


@pytest.mark.parametrize("dtype", LOWP)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "sliced", "transposed"])
@pytest.mark.parametrize("shape", [(4, 13, 7, 5), (1, 8, 3, 3), (260, 6, 4, 4), (2, 64, 1, 1), (3, 1, 5, 6)])
def test_conv_and_batchnorm_output_stats(ext, impl, dtype, layout, shape):
    s = randn(shape, dtype=dtype, layout=layout)
    conv = nn.Conv2d(3, shape[1], 1).to(DEV)
    bn = nn.BatchNorm2d(shape[1]).to(DEV)
    for m in (conv, bn):
        got, n = kernel_rule(impl, m, s, "out")
        want, n_ref = torch_rule(impl, m, s, "out")
        assert n == n_ref and got.dtype == torch.float32
        close(got, want, STAT_RTOL)


@pytest.mark.parametrize("dtype", LOWP)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "sliced", "transposed"])
@pytest.mark.parametrize("shape", [(4, 13, 7, 5), (1, 8, 3, 3), (260, 6, 4, 4), (5, 7, 1, 9)])
def test_batchnorm_input_stats(ext, impl, dtype, layout, shape):
    x = randn(shape, dtype=dtype, layout=layout)
    bn = nn.BatchNorm2d(shape[1]).to(DEV)
    got, n = kernel_rule(impl, bn, x, "in")
    want, n_ref = torch_rule(impl, bn, x, "in")
    assert n == n_ref
    close(got, want, STAT_RTOL)


@pytest.mark.parametrize("dtype", LOWP)
@pytest.mark.parametrize("shape", [(5, 13), (1, 7), (1000, 33), (3, 4, 21), (2, 3, 5, 8), (17,)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_stats(ext, impl, dtype, shape, bias):
    m = nn.Linear(shape[-1], 6, bias=bias).to(DEV)
    x = randn(shape, dtype=dtype)
    s = randn((*shape[:-1], 6), dtype=dtype)
    for side, t in (("in", x), ("out", s)):
        got, n = kernel_rule(impl, m, t, side)
        want, n_ref = torch_rule(impl, m, t, side)
        assert n == n_ref
        close(got, want, STAT_RTOL)
    xt = randn((shape[-1], 9), dtype=dtype).t()  # non-contiguous 2-D input
    close(kernel_rule(impl, m, xt, "in")[0], torch_rule(impl, m, xt, "in")[0], STAT_RTOL)


@pytest.mark.parametrize("dtype", LOWP)
@pytest.mark.parametrize("shape", [(6, 10), (4, 7, 10), (1, 3, 10), (2, 5, 3, 10)])
def test_layernorm_stats(ext, impl, dtype, shape):
    m = nn.LayerNorm(10).to(DEV)
    x = randn(shape, dtype=dtype)
    s = randn(shape, dtype=dtype)
    for side, t in (("in", x), ("out", s)):
        got, n = kernel_rule(impl, m, t, side)
        want, n_ref = torch_rule(impl, m, t, side)
        assert n == n_ref
        close(got, want, STAT_RTOL)


@pytest.mark.parametrize("dtype", LOWP)
@pytest.mark.parametrize("rows", [1, 37, 3000])
@pytest.mark.parametrize("channels", [37, 497, 1001])
def test_channel_stats_of_rows_off_the_16_byte_grid(ext, dtype, rows, channels):
    """Rows off the 16-byte grid: an odd channel count (an LM head's logits over an odd
    vocabulary) or a view that starts mid-row, every row at a different offset from the
    grid.  Wide fp16/bf16 rows are read as 16-byte loads realigned across lanes, in tiles
    of 31 vectors (497 channels: two whole tiles and one channel over; 1001: a last tile
    part full); fp32 rows and narrow ones (37) one element a lane.  Fewer rows than one
    pass, a tail, and a split over the rows (the last block summing the partials) all
    equal the float64 sums."""
    t = randn((rows, channels), dtype=dtype)
    close(ext.channel_stats(t, 1, True, 0.0), t.double().square().sum(0), STAT_RTOL)
    close(ext.channel_stats(t, -1, False, 7.0), t.double().sum(0) / 7.0, STAT_RTOL)
    t3 = randn((2, rows, channels), dtype=dtype)
    close(ext.channel_stats(t3, 2, True, 0.0), t3.double().square().sum((0, 1)), STAT_RTOL)
    view = randn((rows, channels + 6), dtype=dtype)[:, 3 : 3 + channels]
    close(ext.channel_stats(view, 1, True, 0.0), view.double().square().sum(0), STAT_RTOL)
    close(ext.channel_stats(view, 1, False, 0.0), view.double().sum(0), STAT_RTOL)


@pytest.mark.parametrize("dtype", LOWP)
@pytest.mark.parametrize("batch,positions,channels", [(3, 5, 8), (7, 49, 2048), (16, 196, 256), (5, 331, 64), (4, 27, 37)])
def test_flat_and_strided_rows_sum_alike_bit_for_bit(ext, dtype, batch, positions, channels):
    """A flat tensor's rows (every row at one stride) are read by a pointer stepping by a
    constant, whole groups of loads and then the rest one at a time; rows whose batch items
    lie apart (a view of a padded tensor) are found row by row, in groups padded with
    zeros.  The same rows, the same order: the same float32 sums bit for bit, over one
    tile and several, rows fewer than a group and a tail, 16-byte and one-element reads
    (37 channels), both equal to the float64 sums."""
    # (batch, channels, positions) with the channels innermost, as a channels_last map's
    # (N, C, H*W): the padded one's batch stride is (positions + 3) * channels
    flat = randn((batch, positions, channels), dtype=dtype).permute(0, 2, 1)
    padded = torch.empty((batch, positions + 3, channels), device=DEV, dtype=dtype).normal_()
    strided = padded[:, :positions].permute(0, 2, 1)
    strided.copy_(flat)
    assert strided.stride(0) != positions * channels and strided.stride(1) == 1
    for square in (True, False):
        want = flat.double().square().sum((0, 2)) if square else flat.double().sum((0, 2))
        got_flat = ext.channel_stats(flat, 1, square, 0.0)
        got_strided = ext.channel_stats(strided, 1, square, 0.0)
        close(got_flat, want, STAT_RTOL)
        assert torch.equal(got_flat, got_strided)


def test_channel_stats_direct_op_and_divisor(ext):
    t = randn((6, 5, 4))
    close(ext.channel_stats(t, 1, True, 0.0), t.double().square().sum((0, 2)), STAT_RTOL)
    close(ext.channel_stats(t, -1, False, 3.0), t.double().sum((0, 1)) / 3.0, STAT_RTOL)
    close(ext.channel_stats(t, 0, False, 0.0), t.double().sum((1, 2)), STAT_RTOL)
    assert ext.channel_stats(t[:, :0], 1, True, 0.0).shape == (0,)
    assert torch.equal(ext.channel_stats(t[:0], 1, True, 0.0).cpu(), torch.zeros(5))


def test_capture_ops_raise_clear_errors(ext):
    t = randn((3, 4))
    with pytest.raises(RuntimeError, match="dim"):
        ext.channel_stats(t, 5, True, 0.0)
    with pytest.raises(RuntimeError, match="CUDA"):
        ext.channel_stats(t.cpu(), 0, True, 0.0)
    with pytest.raises(RuntimeError, match="float64|Double"):
        ext.channel_stats(t.double(), 0, True, 0.0)
    with pytest.raises(RuntimeError, match="4-D"):
        ext.conv_input_stats(t, [1, 1], [1, 1], [0, 0], [1, 1], 1, [3, 4])
    with pytest.raises(RuntimeError, match="groups"):
        ext.conv_input_stats(randn((2, 3, 4, 4)), [1, 1], [1, 1], [0, 0], [1, 1], 2, [4, 4])
    v = torch.rand(4, device=DEV)
    with pytest.raises(RuntimeError, match=r"H\[0\]"):
        ext.factor_update_([v], [v], [v], [v], [0], [1], [1.0], [1.0], [1.0], [1.0], 0.08, 0.008)
    with pytest.raises(RuntimeError, match="one entry per layer"):
        ext.factor_update_([v], [v, v], [v], [v], [0], [0], [1.0], [1.0], [1.0], [1.0], 0.08, 0.008)


# --------------------------------------------------------------------------- factor update

LAYERS = {
    "lin_bias": lambda: nn.Linear(7, 5),
    "lin": lambda: nn.Linear(9, 3, bias=False),
    "conv_bias": lambda: nn.Conv2d(4, 6, 3, groups=2),
    "conv": lambda: nn.Conv2d(3, 5, 1, bias=False),
    "bn": lambda: nn.BatchNorm2d(6),
    "ln": lambda: nn.LayerNorm(11),
}


def make_captures(names, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    caps = []
    for i, name in enumerate(names):
        kind = name.split("#")[0]
        module = LAYERS[kind]().to(DEV)
        rule = rule_for(module)
        nh = {"lin_bias": 7, "lin": 9, "conv_bias": 2 * 9, "conv": 3, "bn": 6, "ln": 11}[kind]
        ns = {"lin_bias": 5, "lin": 3, "conv_bias": 6, "conv": 5, "bn": 6, "ln": 11}[kind]
        cap = LayerCapture(name, module, rule, lambda: True)
        h = torch.rand(nh, generator=gen).add_(0.1)
        s = torch.rand(ns, generator=gen).add_(0.1)
        if kind in ("bn", "ln"):
            s = s - 0.5  # plain sums can be negative
        cap.pending = PendingStats(h.to(DEV), float(3 + i), s.to(DEV), float(5 + 2 * i), calls=1)
        caps.append(cap)
    return caps


def run_both(impl, caps, gamma=0.8, grad_scale=None):
    torch_caps = [copy.copy(c) for c in caps]
    for tc, c in zip(torch_caps, caps):
        tc.pending = PendingStats(c.pending.h.clone(), c.pending.hn, c.pending.s.clone(), c.pending.sn, c.pending.calls)
        tc.H = None if c.H is None else c.H.clone()
        tc.S = None if c.S is None else c.S.clone()
    impl("torch")
    rep_t = update_factors(torch_caps, gamma, grad_scale)
    impl("kernels")
    rep_k = update_factors(caps, gamma, grad_scale)
    return rep_t, rep_k, torch_caps


def assert_same_factors(caps, torch_caps):
    for c, t in zip(caps, torch_caps):
        assert (c.H is None) == (t.H is None), c.name
        if c.H is None:
            continue
        close(c.H, t.H, FACTOR_RTOL)
        close(c.S, t.S, FACTOR_RTOL)


ALL = ["lin_bias", "lin", "conv_bias", "conv", "bn", "ln"]


@pytest.mark.parametrize("grad_scale", [None, 1.0, 1024.0])
def test_factor_update_matches_the_torch_path_first_and_later_captures(ext, impl, grad_scale):
    caps = make_captures(ALL)
    rep_t, rep_k, torch_caps = run_both(impl, caps, grad_scale=grad_scale)
    assert list(rep_k.updated) == list(rep_t.updated) == ALL and list(rep_k.non_finite) == []
    assert_same_factors(caps, torch_caps)
    for step in range(3):  # later captures fold into the stored factors
        fresh = make_captures(ALL, seed=step + 1)
        for c, f in zip(caps, fresh):
            c.pending = f.pending
        stored = [(c.H, c.S) for c in caps]
        rep_t, rep_k, torch_caps = run_both(impl, caps, gamma=0.8, grad_scale=grad_scale)
        assert all(c.H is h and c.S is s for c, (h, s) in zip(caps, stored))  # updated in place
        assert_same_factors(caps, torch_caps)


def test_factor_update_nan_keeps_previous_factors_and_inf_maps_like_torch(ext, impl):
    caps = make_captures(ALL)
    run_both(impl, caps)
    before = {c.name: (c.H.clone(), c.S.clone()) for c in caps}
    fresh = make_captures(ALL, seed=7)
    for c, f in zip(caps, fresh):
        c.pending = f.pending
    caps[0].pending.h[2] = float("nan")  # NaN in H_raw
    caps[4].pending.s[1] = float("nan")  # NaN in S_raw of a two-column layer
    caps[1].pending.s[0] = float("inf")  # +inf -> 1
    caps[2].pending.h[3] = float("inf")
    caps[5].pending.s[2] = float("-inf")  # (-inf)^2 = inf for the two-column S
    caps[3].pending.h[0] = -float("inf")  # -inf -> 0
    rep_t, rep_k, torch_caps = run_both(impl, caps)
    assert list(rep_k.non_finite) == list(rep_t.non_finite) == ["lin_bias", "bn"]
    assert list(rep_k.updated) == list(rep_t.updated) == ["lin", "conv_bias", "conv", "ln"]
    for i in (0, 4):
        assert torch.equal(caps[i].H, before[caps[i].name][0]) and torch.equal(caps[i].S, before[caps[i].name][1])
    assert_same_factors(caps, torch_caps)


def test_factor_update_nan_at_the_first_capture_leaves_no_factors(ext, impl):
    caps = make_captures(["conv", "lin"])
    caps[0].pending.s[0] = float("nan")
    rep_t, rep_k, torch_caps = run_both(impl, caps)
    assert caps[0].H is None and caps[0].S is None and torch_caps[0].H is None
    assert list(rep_k.non_finite) == ["conv"] and list(rep_k.updated) == ["lin"]
    assert_same_factors(caps, torch_caps)


def test_factor_update_many_layers_several_launches(ext, impl):
    names = [f"{ALL[i % len(ALL)]}#{i}" for i in range(ext.FACTOR_MAX_LAYERS_PER_LAUNCH * 2 + 3)]
    caps = make_captures(names)
    caps[60].pending.h[0] = float("nan")
    rep_t, rep_k, torch_caps = run_both(impl, caps)
    assert list(rep_k.non_finite) == list(rep_t.non_finite) == [names[60]]
    assert list(rep_k.updated) == list(rep_t.updated)
    assert_same_factors(caps, torch_caps)


def test_factor_update_launch_splitting_is_bitwise_invisible(ext):
    """The op over many layers (several launches) equals one call per layer bit for bit,
    with every layer's NaN flag at its own index, also around the launch boundaries."""
    per_launch = ext.FACTOR_MAX_LAYERS_PER_LAUNCH
    L = per_launch * 2 + 3
    nan_at = {0, per_launch - 1, per_launch, 2 * per_launch, L - 1}
    gen = torch.Generator(device="cpu").manual_seed(5)
    layers = []
    for i in range(L):
        kind = 1 if i % 5 == 4 else 0
        flags = (1 if kind == 0 and i % 3 == 0 else 0) | (2 if i % 7 == 0 else 0) | (4 if i % 2 == 0 else 0)
        nh, ns = (int(torch.randint(1, 40, (1,), generator=gen)) for _ in range(2))
        h = torch.rand(nh, generator=gen).add_(0.1)
        s = torch.randn(ns, generator=gen)
        if i in nan_at:
            (h if i % 2 else s)[nh // 2 if i % 2 else ns // 2] = float("nan")
        n_H = 2 if kind == 1 else nh + (flags & 1)
        H, S = torch.rand(n_H, generator=gen).add_(0.5), torch.rand(ns, generator=gen).add_(0.5)
        scalars = (float(i % 9 + 1), float(i % 4 + 2), 1024.0 if flags & 4 else 1.0, 0.5 + i % 3)
        layers.append(([t.to(DEV) for t in (h, s, H, S)], kind, flags, scalars))

    def run(group):
        hs, ss, Hs, Ss = ([lay[0][j] for lay in group] for j in range(4))
        columns = list(zip(*(lay[3] for lay in group)))
        return ext.factor_update_(hs, ss, Hs, Ss, [lay[1] for lay in group], [lay[2] for lay in group],
                                  *(list(c) for c in columns), 0.8, 0.2)

    initial = [[t.clone() for t in lay[0]] for lay in layers]
    together = [([t.clone() for t in lay[0]],) + lay[1:] for lay in layers]
    flags_together = run(together)
    flags_apart = torch.cat([run([lay]) for lay in layers])
    assert flags_together.tolist() == flags_apart.tolist()
    assert {i for i, f in enumerate(flags_together.tolist()) if f} == nan_at
    for i, (a, b, first) in enumerate(zip(together, layers, initial)):
        assert torch.equal(a[0][2], b[0][2]) and torch.equal(a[0][3], b[0][3]), f"layer {i}"
        # NaN layers keep their factors; the others were updated
        assert torch.equal(a[0][2], first[2]) == (i in nan_at), f"layer {i}"
        assert torch.equal(a[0][3], first[3]) == (i in nan_at), f"layer {i}"


def test_factor_update_shape_change_reinitialises(ext, impl):
    caps = make_captures(["lin_bias"])
    caps[0].H = torch.full((3,), 0.5, device=DEV)  # stale factors of another shape
    caps[0].S = torch.full((2,), 0.5, device=DEV)
    rep_t, rep_k, torch_caps = run_both(impl, caps)
    assert caps[0].H.shape == (8,)
    assert_same_factors(caps, torch_caps)


def test_factor_update_is_bitwise_for_linear_layers(ext, impl):
    """Same fp32 operations in the same order: expected bit for bit (documents the claim)."""
    caps = make_captures(["lin_bias", "lin", "conv"])
    rep_t, rep_k, torch_caps = run_both(impl, caps)
    for c, t in zip(caps, torch_caps):
        assert torch.equal(c.H, t.H) and torch.equal(c.S, t.S), c.name


def test_factor_update_of_vectors_over_several_blocks_is_bitwise(ext, impl):
    """Vectors longer than one block's share (an LM head's S: 50257 entries) are folded by
    several blocks, each finding the whole vectors' min and max first: the same bits as
    the torch path across the blocks' boundaries, first and later captures, and a NaN
    far along S (in another block's share) still keeps the layer's factors."""
    gen = torch.Generator(device="cpu").manual_seed(3)
    modules = {"long_S": nn.Linear(3, 10001).to(DEV), "long_H": nn.Linear(9000, 2).to(DEV)}
    caps = [LayerCapture(name, m, rule_for(m), lambda: True) for name, m in modules.items()]
    for capture in range(3):
        for c, m in zip(caps, modules.values()):
            h = torch.rand(m.in_features, generator=gen).add_(0.1)
            s = torch.rand(m.out_features, generator=gen).add_(0.1)
            c.pending = PendingStats(h.to(DEV), 3.0 + capture, s.to(DEV), 5.0, calls=1)
        before = None if caps[0].H is None else (caps[0].H.clone(), caps[0].S.clone())
        if capture == 2:
            caps[0].pending.s[9000] = float("nan")
        rep_t, rep_k, torch_caps = run_both(impl, caps)
        assert list(rep_k.non_finite) == list(rep_t.non_finite) == (["long_S"] if capture == 2 else [])
        for c, t in zip(caps, torch_caps):
            assert torch.equal(c.H, t.H) and torch.equal(c.S, t.S), c.name
        if capture == 2:
            assert torch.equal(caps[0].H, before[0]) and torch.equal(caps[0].S, before[1])


# --------------------------------------------------------------------------- one call per layer

#: name -> (module factory, input shape, layout of the input and the output gradient)
FUSED_LAYERS = {
    "conv3x3_channels_last": (lambda: nn.Conv2d(16, 8, 3, padding=1), (4, 16, 12, 10), "channels_last"),
    # big enough that both reads of the one launch split the batch (counters, partials, maps)
    "conv3x3_channels_last_wide": (lambda: nn.Conv2d(64, 32, 3, padding=1), (48, 64, 14, 14), "channels_last"),
    "conv3x3_wide": (lambda: nn.Conv2d(32, 32, 3, padding=1), (32, 32, 16, 16), "contiguous"),
    "conv_strided_dilated_grouped": (lambda: nn.Conv2d(12, 8, 3, stride=2, padding=2, dilation=2, groups=4),
                                     (3, 12, 11, 9), "contiguous"),
    "conv1d": (lambda: nn.Conv1d(6, 4, 3, stride=2, padding=1), (3, 6, 17), "contiguous"),
    "linear_tokens": (lambda: nn.Linear(24, 40), (2, 7, 24), "contiguous"),
    "batchnorm_channels_last": (lambda: nn.BatchNorm2d(16), (4, 16, 9, 7), "channels_last"),
    "layernorm": (lambda: nn.LayerNorm(48), (3, 5, 48), "contiguous"),
}


def layer_and_tensors(make, shape, x_dtype, g_dtype, layout):
    """A seeded layer on the GPU, a random input and a random output gradient of its output's shape."""
    torch.manual_seed(0)
    module = make().to(DEV)
    x = randn(shape, x_dtype, layout)
    with torch.no_grad():
        out_shape = module(x.float()).shape
    return module, x, randn(out_shape, g_dtype, layout)


@pytest.mark.parametrize("side", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(FUSED_LAYERS))
def test_layer_stats_equals_the_two_partials(ext, impl, name, dtype, side):
    """The hooks' one call per layer (``FusedStats.run``) against the float64 torch rules,
    on the current stream and on the side stream (joined before reading)."""
    from lightning_cafin.capture import streams

    make, shape, layout = FUSED_LAYERS[name]
    module, x, grad = layer_and_tensors(make, shape, dtype, dtype, layout)
    fused = rule_for(module).fused_stats(module, x.shape, grad.shape)
    assert fused is not None
    h, s = fused.run(ext, x, grad, side)
    if side:
        streams.join()
        torch.cuda.current_stream().synchronize()
        streams.release()
    h_want, hn = torch_rule(impl, module, x, "in")
    s_want, sn = torch_rule(impl, module, grad, "out")
    assert (fused.hn, fused.sn) == (hn, sn)
    close(h, h_want, STAT_RTOL)
    close(s, s_want, STAT_RTOL)


@pytest.mark.parametrize("name", ["conv3x3_channels_last", "linear_tokens"])
def test_layer_stats_results_are_vectors_of_their_own(ext, impl, name):
    """``h`` and ``s`` share one allocation, made without a dispatched op: each is a
    contiguous float32 vector of its own length that needs no gradient, a write to one
    leaves the other as it was, and both keep their values once the call's workspace is
    freed and its memory taken again."""
    make, shape, layout = FUSED_LAYERS[name]
    module, x, grad = layer_and_tensors(make, shape, torch.float32, torch.float32, layout)
    fused = rule_for(module).fused_stats(module, x.shape, grad.shape)
    h, s = fused.run(ext, x, grad, False)
    h_want, _ = torch_rule(impl, module, x, "in")
    s_want, _ = torch_rule(impl, module, grad, "out")
    assert h.shape == h_want.shape and s.shape == s_want.shape
    assert h.is_contiguous() and s.is_contiguous() and h.dtype == s.dtype == torch.float32
    assert not h.requires_grad and not s.requires_grad
    assert h.untyped_storage().data_ptr() == s.untyped_storage().data_ptr()
    h.fill_(float("nan"))
    taken = [torch.full((1 << 16,), 7.0, device=DEV) for _ in range(8)]  # the freed workspace, reused
    close(s, s_want, STAT_RTOL)
    assert h.isnan().all() and len(taken) == 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["conv3x3_channels_last", "conv3x3_channels_last_wide", "conv3x3_wide"])
def test_a_convolutions_statistics_take_one_launch_or_two(ext, name, dtype):
    """channels_last 3 x 3 at stride 1 and padding 1: its border sums and its gradient's read
    in one launch (``border_taps_kernel``); channels_last where phase 2 folds: its input's
    two phases and its gradient's per-channel read in one launch
    (``sumsq_windows_and_rows_kernel``); otherwise phase 1
    and the gradient's read share one launch (``sumsq_and_rows_kernel``, NCHW
    ``sumsq_and_middle_kernel``), then phase 2 (the window sums).  A launch is host time in a capture step's backward, and a
    latency-bound phase 2 of its own was device time; the sums are
    ``test_layer_stats_equals_the_two_partials``'."""
    make, shape, layout = FUSED_LAYERS[name]
    module, x, grad = layer_and_tensors(make, shape, dtype, dtype, layout)
    fused = rule_for(module).fused_stats(module, x.shape, grad.shape)
    kernels = device_kernels(lambda: fused.run(ext, x, grad, False))
    # (a 3 x 3 at stride 1 and padding 1 on channels_last channels of whole 16-byte vectors:
    # the border sums, capture_launch.h's BorderTaps; else the fold's rule, capture_stats.cu's
    # window_fold_side: a block of 512 threads reading 16 bytes each, whose partial window
    # sums are at most half its map values)
    taps = module.kernel_size[0] * module.kernel_size[1]
    border = (layout == "channels_last" and module.kernel_size == (3, 3) and module.padding == (1, 1)
              and module.in_channels % (16 // x.element_size()) == 0
              and (module.stride == (1, 1) or (module.stride == (2, 2) and x.shape[2] % 2 == 0 == x.shape[3] % 2)))
    folds = layout == "channels_last" and 2 * module.in_channels * taps <= 512 * (16 // x.element_size())
    if border:
        assert len(kernels) == 1 and "border_taps_kernel" in kernels[0], kernels
    elif folds:
        assert len(kernels) == 1 and "sumsq_windows_and_rows_kernel" in kernels[0], kernels
    else:
        paired = "sumsq_and_rows_kernel" if layout == "channels_last" else "sumsq_and_middle_kernel"
        assert len(kernels) == 2, kernels
        assert paired in kernels[0] and "window_sums" in kernels[1], kernels


def test_layer_stats_dispatches_no_op_of_its_own(ext):
    """The results come from the caching allocator and as parts of one buffer without a
    dispatched op (``aten::empty``, ``aten::narrow``: four a layer of host time in a capture
    step's backward, which a host-bound step pays in full)."""
    make, shape, layout = FUSED_LAYERS["conv3x3_channels_last"]
    module, x, grad = layer_and_tensors(make, shape, torch.bfloat16, torch.bfloat16, layout)
    fused = rule_for(module).fused_stats(module, x.shape, grad.shape)
    fused.run(ext, x, grad, False)  # (the counter pool made)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fused.run(ext, x, grad, False)
    names = {e.name for e in prof.events()}
    assert "lightning_cafin::layer_stats" in names, names
    assert not names & {"aten::empty", "aten::narrow", "aten::slice", "aten::as_strided"}, names


#: layers whose two reductions the rows kernel reads (module, input shape, input dtype,
#: gradient dtype, layout): in one launch where dtype and read mode agree (16-byte loads on
#: the grid, or realigned for 2-byte rows off it), else one launch each; with and without
#: splits.  A pointwise convolution's input statistics are per-channel sums too.
PAIRED_LAYERS = {
    "bf16_aligned_small": (lambda: nn.Linear(768, 2304), (64, 768), torch.bfloat16, torch.bfloat16, "contiguous"),
    "bf16_aligned_split": (lambda: nn.Linear(768, 768), (8192, 768), torch.bfloat16, torch.bfloat16, "contiguous"),
    "bf16_both_shifted": (lambda: nn.Linear(1001, 777), (512, 1001), torch.bfloat16, torch.bfloat16, "contiguous"),
    "bf16_reads_apart": (lambda: nn.Linear(64, 1001), (512, 64), torch.bfloat16, torch.bfloat16, "contiguous"),
    "fp16_narrow_in_wide_out": (lambda: nn.Linear(8, 3000), (4096, 8), torch.float16, torch.float16, "contiguous"),
    "fp32": (lambda: nn.Linear(96, 40), (1000, 96), torch.float32, torch.float32, "contiguous"),
    "dtypes_apart": (lambda: nn.Linear(64, 128), (300, 64), torch.float32, torch.bfloat16, "contiguous"),
    "pointwise_conv_channels_last": (lambda: nn.Conv2d(256, 64, 1), (8, 256, 14, 14), torch.bfloat16, torch.bfloat16,
                                     "channels_last"),
    # (a 4 MB input beside a 134 MB gradient: the input's share of one wave is a few splits)
    "bf16_input_small_beside_its_gradient": (lambda: nn.Linear(64, 4096), (16384, 64), torch.bfloat16, torch.bfloat16,
                                             "contiguous"),
}
#: the PAIRED_LAYERS whose two reads take a launch each: 64 bf16 channels read as 16-byte
#: vectors beside 1001 realigned ones (capture_stats.cu, channel_rows_shape), two dtypes
PAIRED_APART = {"bf16_reads_apart", "dtypes_apart"}


@pytest.mark.parametrize("name", sorted(PAIRED_LAYERS))
def test_a_layers_two_channel_reductions_match_the_separate_ops(ext, impl, name):
    """``layer_stats`` of a linear layer or a pointwise convolution reads the input and the
    output gradient in one launch of the rows kernel where it can, their splits planned
    together (capture_stats.cu, share_one_wave): the float64 rules, the two ``channel_stats``
    launches to fp32 rounding (where one launch reads both, its splits differ from theirs;
    where it cannot, the two launches are theirs, bit for bit), and a second call bit for bit."""
    module, x, g = layer_and_tensors(*PAIRED_LAYERS[name])
    fused = rule_for(module).fused_stats(module, x.shape, g.shape)
    assert fused is not None and fused.input_op[0] == 0  # a per-channel input reduction
    h, s = fused.run(ext, x, g, False)
    _, dim, square = fused.input_op
    h_alone = ext.channel_stats(x, dim, bool(square), fused.input_div, False)
    s_alone = ext.channel_stats(g, fused.grad_dim, fused.grad_square, fused.grad_div, False)
    close(h, torch_rule(impl, module, x, "in")[0], STAT_RTOL)
    close(s, torch_rule(impl, module, g, "out")[0], STAT_RTOL)
    again = fused.run(ext, x, g, False)
    assert torch.equal(h, again[0]) and torch.equal(s, again[1])
    kernels = device_kernels(lambda: fused.run(ext, x, g, False))
    assert len(kernels) == (2 if name in PAIRED_APART else 1), kernels
    if name in PAIRED_APART:
        assert torch.equal(h, h_alone) and torch.equal(s, s_alone)
    else:
        close(h, h_alone, FACTOR_RTOL)
        close(s, s_alone, FACTOR_RTOL)


def test_layer_stats_when_the_gradient_grows_the_counter_pool(ext, impl):
    """The gradient's op needs more counter slots than the stream's pool holds, so planning
    it grows the pool: the input's op, planned first, must still count in live slots."""
    torch.manual_seed(0)
    lin = nn.Linear(96, 20000).to(DEV)
    x, g = randn((2048, 96)), randn((2048, 20000), torch.bfloat16)
    fused = rule_for(lin).fused_stats(lin, x.shape, g.shape)
    stream = torch.cuda.Stream()  # a stream whose pool may still be small
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        h, s = fused.run(ext, x, g, False)
    torch.cuda.current_stream().wait_stream(stream)
    close(h, torch_rule(impl, lin, x, "in")[0], STAT_RTOL)
    close(s, torch_rule(impl, lin, g, "out")[0], STAT_RTOL)


def test_layer_stats_captured_into_a_cuda_graph(ext, impl):
    """Captured into a CUDA graph, a stream's counter pool cannot grow (its zero fill would
    run only at replay): here a linear layer's two reductions each fit the pool made before
    the capture, but not both at once, so ``layer_stats`` launches them one each.  Every
    replay sums the inputs as they are then: the float64 rules, twice, with new values."""
    torch.manual_seed(0)
    lin = nn.Linear(2500, 2500).to(DEV)
    x, g = randn((8192, 2500), torch.bfloat16), randn((8192, 2500), torch.bfloat16)
    fused = rule_for(lin).fused_stats(lin, x.shape, g.shape)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # the stream's pool, made at its smallest (4096 slots)
        ext.channel_stats(randn((8192, 64)), -1, True, 0.0, False)
    stream.synchronize()
    replays_equal_the_rules(ext, impl, fused, lin, x, g, stream)


def replays_equal_the_rules(ext, impl, fused, module, x, grad, stream) -> None:
    """``fused.run`` captured into a CUDA graph on ``stream``: two replays, each on new
    values written into ``x`` and ``grad``, equal the float64 rules."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        h, s = fused.run(ext, x, grad, False)
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        close(h, torch_rule(impl, module, x, "in")[0], STAT_RTOL)
        close(s, torch_rule(impl, module, grad, "out")[0], STAT_RTOL)
        x.copy_(torch.randn_like(x))
        grad.copy_(torch.randn_like(grad))


@pytest.mark.parametrize("name", ["conv3x3_channels_last_wide", "conv3x3_wide"])
def test_a_convolutions_shared_launch_replays_in_a_cuda_graph(ext, impl, name):
    """A convolution's statistics (phase 1 with the gradient's read in one launch, then phase
    2) captured into a CUDA graph: every replay sums the tensors as they are then (the
    float64 rules, twice, with new values), the counter slots reset by each launch's last
    blocks between replays."""
    make, shape, layout = FUSED_LAYERS[name]
    module, x, grad = layer_and_tensors(make, shape, torch.bfloat16, torch.bfloat16, layout)
    fused = rule_for(module).fused_stats(module, x.shape, grad.shape)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # (the stream's counter pool made before the capture)
        fused.run(ext, x, grad, False)
    stream.synchronize()
    replays_equal_the_rules(ext, impl, fused, module, x, grad, stream)


def test_layer_stats_on_an_empty_batch_gives_zeros(ext):
    op = (1, 3, 3, 1, 1, 1, 1, 1, 1, 1, 5, 5)
    h, s = ext.layer_stats(randn((0, 4, 5, 5)), randn((0, 6, 5, 5)), op, 0.0, 1, True, 0.0)
    assert h.shape == (36,) and s.shape == (6,) and not h.any() and not s.any()
    h, s = ext.layer_stats(randn((0, 7)), randn((0, 3)), (0, -1, 1), 0.0, -1, True, 0.0)
    assert h.shape == (7,) and s.shape == (3,) and not h.any() and not s.any()


def test_layer_stats_raises_clear_errors(ext):
    t = randn((3, 4))
    with pytest.raises(RuntimeError, match="input_op"):
        ext.layer_stats(t, t, [2, 0, 0], 0.0, -1, True, 0.0)
    with pytest.raises(RuntimeError, match="input_op"):
        ext.layer_stats(t, t, [1, 3, 3], 0.0, -1, True, 0.0)
    with pytest.raises(RuntimeError, match="CUDA"):
        ext.layer_stats(t, t.cpu(), [0, -1, 1], 0.0, -1, True, 0.0)
    with pytest.raises(RuntimeError, match="dim"):
        ext.layer_stats(t, t, [0, 7, 1], 0.0, -1, True, 0.0)


@pytest.mark.parametrize("means_shape", [(64,), (1000,), (16, 512, 1), (3, 7, 1), (2, 5, 9, 3), (0, 4, 1)])
@pytest.mark.parametrize("means_dtype", LOWP)
@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.bfloat16])
def test_norm_stats_equals_its_reference(ext, means_shape, means_dtype, bias_dtype):
    """A norm tap's one launch (h from the saved means, s the bias gradient copied) against
    the ATen reference on the same values: h to 1e-6 (fp32 sums in another order), s exact,
    both in one buffer and s not the bias gradient itself."""
    means = randn(means_shape, means_dtype)
    n_bias = means_shape[0] if len(means_shape) == 1 else 257
    bias_grad = randn((n_bias,), bias_dtype)
    h, s = ext.norm_stats(means, bias_grad, 1 / 24)
    want_h, want_s = ext.norm_stats(means.cpu(), bias_grad.cpu(), 1 / 24)
    assert h.is_cuda and h.dtype == s.dtype == torch.float32
    close(h, want_h, 1e-6)  # (an empty batch: exact zeros)
    assert torch.equal(s.cpu(), want_s)
    assert h.untyped_storage().data_ptr() == s.untyped_storage().data_ptr()  # one allocation
    bias_grad.zero_()
    assert torch.equal(s.cpu(), want_s)  # a copy


def test_norm_stats_raises_clear_errors(ext):
    with pytest.raises(RuntimeError, match="norm_stats: means must be 1-D"):
        ext.norm_stats(randn((4, 3)), randn((3,)), 1.0)
    with pytest.raises(RuntimeError, match="norm_stats: bias_grad"):
        ext.norm_stats(randn((4,)), randn((4,)).cpu(), 1.0)


# --------------------------------------------------------------------------- end to end


def test_first_capture_of_a_real_network_equals_the_torch_path(ext, impl):
    """Hooks on a ResNet (in-place ReLUs, residual adds): the factors of one capture step
    from identical weights and data.  Later captures are not compared: cuDNN's weight
    gradients are not bitwise reproducible, and the optimizer's ~1/Lambda scaling makes
    the two trajectories drift apart, kernels or not."""
    from lightning_cafin import AdaFisher
    from lightning_cafin.models import ResNet18

    torch.manual_seed(0)
    base = ResNet18(10, 3, 8).to(DEV)
    x = torch.randn(6, 3, 16, 16, device=DEV)
    y = torch.randint(0, 10, (6,), device=DEV)
    results = {}
    for name in ("torch", "kernels"):
        impl(name)
        model = copy.deepcopy(base)
        opt = AdaFisher(model, lr=1e-3, TCov=100, backend="foreach")
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        assert opt.health["capture_steps"] == 1 and opt.health["non_finite_statistics"] == 0
        results[name] = {n: (c.H.clone(), c.S.clone()) for n, c in opt.binding.captures.items()}
    assert results["torch"].keys() == results["kernels"].keys() and len(results["torch"]) == 41
    for n in results["torch"]:
        close(results["kernels"][n][0], results["torch"][n][0], 1e-5)
        close(results["kernels"][n][1], results["torch"][n][1], 1e-5)


def _norm_sums_hooks_and_taps(base, make_opt, backwards, norm_type):
    """Every ``norm_type`` layer's pending (calls, h, s) after ``backwards(m)`` on a copy ``m`` of
    ``base``, ``{False: Python hooks, True: C++ taps}``, and each norm's count of taps taken
    from its backward node in the tapped run."""
    from lightning_cafin.capture import taps

    sums, norm_taps = {}, []
    for tapped in (False, True):
        with taps.using(tapped):
            model = copy.deepcopy(base)
            opt = make_opt(model)
            backwards(model)
            norms = {n: c for n, c in opt.binding.captures.items() if isinstance(c.module, norm_type)}
            sums[tapped] = {n: (c.pending.calls, c.pending.h.clone(), c.pending.s.clone()) for n, c in norms.items()}
            if tapped:
                norm_taps = [sum(p.norm_taps for p in c.tap_plans.values()) for c in norms.values()]
    return sums, norm_taps


def _assert_same_norm_sums(sums, layers, calls):
    assert len(sums[True]) == layers
    for n, (count, h, s) in sums[False].items():
        assert sums[True][n][0] == count == calls, n
        close(sums[True][n][1], h, 1e-5)
        close(sums[True][n][2], s, 1e-5)


@pytest.mark.parametrize("precision", ["fp32", "bf16-channels_last"])
def test_batch_norm_taps_give_the_python_hooks_sums(ext, impl, precision):
    """A batch norm's tap takes h from the norm's saved batch mean and s from its bias
    gradient (cuDNN's or the native backward's): the pending sums of two micro-batches are
    those the Python hooks read from the activation and the gradient."""
    from lightning_cafin import AdaFisher
    from lightning_cafin.models import ResNet18

    impl("kernels")
    torch.manual_seed(0)
    base = ResNet18(10, 3, 8).to(DEV)
    data = [(torch.randn(6, 3, 16, 16, device=DEV), torch.randint(0, 10, (6,), device=DEV)) for _ in range(2)]
    if precision != "fp32":
        base = base.to(memory_format=torch.channels_last)
        data = [(x.contiguous(memory_format=torch.channels_last), y) for x, y in data]

    def backwards(model):
        for x, y in data:
            with torch.autocast("cuda", torch.bfloat16, enabled=precision != "fp32"):
                loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()

    sums, norm_taps = _norm_sums_hooks_and_taps(
        base, lambda m: AdaFisher(m, lr=1e-3, TCov=100, backend="fused"), backwards, nn.BatchNorm2d)
    assert norm_taps == [2] * 20
    _assert_same_norm_sums(sums, 20, 2)


@pytest.mark.parametrize("autocast", [False, True])
def test_layer_norm_taps_give_the_python_hooks_sums(ext, impl, autocast):
    """A GPT's layer norms (on (B, T, D), fp32 under bf16 autocast): their taps take h from the
    saved row means and s from the bias gradient; the sums are the Python hooks'."""
    from lightning_cafin import AdaFisherW
    from lightning_cafin.models.gpt import GPT, lm_loss

    impl("kernels")
    torch.manual_seed(0)
    base = GPT(97, 64, 2, 4, 32).to(DEV)
    tokens = torch.randint(0, 97, (4, 33), device=DEV)

    def backwards(model):
        with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
            loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()

    sums, norm_taps = _norm_sums_hooks_and_taps(
        base, lambda m: AdaFisherW(m, lr=1e-3, TCov=100, backend="fused"), backwards, nn.LayerNorm)
    assert norm_taps == [1] * 5
    _assert_same_norm_sums(sums, 5, 1)


@pytest.mark.parametrize("side", [False, True])
@pytest.mark.parametrize("precision", ["fp32", "bf16-channels_last"])
def test_gradient_taps_give_the_python_hooks_factors(ext, impl, precision, side):
    """The C++ gradient taps (``capture/taps.py``) on a ResNet: every layer tapped, and the
    factors after two captures (plans made, then kept) those of the Python hooks, which make the same
    ``layer_stats`` calls (to 1e-6: cuDNN's backward need not be bitwise reproducible), except
    for the batch norms, whose taps take the norm's saved mean and bias gradient instead."""
    from lightning_cafin import AdaFisher
    from lightning_cafin.capture import streams, taps
    from lightning_cafin.models import ResNet18

    impl("kernels")
    torch.manual_seed(0)
    base = ResNet18(10, 3, 8).to(DEV)
    x = torch.randn(6, 3, 16, 16, device=DEV)
    y = torch.randint(0, 10, (6,), device=DEV)
    if precision != "fp32":
        base, x = base.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
    results = {}
    before_taps, before_side = taps.set_enabled(False), streams.set_enabled(side)
    try:
        for tapped in (False, True):
            taps.set_enabled(tapped)
            model = copy.deepcopy(base)
            # lr 0: the second capture sees the first's weights (a step would carry the norms'
            # rounding differences into them, and the second capture's sums past 1e-6)
            opt = AdaFisher(model, lr=0.0, TCov=100, backend="fused")
            for step in (1, 2):  # the first capture makes the tap plans, the second finds them kept
                if step == 2:
                    opt.capture_next_step()
                with torch.autocast("cuda", torch.bfloat16, enabled=precision != "fp32"):
                    loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                caps = opt.binding.captures
                # (under bf16 autocast the stem convolution computes on a cast copy of the float32
                # image: its tap reads its input in the forward, TapPlan.tap_read, and the gradient after)
                assert sum(c.sink is not None and len(c.sink) == 1 for c in caps.values()) == (41 if tapped else 0)
                # every batch norm's tap took its saved mean and bias gradient (cuDNN's backward node included)
                norms = [c for c in caps.values() if isinstance(c.module, nn.BatchNorm2d)]
                assert len(norms) == 20
                assert [sum(p.norm_taps for p in c.tap_plans.values()) for c in norms] == [step * int(tapped)] * 20
                opt.step()
                assert opt.health["capture_steps"] == step and opt.health["non_finite_statistics"] == 0
            results[tapped] = {n: (c.H.clone(), c.S.clone()) for n, c in caps.items()}
    finally:
        taps.set_enabled(before_taps)
        streams.set_enabled(before_side)
    assert results[False].keys() == results[True].keys() and len(results[True]) == 41
    for n in results[False]:
        close(results[True][n][0], results[False][n][0], FACTOR_RTOL)
        close(results[True][n][1], results[False][n][1], FACTOR_RTOL)


@pytest.mark.parametrize("side", [False, True])
def test_a_linear_on_an_autocast_copy_reads_the_copy_with_its_gradient(ext, side):
    """A GPT block's Linear after its float32 LayerNorm, under bf16 autocast: ``tap_read``
    finds the bf16 copy autograd saved for the weight's gradient (``cast_taps``), reads
    nothing in the forward, and in the backward sums the copy and the gradient (one paired
    launch, on either stream) to the float64 sums of the copy's values; a second backward
    through the retained graph adds nothing."""
    from lightning_cafin.capture import streams

    torch.manual_seed(0)
    norm, linear = nn.LayerNorm(768).to(DEV), nn.Linear(768, 2304).to(DEV)
    z = norm(torch.randn(4, 129, 768, device=DEV))
    with torch.autocast("cuda", torch.bfloat16):
        out = linear(z)
    sink = ext.TapSink()
    plan = ext.TapPlan(sink, [0, -1, 1], 0.0, -1, True, 0.0, 516.0, 516.0)
    want_h = z.detach().to(torch.bfloat16).double().square().sum((0, 1))
    plan.tap_read(z, out, side)
    assert plan.cast_taps == 1
    grad = torch.randn_like(out)
    out.backward(grad, retain_graph=True)
    out.backward(grad)
    if side:
        streams.join()
        torch.cuda.current_stream().synchronize()
        streams.release()
    ((h, hn, s, sn),) = sink.take()
    assert (hn, sn) == (516.0, 516.0)
    close(h, want_h, STAT_RTOL)
    close(s, grad.double().square().sum((0, 1)), STAT_RTOL)


def captures_with_and_without_taps(base, forward, after_backward):
    """Two capture steps (AdaFisherW, fused, TCov=1) on a copy of ``base`` under bf16 autocast,
    with the Python hooks, then with the C++ taps: ``forward(model)`` gives the output, whose
    squares' mean is the loss; ``after_backward(tapped, step, model, captures)`` checks the
    pending statistics.  Each run's factors: ``{tapped: {layer: (H, S)}}``."""
    from lightning_cafin import AdaFisherW
    from lightning_cafin.capture import taps

    results = {}
    before = taps.set_enabled(False)
    try:
        for tapped in (False, True):
            taps.set_enabled(tapped)
            model = copy.deepcopy(base)
            opt = AdaFisherW(model, lr=1e-3, TCov=1, backend="fused")
            for step in range(2):
                opt.zero_grad()
                with torch.autocast("cuda", torch.bfloat16):
                    out = forward(model)
                out.float().square().mean().backward()
                after_backward(tapped, step, model, opt.binding.captures)
                opt.step()
            results[tapped] = {n: (c.H.clone(), c.S.clone()) for n, c in opt.binding.captures.items()}
    finally:
        taps.set_enabled(before)
    return results


def assert_same_factors_both_ways(results, layers):
    assert len(results[True]) == layers
    for n in results[False]:
        close(results[True][n][0], results[False][n][0], FACTOR_RTOL)
        close(results[True][n][1], results[False][n][1], FACTOR_RTOL)


def test_linear_layers_on_an_autocast_copy_take_it_on_both_paths(ext, impl):
    """A GPT block's Linear after a float32 LayerNorm computes, under bf16 autocast, on a
    bf16 copy of its input: the C++ tap (``TapPlan.tap_read``) and the Python hook
    (``autocast_copy``) both read that copy with the gradient in the backward; over two
    captures the factors agree, and the first capture's input sums are the copy's."""
    impl("kernels")
    torch.manual_seed(0)
    base = nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).to(DEV)
    x = torch.randn(4, 32, 64, device=DEV)

    def forward(model):
        out = model(x)
        assert out.dtype == torch.bfloat16
        return out

    def after_backward(tapped, step, model, caps):
        assert sum(c.sink is not None and len(c.sink) == 1 for c in caps.values()) == 3 * tapped
        if tapped:
            assert sum(p.cast_taps for p in caps["1"].tap_plans.values()) == step + 1
        if step == 0:
            with torch.no_grad():
                copy_of_input = model[0](x).to(torch.bfloat16).double()
            close(caps["1"].pending.h, copy_of_input.square().sum((0, 1)), STAT_RTOL)

    assert_same_factors_both_ways(captures_with_and_without_taps(base, forward, after_backward), 3)


def test_a_layer_norm_on_a_bf16_stream_under_autocast_takes_its_saved_means(ext, impl):
    """Under bf16 autocast a LayerNorm given bf16 computes in float32 (bf16 in, float32
    out): the C++ tap takes the norm's saved means and bias gradient (``TapPlan.tap_read``
    finding the norm tap) rather than reading the input in the forward; over two captures
    the factors are the Python hooks' (which read the input), as are the first capture's sums."""
    impl("kernels")
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 32)).to(DEV)
    x = torch.randn(4, 32, 64, device=DEV)
    first = {}

    def forward(model):
        stream = model[0](x)
        assert stream.dtype == torch.bfloat16
        normed = model[1](stream)
        assert normed.dtype == torch.float32
        return model[2](torch.tanh(normed))

    def after_backward(tapped, step, model, caps):
        if tapped:
            assert sum(p.norm_taps for p in caps["1"].tap_plans.values()) == step + 1
        if step == 0:
            first[tapped] = (caps["1"].pending.h.clone(), caps["1"].pending.s.clone())

    results = captures_with_and_without_taps(base, forward, after_backward)
    for got, want in zip(first[True], first[False]):
        close(got, want, STAT_RTOL)
    assert_same_factors_both_ways(results, 3)


@pytest.mark.parametrize("workload", ["resnet-bf16-channels_last", "gpt-bf16"])
def test_kept_launches_give_the_general_paths_factors(ext, impl, workload):
    """Capture steps that repeat the previous one take its kept launch (``factors.KeptLaunch``:
    every sink's one result in one call, the kept slots' arguments): over six captures the
    factors equal those of the general path (the keeper emptied before every step), and the
    launch kept at the second capture served the four after it."""
    from lightning_cafin import AdaFisher, AdaFisherW
    from lightning_cafin.capture import taps
    from lightning_cafin.models import ResNet18
    from lightning_cafin.models.gpt import GPT, lm_loss

    impl("kernels")
    torch.manual_seed(0)
    if workload.startswith("resnet"):
        base = ResNet18(10, 3, 8).to(DEV).to(memory_format=torch.channels_last)
        x = torch.randn(6, 3, 16, 16, device=DEV).contiguous(memory_format=torch.channels_last)
        y = torch.randint(0, 10, (6,), device=DEV)
        make_opt, loss_of = AdaFisher, lambda m: nn.functional.cross_entropy(m(x), y)
    else:
        base = GPT(97, 64, 2, 4, 32).to(DEV)
        tokens = torch.randint(0, 97, (4, 33), device=DEV)
        make_opt, loss_of = AdaFisherW, lambda m: lm_loss(m(tokens[:, :-1]), tokens[:, 1:])
    results, launches = {}, []
    before = taps.set_enabled(True)
    try:
        for kept in (False, True):
            model = copy.deepcopy(base)
            opt = make_opt(model, lr=0.0, TCov=1, backend="fused")  # lr 0: both runs see the same weights
            keeper = opt.binding.launch_keeper
            for _ in range(6):
                if not kept:
                    keeper.launch = None
                opt.zero_grad()
                with torch.autocast("cuda", torch.bfloat16):
                    loss = loss_of(model)
                loss.backward()
                opt.step()
                if kept:
                    launches.append(keeper.launch)
            assert opt.health["capture_steps"] == 6 and opt.health["non_finite_statistics"] == 0
            assert opt.health["modules_not_fired"] == []
            results[kept] = {n: (c.H.clone(), c.S.clone()) for n, c in opt.binding.captures.items()}
    finally:
        taps.set_enabled(before)
    # kept at the second capture (its slots kept for the next), taken by every later one
    assert launches[0] is None and launches[1] is not None
    assert all(launch is launches[1] for launch in launches[2:])
    for n in results[False]:
        close(results[True][n][0], results[False][n][0], FACTOR_RTOL)
        close(results[True][n][1], results[False][n][1], FACTOR_RTOL)
