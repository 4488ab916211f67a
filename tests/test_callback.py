"""CAFINCallback in real Trainer runs on the CPU: binding, backends, TensorBoard tags, divergence."""

import glob
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_cafin import AdaFisher, AdaFisherW, CAFINCallback, DivergenceError
from lightning_cafin.backends import ForeachBackend
from lightning_cafin.capture import hook_count
from lightning_cafin.monitor.tags import CHARTS, LAYER_TYPES


class Module(LightningModule):
    def __init__(self, opt="AdaFisher", lr=1e-3, TCov=5, manual=False):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(inplace=True), nn.Flatten(),
            nn.Linear(4 * 8 * 8, 16), nn.LayerNorm(16), nn.Linear(16, 3),
        )
        self.opt_name, self.lr, self.TCov = opt, lr, TCov
        self.automatic_optimization = not manual

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        if self.opt_name == "Adam":
            return torch.optim.Adam(self.parameters(), lr=self.lr)
        cls = AdaFisher if self.opt_name == "AdaFisher" else AdaFisherW
        return cls(self.parameters(), lr=self.lr, TCov=self.TCov, backend="foreach")


def loader(n=96, batch=8):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 1, 8, 8, generator=g)
    y = (x.mean((1, 2, 3)) > 0).long() + (x[:, 0, 0, 0] > 1).long()
    return DataLoader(TensorDataset(x, y), batch_size=batch)


def trainer(tmp_path, callback, **kw):
    kw.setdefault("max_steps", 24)
    return Trainer(
        default_root_dir=tmp_path, logger=TensorBoardLogger(tmp_path, name="tb"), callbacks=[callback],
        accelerator="cpu", devices=1, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, log_every_n_steps=4, **kw,
    )


def read_runs(tmp_path):
    """``{series: {tag: [values]}}`` of every TensorBoard run under ``tmp_path/tb`` ('' is the training run),
    and the training run's accumulator."""
    import os

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = glob.glob(str(tmp_path / "tb" / "**" / "events.out.tfevents.*"), recursive=True)
    assert files, "no TensorBoard event file"
    runs, main = {}, None
    for folder in sorted({os.path.dirname(f) for f in files}):
        acc = EventAccumulator(folder, size_guidance={"scalars": 0, "tensors": 0, "histograms": 0})
        acc.Reload()
        parts = folder.split(os.sep)
        series = parts[-1] if parts[-2] == "cafin" else ""
        runs.setdefault(series, {}).update({t: [e.value for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]})
        if series == "":
            main = acc
    return runs, main


def read_scalars(tmp_path):
    """The training run's scalars and its accumulator."""
    runs, main = read_runs(tmp_path)
    return runs[""], main


def test_trainer_run_logs_every_metric(tmp_path):
    cb = CAFINCallback(backend="foreach", divergence_every_n_steps=8)
    model = Module()
    trainer(tmp_path, cb).fit(model, loader())
    runs, acc = read_runs(tmp_path)
    expected = {
        "live": ("step_ms", "step_ms_max", "update_alloc_mb"), "baseline": ("step_ms", "update_alloc_mb"),
        "host": ("capture_ms",), "": ("divergence_max_abs", "divergence_rel", "memory_saved_mb", "skipped_steps"),
        "all_layers": ("precond/F_min_per_Lambda", "precond/F_max_per_Lambda", "precond/lambda_dominated",
                       "precond/factor_change"),
        "Conv2d": ("precond/F_max_per_Lambda",), "no_layer": ("precond/f_one",), "not_fired": ("precond/f_one",),
    }
    for series, keys in expected.items():
        for key in keys:
            values = runs.get(series, {}).get(f"cafin/{key}")
            assert values, (series, key)
            assert all(math.isfinite(v) for v in values), (series, key)
    assert "device" not in runs  # no CUDA events on a CPU: one capture-cost series, the wall clock
    for chart in CHARTS:  # every tag of the README's table is written, in each of its series
        for series in chart.series or ("",):
            if series not in ("device", LAYER_TYPES):
                assert chart.tag in runs[series], (chart.tag, series)
    live_ms = runs["live"]["cafin/step_ms"]
    assert 0 < min(live_ms) and max(live_ms) < 1000
    main = runs[""]
    assert max(main["cafin/divergence_rel"]) < 1e-6  # foreach against the reference oracle
    # foreach allocates nothing after its first step (its F cache); the oracle materialises F every step
    assert runs["live"]["cafin/update_alloc_mb"][-1] == 0 and runs["baseline"]["cafin/update_alloc_mb"][-1] > 0
    assert main["cafin/memory_saved_mb"][-1] > 0
    assert main["cafin/skipped_steps"][-1] == 0 and runs["not_fired"]["cafin/precond/f_one"][-1] == 0
    assert "cafin/backend/text_summary" in acc.Tags()["tensors"]
    assert "custom_scalars__config__" in acc.Tags()["tensors"]  # the dashboard page
    assert {"cafin/precond/S/net.0", "cafin/precond/H/net.0"} <= set(acc.Tags()["histograms"])
    # teardown removed the hooks
    assert all(hook_count(m) == 0 for m in model.modules())


