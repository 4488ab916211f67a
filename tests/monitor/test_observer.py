"""The optimizer's observer surface and the passive OptimizerMonitor on it."""

import pytest
import torch
from torch import nn

from lightning_cafin import AdaFisher
from lightning_cafin.backends import ForeachBackend
from lightning_cafin.monitor.observer import OptimizerMonitor

from lightning_cafin.bench.syncs import counting_syncs


def model_and_opt(TCov=3):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    return model, AdaFisher(model, lr=1e-2, TCov=TCov, backend="foreach")


def step(model, opt):
    opt.zero_grad()
    model(torch.randn(5, 4)).pow(2).mean().backward()
    opt.step()


class Recorder:
    def __init__(self):
        self.calls = []

    def before_update(self, opt, found_inf):
        self.calls.append(("before_update", found_inf))

    def after_update(self, opt, found_inf):
        self.calls.append(("after_update", found_inf))

    def before_capture(self, opt):
        self.calls.append(("before_capture", None))

    def after_capture(self, opt):
        self.calls.append(("after_capture", None))


def test_handle_pairs_and_capture_calls():
    model, opt = model_and_opt(TCov=2)
    rec = Recorder()
    handle = opt.register_step_observer(rec)
    for _ in range(3):
        step(model, opt)
    names = [c[0] for c in rec.calls]
    capture = ["before_capture", "after_capture", "before_update", "after_update"]
    assert names == capture + ["before_update", "after_update"] + capture
    assert all(f is None for _, f in rec.calls)  # no loss scaler here
    handle.remove()
    step(model, opt)
    assert len(rec.calls) == 10


def test_after_update_runs_when_the_update_raises():
    model, opt = model_and_opt()
    rec = Recorder()
    opt.register_step_observer(rec)
    step(model, opt)

    class Broken(ForeachBackend):
        def step(self, *args, **kwargs):
            raise RuntimeError("boom")

    opt.set_backend(Broken())
    with pytest.raises(RuntimeError, match="boom"):
        step(model, opt)
    assert [c[0] for c in rec.calls[-2:]] == ["before_update", "after_update"]


def test_capture_due_changes_nothing_and_capture_next_step_forces_one():
    model, opt = model_and_opt(TCov=3)
    rec = Recorder()
    opt.register_step_observer(rec)
    seen = []
    for _ in range(7):
        due = [opt.capture_due for _ in range(3)]  # asking twice changes nothing
        assert len(set(due)) == 1
        before = len(rec.calls)
        step(model, opt)
        seen.append((due[0], ("before_capture", None) in rec.calls[before:]))
    assert all(d == c for d, c in seen) and [c for _, c in seen] == [True, False, False, True, False, False, True]
    opt.capture_next_step()
    assert opt.capture_due
    before = len(rec.calls)
    step(model, opt)
    assert ("before_capture", None) in rec.calls[before:]


def test_factors_memory_usage_and_health_copy():
    model, opt = model_and_opt()
    assert opt.factors() == {}  # nothing captured yet
    step(model, opt)
    factors = opt.factors()
    assert set(factors) == {"0", "2"} and factors["0"].layer_type == "Linear"
    assert factors["0"].S.shape == (6,) and factors["0"].H.shape == (5,)  # weight columns + bias
    usage = opt.memory_usage()
    momentum = sum(p.numel() * 4 for p in model.parameters())
    assert usage["momentum"] == momentum and usage["factors"] == (6 + 5 + 2 + 7) * 4
    assert usage["total"] == usage["momentum"] + usage["factors"] + usage["cached_fisher"]
    assert usage["cached_fisher"] == momentum  # foreach keeps one F per preconditioned parameter
    health = opt.health
    health["modules_not_fired"].append("x")
    health["capture_steps"] = 99
    assert opt.health["capture_steps"] == 1 and opt.health["modules_not_fired"] == []


def test_monitor_reads_nothing_inside_steps():
    model, opt = model_and_opt(TCov=2)
    monitor = OptimizerMonitor(opt)
    opt.register_step_observer(monitor)
    with counting_syncs() as counter:
        for _ in range(5):
            step(model, opt)
    assert counter.count == 0, counter.where
    with counting_syncs() as counter:
        report = monitor.report()
    assert counter.count > 0  # the reads happen here
    assert report["live", "cafin/step_ms"] > 0 and report["host", "cafin/capture_ms"] >= 0


def test_shadow_step_reports_baseline_and_memory_as_their_difference():
    model, opt = model_and_opt(TCov=100)
    monitor = OptimizerMonitor(opt)
    opt.register_step_observer(monitor)
    step(model, opt)
    monitor.shadow_due = True
    step(model, opt)
    assert not monitor.shadow_due
    r = monitor.report()
    live, base = r["live", "cafin/update_alloc_mb"], r["baseline", "cafin/update_alloc_mb"]
    assert live >= 0 and base > 0 and r[None, "cafin/memory_saved_mb"] == pytest.approx(base - live)
    assert r[None, "cafin/divergence_rel"] < 1e-6 and r["baseline", "cafin/step_ms"] > 0


def _report_in_a_process_group(rank, port, out):
    import os

    import torch.distributed as dist

    from lightning_cafin.bench.collectives import CountCollectives
    from tests.distributed_runs import init_gloo

    init_gloo(rank, 1, port)
    model, opt = model_and_opt(TCov=2)
    monitor = OptimizerMonitor(opt)
    opt.register_step_observer(monitor)
    for _ in range(3):
        step(model, opt)
    with CountCollectives() as counted:
        report = monitor.report()
    torch.save({"ops": counted.ops, "step_ms": report["live", "cafin/step_ms"]}, os.path.join(out, "report.pt"))
    dist.destroy_process_group()


def test_a_report_under_torch_distributed_sends_no_collective(tmp_path):
    """The dashboard reports this process's figures: under NCCL a metric sync of its CPU
    states would fail, and it must add nothing to a data-parallel run's traffic."""
    import torch.multiprocessing as mp

    from tests.distributed_runs import free_port

    mp.spawn(_report_in_a_process_group, args=(free_port(), str(tmp_path)), nprocs=1, join=True)
    result = torch.load(tmp_path / "report.pt", weights_only=True)
    assert result["ops"] == [] and result["step_ms"] > 0
