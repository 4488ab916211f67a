"""``bench/floor.py``: the bytes a capture step's statistics must read, counted per bound
layer at the dtypes autocast gives, scaled to the batch, and their least device time."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_cafin import AdaFisher
from lightning_cafin.bench.floor import (StatisticsBytes, floor_ms, peak_bandwidth, reads_autocast_copy, reads_nothing,
                                         statistics_bytes, statistics_floor, tap_positions_share)
from lightning_cafin.bench.workloads import Workload

CPU = torch.device("cpu")


def _toy(autocast, norm=None):
    """``norm`` (a LayerNorm(8) by default) -> Linear(8, 16) -> Linear(16, 4) on a batch of 6."""
    return Workload("toy", "a toy", make_model=lambda: nn.Sequential(norm or nn.LayerNorm(8), nn.Linear(8, 16),
                                                                     nn.Linear(16, 4)),
                    make_batch=lambda dev: (torch.randn(6, 3, 8, device=dev), torch.randint(0, 4, (6,), device=dev)),
                    loss_fn=lambda out, y: F.cross_entropy(out.mean(1), y), ada_cls=AdaFisher, lr=1e-3,
                    weight_decay=0.0, autocast=autocast)


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_each_linear_counts_its_input_and_output_gradient_and_the_layer_norm_nothing(autocast):
    read = statistics_bytes(_toy(autocast), CPU, small=2)
    assert read.layers == 2  # the layer norm on (B, T, D) is bound but reads neither tensor
    out = 4 if autocast is None else 2  # a Linear's output (and so its gradient) in the autocast dtype
    # the first Linear reads the layer norm's output as it computed on it (under autocast the
    # bfloat16 copy autograd saved of the float32 output), the second the first's output
    assert read.inputs == 18 * 8 * out + 18 * 16 * out
    assert read.gradients == 18 * 16 * out + 18 * 4 * out
    assert statistics_bytes(_toy(autocast), CPU, small=3, batch=12) == StatisticsBytes(2 * read.inputs,
                                                                                      2 * read.gradients, 2)
    assert statistics_bytes(_toy(autocast), CPU) == read  # the whole batch, counted as it is


def test_a_norm_whose_statistics_need_its_tensors_counts_them():
    frozen = nn.LayerNorm(8)
    frozen.bias.requires_grad_(False)
    for norm in (frozen, nn.GroupNorm(1, 3), nn.LayerNorm(8, bias=False)):
        read = statistics_bytes(_toy(None, norm), CPU)
        assert read.layers == 3 and read.inputs == 18 * 8 * 4 * 2 + 18 * 16 * 4, norm
    x3, x2 = torch.randn(2, 3, 8), torch.randn(2, 8)
    assert reads_nothing(nn.LayerNorm(8), x3) and not reads_nothing(nn.LayerNorm(8), x2)
    bn = nn.BatchNorm1d(8)
    assert reads_nothing(bn, x2) and not reads_nothing(bn.eval(), x2)
    assert not reads_nothing(nn.SyncBatchNorm(8), x2) and not reads_nothing(nn.Linear(8, 8), x2)


def test_a_linear_reads_its_autocast_copy_only_where_autograd_can_have_saved_it():
    linear, half = nn.Linear(8, 4), torch.zeros(2, 4, dtype=torch.bfloat16)
    node = torch.randn(2, 8, requires_grad=True) * 1.0  # an input with a graph node of its own
    assert reads_autocast_copy(linear, node, half)
    assert not reads_autocast_copy(linear, node.detach(), half)  # a leaf (the model's input)
    assert not reads_autocast_copy(linear, node, half.float())  # no cast
    assert not reads_autocast_copy(nn.Conv1d(8, 4, 1), node, half)  # not a Linear
    linear.weight.requires_grad_(False)
    assert not reads_autocast_copy(linear, node, half)  # a frozen weight: nothing saved


def test_a_strided_pointwise_convolution_counts_only_the_positions_under_its_tap():
    """A 1 x 1 convolution without padding at stride 2 needs a quarter of its input (every
    other row and column: what the extension reads of a channels_last input); padding or a
    wider kernel covers the whole input."""
    x = torch.randn(2, 4, 8, 6)
    for conv, share in [(nn.Conv2d(4, 3, 1, stride=2), 4 * 3 / 48), (nn.Conv2d(4, 3, 1), 1.0),
                        (nn.Conv2d(4, 3, 1, stride=(2, 1), padding="valid"), 4 * 6 / 48),
                        (nn.Conv1d(4, 3, 1, stride=3), 2 / 6), (nn.Conv2d(4, 3, 1, stride=2, padding=1), 1.0),
                        (nn.Conv2d(4, 3, 3, stride=2, padding=1), 1.0), (nn.Conv2d(4, 4, 1, stride=2, groups=2), 1.0)]:
        xi = x[:, :, 0] if isinstance(conv, nn.Conv1d) else x
        assert tap_positions_share(conv, xi, conv(xi)) == pytest.approx(share), conv
    assert tap_positions_share(nn.Linear(6, 2), x, nn.Linear(6, 2)(x)) == 1.0
    up = nn.ConvTranspose2d(4, 3, 1, stride=2)  # (a transposed convolution is not read by taps)
    assert tap_positions_share(up, x, up(x)) == 1.0
    model = nn.Sequential(nn.Conv2d(4, 8, 1, stride=2), nn.Flatten(), nn.Linear(8 * 4 * 3, 2))
    wl = Workload("conv", "a strided 1 x 1 convolution", make_model=lambda: model,
                  make_batch=lambda dev: (torch.randn(2, 4, 8, 6, device=dev), torch.zeros(2, dtype=torch.long)),
                  loss_fn=F.cross_entropy, ada_cls=AdaFisher, lr=1e-3, weight_decay=0.0, autocast=None)
    read = statistics_bytes(wl, CPU)
    assert read.layers == 2 and read.inputs == (2 * 4 * 4 * 3 + 2 * 96) * 4  # a quarter of the conv's input


def test_the_floor_is_the_bytes_at_the_bandwidth_and_needs_a_known_bandwidth():
    assert floor_ms(StatisticsBytes(3 * 10**9, 10**9, 5), 4e12) == pytest.approx(1.0)
    assert peak_bandwidth(CPU) is None
    entry = statistics_floor(_toy(None), CPU)
    assert entry["layers"] == 2 and entry["inputs"] > 0 and entry["bandwidth_tbs"] is None and entry["floor_ms"] is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_device_reports_a_plausible_peak_bandwidth():
    tbs = peak_bandwidth(torch.device("cuda")) / 1e12
    assert 0.1 < tbs < 20, tbs  # an H100 SXM gives 3.35, an H200 4.8
    entry = statistics_floor(_toy(torch.bfloat16), torch.device("cuda"))
    assert entry["floor_ms"] == pytest.approx(floor_ms(StatisticsBytes(entry["inputs"], entry["gradients"], 2),
                                                        entry["bandwidth_tbs"] * 1e12))
