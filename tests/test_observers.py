"""Step observers: handles, found_inf handed over on the device, pairs that survive errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_cafin import AdaFisher
from lightning_cafin.backends import ForeachBackend
from lightning_cafin.schedule import CaptureSchedule


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def before_update(self, opt, found_inf):
        self.calls.append(("before", found_inf))

    def after_update(self, opt, found_inf):
        self.calls.append(("after", found_inf))


class CaptureRecorder(Recorder):
    def before_capture(self, opt):
        self.calls.append(("before_capture", opt.capture_due))

    def after_capture(self, opt):
        self.calls.append(("after_capture", None))


class DeviceFlag(torch.Tensor):
    """A found_inf that says it lives on a GPU and counts host reads (CPU stand-in)."""

    reads = 0

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    def item(self):  # type: ignore[override]
        DeviceFlag.reads += 1
        return super().item()


class SkipsOnDevice(ForeachBackend):
    """Stand-in for the fused step: takes found_inf without the host reading it."""

    skips_on_device = True
    seen: list = []

    def step(self, batch, hyper, grad_scale=None, found_inf=None, prepared=None):
        SkipsOnDevice.seen.append(found_inf)
        super().step(batch, hyper, grad_scale, None, prepared)


class NoFlags:
    in_flight = 0

    def __init__(self):
        self.recorded = []

    def record(self, flag):
        self.recorded.append(flag)

    def poll(self):
        return 0

    def settle(self):
        return 0


def small():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    return model, lambda: model(torch.randn(6, 3)).pow(2).sum().backward()


def test_register_returns_a_handle_and_aliases_remain():
    model, run = small()
    opt = AdaFisher(model, TCov=100, backend="foreach")
    rec = Recorder()
    handle = opt.register_step_observer(rec)
    run()
    opt.step()
    assert [c[0] for c in rec.calls] == ["before", "after"] and rec.calls[0][1] is None
    handle.remove()
    run()
    opt.step()
    assert len(rec.calls) == 2
    opt.add_step_observer(rec)
    opt.remove_step_observer(rec)
    run()
    opt.step()
    assert len(rec.calls) == 2
    with pytest.raises(TypeError, match="before_update"):
        opt.register_step_observer(object())


def test_after_update_runs_when_the_update_raises():
    class Broken(ForeachBackend):
        def step(self, batch, hyper, grad_scale=None, found_inf=None, prepared=None):
            raise RuntimeError("broken update")

    model, run = small()
    opt = AdaFisher(model, TCov=100, backend="foreach")
    rec = Recorder()
    opt.register_step_observer(rec)
    opt.set_backend(Broken())
    run()
    with pytest.raises(RuntimeError, match="broken update"):
        opt.step()
    assert [c[0] for c in rec.calls] == ["before", "after"]


def test_observers_get_found_inf_on_the_device_and_never_force_a_host_read():
    model, run = small()
    opt = AdaFisher(model, TCov=100)
    opt.set_backend(SkipsOnDevice())
    flags = NoFlags()
    opt.schedule = CaptureSchedule(100, deferred=flags)
    rec = CaptureRecorder()
    opt.register_step_observer(rec)
    flag = torch.zeros(1).as_subclass(DeviceFlag)
    opt.found_inf = flag
    SkipsOnDevice.seen = []
    DeviceFlag.reads = 0
    run()
    opt.step()  # a capture step: the factors must not learn from a skipped step, so it is read once
    assert DeviceFlag.reads == 1
    for _ in range(4):
        opt.zero_grad()
        run()
        opt.step()
    assert DeviceFlag.reads == 1, "an observer made the optimizer read found_inf on the host"
    assert len(flags.recorded) == 4 and all(f is flag for f in flags.recorded)
    assert all(f is flag for f in SkipsOnDevice.seen[1:]) and len(SkipsOnDevice.seen) == 5
    updates = [c for c in rec.calls if c[0] in ("before", "after")]
    assert len(updates) == 10 and all(c[1] is flag for c in updates)
    captures = [c[0] for c in rec.calls if "capture" in c[0]]
    assert captures == ["before_capture", "after_capture"]
    assert rec.calls[0] == ("before_capture", True)
