"""``CAFINCallback`` under Lightning's ``ModelParallelStrategy`` (FSDP2) on 2 gloo ranks, and
its clear refusal of ``FSDPStrategy`` (FSDP1).

The ranks are started the way ``torchrun`` starts them (Lightning sees a TorchElastic
environment and launches nothing).  A run of two epochs equals a run of one epoch, saved
as a distributed checkpoint and resumed for the second, and every supported layer is
preconditioned on the sharded model.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_cafin import AdaFisher, CAFINCallback
from tests.distributed_runs import free_port, local_master, spawn_ranks

pytestmark = pytest.mark.slow
WORLD = 2


class Sharded(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Conv2d(1, 5, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(5 * 8 * 8, 7),
                                 nn.LayerNorm(7), nn.Linear(7, 3))

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        fully_shard(self.net[3], mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return AdaFisher(self.parameters(), lr=1e-3, TCov=2, weight_decay=1e-3)

    def on_train_end(self) -> None:
        self.summary = self.trainer.optimizers[0].summary()  # the callback unbinds at teardown


def data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 1, 8, 8, generator=g)
    y = (x.mean((1, 2, 3)) > 0).long() + (x[:, 0, 0, 0] > 1).long()
    return DataLoader(TensorDataset(x, y), batch_size=8)  # 3 steps per epoch on each of 2 ranks


def trainer(root, epochs: int) -> Trainer:
    return Trainer(
        default_root_dir=root, accelerator="cpu", devices=WORLD, max_epochs=epochs,
        strategy=ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1),
        callbacks=[CAFINCallback(backend="foreach", divergence_every_n_steps=0)],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )


def worker(rank: int, port: int, out: str) -> None:
    local_master(port, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD),
                 GROUP_RANK="0", TORCHELASTIC_RUN_ID="cafin")
    whole = Sharded()
    trainer(os.path.join(out, "whole"), 2).fit(whole, data())
    first = Sharded()
    t = trainer(os.path.join(out, "first"), 1)
    t.fit(first, data())
    opt = t.optimizers[0]
    summary, factors = first.summary, {n: (f.S.clone(), f.H.clone()) for n, f in opt.factors().items()}
    ckpt = os.path.join(out, "epoch1.ckpt")
    t.save_checkpoint(ckpt)
    resumed = Sharded()
    trainer(os.path.join(out, "resumed"), 2).fit(resumed, data(), ckpt_path=ckpt)
    torch.save({
        "whole": [p.full_tensor().detach() for p in whole.parameters()],
        "resumed": [p.full_tensor().detach() for p in resumed.parameters()],
        "first": [p.full_tensor().detach() for p in first.parameters()],
        "summary": summary, "factors": factors, "sharded": type(first.net[3].weight).__name__,
    }, os.path.join(out, f"rank{rank}.pt"))


def test_model_parallel_strategy_trains_checkpoints_and_resumes_exactly(tmp_path):
    spawn_ranks(worker, WORLD, (free_port(), str(tmp_path)), [tmp_path / f"rank{r}.pt" for r in range(WORLD)])
    for rank in range(WORLD):
        r = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert r["sharded"] == "DTensor"
        assert sorted(r["factors"]) == ["net.0", "net.3", "net.4", "net.5"], r["summary"]
        assert "8 parameter tensors (2,335 elements) in 4 layers are preconditioned" in r["summary"], r["summary"]
        for a, b, c in zip(r["whole"], r["resumed"], r["first"]):
            assert not torch.equal(b, c)  # the second epoch moved it
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)


class Plain(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 2)

    def configure_optimizers(self):
        return AdaFisher(self.parameters())


def test_fsdp1_strategy_is_refused_naming_what_to_use(tmp_path):
    # a Trainer refuses FSDPStrategy without a GPU, and the callback reads only its strategy
    on_fsdp1 = SimpleNamespace(strategy=FSDPStrategy())
    with pytest.raises(TypeError, match="FSDP1.*ModelParallelStrategy with fully_shard"):
        CAFINCallback().setup(on_fsdp1, Plain(), "fit")  # type: ignore[arg-type]


class WithBatchNorm(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                                 nn.Linear(4 * 8 * 8, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return AdaFisher(self.parameters(), TCov=2)

    def on_train_end(self) -> None:
        # read before the strategy's teardown, which reverts SyncBatchNorm to a plain batch norm
        self.norm_type = type(self.net[1]).__name__
        self.summary = self.trainer.optimizers[0].summary()


def _sync_batchnorm_worker(rank: int, port: int, out: str) -> None:
    local_master(port)
    model = WithBatchNorm()
    Trainer(default_root_dir=out, accelerator="gpu", devices=1, strategy="ddp", sync_batchnorm=True, max_steps=4,
            callbacks=[CAFINCallback(backend="foreach", divergence_every_n_steps=0)], logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(model, data())
    torch.save({"norm": model.norm_type, "summary": model.summary}, os.path.join(out, "sync.pt"))


@pytest.mark.cuda
def test_sync_batchnorm_layers_stay_preconditioned(tmp_path):
    """Lightning's ``sync_batchnorm=True`` swaps BatchNorm for SyncBatchNorm before the
    optimizer exists; the callback binds the swapped layers (DDP allows SyncBatchNorm on GPUs only)."""
    if not torch.cuda.is_available():
        pytest.skip("SyncBatchNorm under DDP needs a GPU")
    mp.spawn(_sync_batchnorm_worker, args=(free_port(), str(tmp_path)), nprocs=1, join=True)
    r = torch.load(tmp_path / "sync.pt", weights_only=True)
    assert r["norm"] == "SyncBatchNorm"
    assert "6 parameter tensors" in r["summary"] and "in 3 layers are preconditioned; 0 tensors" in r["summary"], r["summary"]
