"""The callback on a GPU: the fused step under 16-mixed with a loss scaler that skips a step."""

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_cafin import CAFINCallback

from .test_callback import Module, loader, read_runs

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


class Overflowing(Module):
    def configure_optimizers(self):
        from lightning_cafin import AdaFisher

        return AdaFisher(self.parameters(), lr=1e-3, TCov=3)  # backend auto: the callback decides

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        return loss * 1e30 if batch_idx == 4 else loss  # float16 gradients overflow: the scaler skips


def test_fused_step_under_16_mixed_skips_overflow_and_matches_the_oracle(tmp_path):
    from lightning.pytorch.loggers import TensorBoardLogger

    t = Trainer(
        default_root_dir=tmp_path, logger=TensorBoardLogger(tmp_path, name="tb"), accelerator="gpu", devices=1,
        precision="16-mixed", max_steps=10, log_every_n_steps=2, enable_checkpointing=False,
        enable_progress_bar=False, callbacks=[CAFINCallback(divergence_every_n_steps=2)],
    )
    t.fit(Overflowing(), loader())
    opt = t.optimizers[0]
    assert opt.backend == "fused"
    assert opt.health["skipped_steps"] >= 1
    for f in opt.factors().values():
        assert torch.isfinite(f.S).all() and torch.isfinite(f.H).all()
    runs, _ = read_runs(tmp_path)
    scalars = runs[""]
    assert max(scalars["cafin/divergence_rel"]) < 1e-5
    assert scalars["cafin/memory_saved_mb"][-1] > 0
    assert scalars["cafin/skipped_steps"][-1] >= 1
    assert min(runs["device"]["cafin/capture_ms"]) >= 0 and min(runs["host"]["cafin/capture_ms"]) >= 0


class OnDevice(Module):
    """Data already on the GPU, so that nothing in the loop copies from the host."""

    def __init__(self, TCov=3):
        super().__init__(TCov=TCov)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        from lightning_cafin import AdaFisher

        return AdaFisher(self.parameters(), lr=1e-3, TCov=self.TCov)


class SyncDebug(Callback):
    """torch.cuda.set_sync_debug_mode('error') from batch start to batch end on steps that
    neither log nor sample the divergence baseline (put first and last in the callback list).
    Under a loss scaler capture steps are left out too: there the optimizer itself reads
    found_inf (the factors must not learn from a skipped step), with or without the callback."""

    def __init__(self, cafin, role):
        self.cafin, self.role = cafin, role
        self.checked = 0

    def _quiet(self, trainer, step):
        logging = (trainer.fit_loop.epoch_loop._batches_that_stepped + 1) % trainer.log_every_n_steps == 0
        return step >= 4 and not logging and not self.cafin.samples_baseline_at(step)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        scaled_capture = trainer.precision == "16-mixed" and trainer.optimizers[0].capture_due
        if self.role == "on" and self._quiet(trainer, trainer.global_step) and not scaled_capture:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            self.checked += 1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.role == "off":
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
def test_callback_adds_no_sync_on_non_logging_steps(tmp_path, precision):
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 1, 8, 8, generator=g).cuda()
    y = (x.mean((1, 2, 3)) > 0).long()
    data = DataLoader(TensorDataset(x, y), batch_size=8)
    cafin = CAFINCallback(divergence_every_n_steps=10)
    on, off = SyncDebug(cafin, "on"), SyncDebug(cafin, "off")
    t = Trainer(
        default_root_dir=tmp_path, logger=TensorBoardLogger(tmp_path, name="tb"), accelerator="gpu", devices=1,
        precision=precision, max_steps=30, log_every_n_steps=5, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[on, cafin, off],
    )
    try:
        t.fit(OnDevice(TCov=3), data)  # capture steps (every 3) are among the checked ones
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert on.checked >= 10
    assert t.optimizers[0].backend == "fused"
