"""The callback costs no host synchronisation on steps that do not log, reports nothing
impossible on a loaded host, records the optimizer as HParams, and its Preconditioner
numbers equal what the optimizer's factors give computed offline."""

import threading
import time

import pytest
import torch
from lightning.pytorch import Callback

from lightning_cafin import CAFINCallback
from lightning_cafin.monitor.tags import ALL_LAYERS

from .monitor.offline import offline_stats
from lightning_cafin.bench.syncs import counting_syncs
from .test_callback import Module, loader, read_runs, trainer


class SyncProbe(Callback):
    """Counts the monitoring code's host reads per step, apart for logging and non-logging steps."""

    def __init__(self, cafin: CAFINCallback):
        self.cafin = cafin
        self.per_step: list[tuple[bool, bool, int]] = []  # (logging step, shadow step, syncs)
        self._ctx = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._ctx = counting_syncs()
        self.counter = self._ctx.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # runs after CAFINCallback's own batch-end hook (callbacks run in list order)
        self._ctx.__exit__(None, None, None)
        logging = trainer._logger_connector.should_update_logs
        shadow = self.cafin.samples_baseline_at(trainer.global_step - 1)  # the step just taken
        self.per_step.append((logging, shadow, self.counter.count))


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_no_host_sync_on_non_logging_steps(tmp_path, precision):
    cb = CAFINCallback(backend="foreach", divergence_every_n_steps=7)
    probe = SyncProbe(cb)
    t = trainer(tmp_path, cb, max_steps=24, precision=precision)
    t.callbacks.append(probe)
    t.fit(Module(TCov=3), loader())
    quiet = [n for logging, shadow, n in probe.per_step if not logging and not shadow]
    assert len(quiet) >= 12 and all(n == 0 for n in quiet), probe.per_step
    # the stand-in does see the reads where they are allowed: logging and shadow steps
    assert any(n > 0 for logging, _, n in probe.per_step if logging)
    assert any(n > 0 for _, shadow, n in probe.per_step if shadow)


def _busy(stop: threading.Event) -> None:
    a = torch.randn(256, 256)
    while not stop.is_set():
        a = (a @ a).tanh()
        time.sleep(0.0005)


def test_loaded_host_shows_no_impossible_value(tmp_path):
    stop = threading.Event()
    threads = [threading.Thread(target=_busy, args=(stop,), daemon=True) for _ in range(2)]
    for th in threads:
        th.start()
    try:
        cb = CAFINCallback(backend="foreach", divergence_every_n_steps=3, log_every_n_steps=2)
        trainer(tmp_path, cb, max_steps=24).fit(Module(TCov=2), loader())
    finally:
        stop.set()
        for th in threads:
            th.join()
    runs, _ = read_runs(tmp_path)
    for series in ("live", "baseline", "host"):
        for tag, values in runs[series].items():
            assert values and min(values) >= 0, (series, tag, values)
    assert len(runs["host"]["cafin/capture_ms"]) >= 6
    live, base = runs["live"]["cafin/update_alloc_mb"], runs["baseline"]["cafin/update_alloc_mb"]
    saved = runs[""]["cafin/memory_saved_mb"]
    assert len(saved) == len(live) == len(base) >= 5
    for s, b, lv in zip(saved, base, live):
        assert s == pytest.approx(b - lv, abs=1e-6)
    for key in ("F_min_per_Lambda", "F_max_per_Lambda"):
        assert min(runs[ALL_LAYERS][f"cafin/precond/{key}"]) >= 1  # F >= Lambda: factors are never negative
    share = runs[ALL_LAYERS]["cafin/precond/lambda_dominated"]
    assert all(0 <= v <= 1 for v in share)


class FactorGrab(Callback):
    def on_train_end(self, trainer, pl_module):
        opt = trainer.optimizers[0]
        self.Lambda = opt.param_groups[0]["Lambda"]
        self.factors = {n: (f.layer_type, f.S.clone(), f.H.clone()) for n, f in opt.factors().items()}


def test_logged_preconditioner_numbers_equal_offline_from_the_factors(tmp_path):
    grab = FactorGrab()
    # captures at 0, 5, ..., 20; logging steps every 4: the last capture (20) is read at step 23
    t = trainer(tmp_path, CAFINCallback(backend="foreach", divergence_every_n_steps=0), max_steps=24)
    t.callbacks.append(grab)
    t.fit(Module(TCov=5), loader())
    runs, _ = read_runs(tmp_path)
    expected = offline_stats(grab.factors, grab.Lambda)
    assert set(expected) == {ALL_LAYERS, "Conv2d", "BatchNorm2d", "Linear", "LayerNorm"}
    for series, stats in expected.items():
        for key in ("F_min_per_Lambda", "F_max_per_Lambda", "lambda_dominated"):
            logged = runs[series][f"cafin/precond/{key}"][-1]
            assert logged == pytest.approx(stats[key], rel=1e-6), (series, key)


class WithHparams(Module):
    def __init__(self, TCov=5):
        super().__init__(TCov=TCov)
        self.save_hyperparameters()


def test_optimizer_settings_are_run_hparams(tmp_path):
    from tensorboard.plugins.hparams import plugin_data_pb2

    trainer(tmp_path, CAFINCallback(backend="foreach", divergence_every_n_steps=0), max_steps=4).fit(
        WithHparams(), loader())
    runs, acc = read_runs(tmp_path)
    data = acc.PluginTagToContent("hparams")
    starts = []
    for content in data.values():
        pd = plugin_data_pb2.HParamsPluginData.FromString(content)
        if pd.HasField("session_start_info"):
            starts.append(pd.session_start_info.hparams)
    last = starts[-1]
    assert last["cafin/optimizer"].string_value == "AdaFisher"
    assert last["cafin/backend"].string_value == "foreach"
    assert last["cafin/TCov"].number_value == 5 and last["cafin/lr"].number_value == pytest.approx(1e-3)
    assert last["cafin/capture_impl"].string_value == "torch"
    for key in ("beta", "gamma", "Lambda", "weight_decay"):
        assert f"cafin/{key}" in last
    assert last["TCov"].number_value == 5  # the model's own hyper-parameters are kept in the same record
