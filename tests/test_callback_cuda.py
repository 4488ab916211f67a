"""The callback on a GPU: the fused step under 16-mixed with a loss scaler that skips a step."""

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Trainer

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
    for f in opt._saved_factors.values():
        assert torch.isfinite(f["S"]).all() and torch.isfinite(f["H"]).all()
    runs, _ = read_runs(tmp_path)
    scalars = runs[""]
    assert max(scalars["cafin/divergence_rel"]) < 1e-5
    assert scalars["cafin/memory_saved_mb"][-1] > 0
    assert scalars["cafin/skipped_steps"][-1] >= 1
    assert min(runs["device"]["cafin/capture_ms"]) >= 0 and min(runs["host"]["cafin/capture_ms"]) >= 0