class Faulty(ForeachBackend):
    def step(self, batch, hyper, grad_scale=None, found_inf=None):
        super().step(batch, hyper, grad_scale, found_inf)
        with torch.no_grad():
            batch.params[0].add_(1e-2)


def test_injected_fault_is_seen_warned_raised_or_fallen_back(tmp_path):
    def faulty_opt(self):
        opt = Module.configure_optimizers(self)
        opt.set_backend(Faulty())
        return opt

    for mode in ("warn", "raise", "fallback"):
        cb = CAFINCallback(backend=None, divergence_every_n_steps=3, on_divergence=mode)
        model = Module()
        t = trainer(tmp_path / mode, cb, max_steps=7)
        model.configure_optimizers = faulty_opt.__get__(model)
        if mode == "raise":
            with pytest.raises(DivergenceError, match="diverged from the reference baseline"):
                t.fit(model, loader())
            continue
        with pytest.warns(UserWarning, match="diverged from the reference baseline"):
            t.fit(model, loader())
        if mode == "fallback":
            assert t.optimizers[0].backend == "reference"
        else:
            scalars, _ = read_scalars(tmp_path / mode)
            assert max(scalars["cafin/divergence_max_abs"]) > 5e-3


def test_hooks_not_duplicated_across_fits_and_lr_find(tmp_path):
    from lightning.pytorch.tuner import Tuner

    cb = CAFINCallback(backend="foreach", divergence_every_n_steps=0)
    model = Module()
    t = trainer(tmp_path, cb, max_steps=6)
    Tuner(t).lr_find(model, train_dataloaders=loader(), num_training=5, min_lr=1e-5, max_lr=1e-3)
    assert all(hook_count(m) == 0 for m in model.modules())  # the search's fit tore down
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*(bound to another live AdaFisher|not bound to a model)")
        for _ in range(2):
            t = trainer(tmp_path, cb, max_steps=6)
            t.fit(model, loader())
    opt = t.optimizers[0]
    assert opt.health["capture_steps"] >= 1 and not opt.is_bound


def test_module_without_adafisher_warns_and_trains(tmp_path):
    model = Module(opt="Adam")
    with pytest.warns(UserWarning, match="returned no AdaFisher"):
        trainer(tmp_path, CAFINCallback(), max_steps=4).fit(model, loader())


@pytest.mark.parametrize("manual", [False, True])
def test_manual_and_automatic_optimization(tmp_path, manual):
    model = Module(manual=manual)
    t = trainer(tmp_path, CAFINCallback(backend="foreach", divergence_every_n_steps=4), max_steps=10)
    t.fit(model, loader())
    assert t.optimizers[0].health["capture_steps"] == 2
    runs, _ = read_runs(tmp_path)
    assert "cafin/step_ms" in runs["live"] and max(runs[""]["cafin/divergence_rel"]) < 1e-6


def test_bad_callback_arguments():
    with pytest.raises(ValueError, match="backend='gpu'"):
        CAFINCallback(backend="gpu")
    with pytest.raises(ValueError, match="on_divergence='ignore'"):
        CAFINCallback(on_divergence="ignore")
    with pytest.raises(ValueError, match="divergence_every_n_steps must be >= 0"):
        CAFINCallback(divergence_every_n_steps=-1)


class TwoOptimizers(Module):
    """A backbone on AdaFisher and a head on AdaFisherW, stepped by hand."""

    def __init__(self):
        super().__init__(manual=True)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        for opt in self.optimizers():
            opt.zero_grad()
        self.manual_backward(loss)
        for opt in self.optimizers():
            opt.step()
        return loss

    def configure_optimizers(self):
        body = [p for n, p in self.named_parameters() if not n.startswith("net.6.")]
        return [AdaFisher(body, TCov=5, backend="foreach"), AdaFisherW(self.net[6].parameters(), TCov=5, backend="foreach")]


def test_several_optimizers_are_bound_and_logged_apart(tmp_path):
    model = TwoOptimizers()
    t = trainer(tmp_path, CAFINCallback(backend="foreach", divergence_every_n_steps=4), max_steps=8)
    t.fit(model, loader())
    a, b = t.optimizers
    # unbound at teardown; the factors each one learnt are kept by layer name
    assert set(a.factors()) == {"net.0", "net.1", "net.4", "net.5"} and set(b.factors()) == {"net.6"}
    assert a.health["capture_steps"] == b.health["capture_steps"] == 1
    runs, _ = read_runs(tmp_path)
    for suffix in ("/opt0", "/opt1"):
        assert f"cafin/step_ms{suffix}" in runs["live"] and f"cafin/divergence_rel{suffix}" in runs[""]


def test_gradient_clipping_where_lightning_allows_it(tmp_path):
    model = Module()
    t = trainer(tmp_path, CAFINCallback(backend="foreach", divergence_every_n_steps=0), max_steps=6,
                gradient_clip_val=1e-3, gradient_clip_algorithm="norm")
    t.fit(model, loader())
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))) <= 1e-3 * 1.01
    assert t.optimizers[0].health["capture_steps"] == 2
