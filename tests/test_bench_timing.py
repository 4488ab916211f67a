"""``bench/timing.py``'s device time per call: on a CPU each call's host time, on a GPU the
profiler's device time, refused where the profiler attributes none; and one call kernel by
kernel (op by op on a CPU), under kernel names without their signatures."""

from __future__ import annotations

import pytest
import torch

from lightning_cafin.bench.timing import device_us_per_call, kernel_name, us_per_kernel

CPU = torch.device("cpu")


def test_calls_the_profiler_gives_no_device_time_are_refused_not_reported_as_zero(monkeypatch):
    """On a GPU the figures are the device time the profiler attributes to each call's range;
    where it attributes none (here: CPU work timed as if on a GPU), it says so rather
    than report every call at 0 us (infinitely fast)."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    x = torch.randn(64, 64)
    with pytest.raises(RuntimeError, match="gave the timed calls no device time"):
        device_us_per_call([[lambda: x.sum(), lambda: x.square().sum()]], torch.device("cuda"), 2, 1)


def test_cpu_figures_are_each_calls_host_time_per_call():
    x = torch.randn(256, 256)
    (fast, slow), = device_us_per_call([[lambda: x.sum(), lambda: [x @ x for _ in range(20)]]], CPU, 2, 3)
    assert 0 < fast < slow


def test_a_call_broken_down_counts_each_op_per_call_and_its_time():
    x = torch.randn(256, 256)
    ops = us_per_kernel(lambda: [x @ x for _ in range(3)] + [x.sum()], CPU, 2)
    assert ops["aten::mm"][1] == 3 and ops["aten::sum"][1] == 1
    assert ops["aten::mm"][0] > 0


@pytest.mark.parametrize("name, short", [
    ("void lightning_cafin::(anonymous namespace)::sumsq_and_rows_kernel<c10::BFloat16>(lightning_cafin::SumsqAndRows)",
     "sumsq_and_rows_kernel<BFloat16>"),
    ("void lightning_cafin::(anonymous namespace)::window_sums_hwc_kernel<3>(float const*, int)", "window_sums_hwc_kernel<3>"),
    ("void lightning_cafin::(anonymous namespace)::channel_rows_kernel<c10::BFloat16, (lightning_cafin::RowsRead)0, "
     "512, 4>(lightning_cafin::RowsPair)", "channel_rows_kernel<BFloat16, (RowsRead)0, 512, 4>"),  # (a cast inside)
    ("nvjet_sm90_tst_64x128_64x8_2x1_v_bz_splitK_NTN", "nvjet_sm90_tst_64x128_64x8_2x1_v_bz_splitK_NTN"),
    ("Memset (Device)", "Memset"),
])
def test_kernel_names_lose_their_signature_and_namespaces_but_not_their_template_arguments(name, short):
    assert kernel_name(name) == short


def test_each_round_runs_every_call_untimed_first_and_rotates_the_timed_order():
    """The device's pause between profiled rounds slowed the call timed first (device_us_per_call's
    docstring): each round runs every call untimed before the timed ranges, and the timed order
    rotates, so that no call is always the one timed first."""
    seen: list[str] = []
    row = [lambda name=name: seen.append(name) for name in "abc"]
    device_us_per_call([row], CPU, 1, 3)
    untimed = list("abc")
    assert seen == list("abc") + untimed + list("abc") + untimed + list("bca") + untimed + list("cab")
