"""``bench/timing.py``'s device time per call: on a CPU each call's host time, on a GPU the
profiler's device time, refused where the profiler attributes none."""

from __future__ import annotations

import pytest
import torch

from lightning_cafin.bench.timing import device_us_per_call

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
