"""A Lightning run on N GPUs with ``CAFINCallback`` under DDP or FSDP2, saved and resumed on another N.

    torchrun --nproc-per-node 2 benchmarks/multigpu_lightning.py --strategy ddp --save /tmp/ck --steps 20
    torchrun --nproc-per-node 1 benchmarks/multigpu_lightning.py --strategy ddp --resume /tmp/ck --steps 40

``--strategy fsdp2`` uses Lightning's ``ModelParallelStrategy`` with ``fully_shard`` applied
in ``configure_model`` (its checkpoint is a distributed checkpoint folder, loadable on any
number of ranks).  The model is a small CNN on synthetic 28x28 images (nothing to
download), ``precision="bf16-mixed"`` on a GPU.  Each run prints, on rank 0, the step
reached, the last loss, the optimizer's summary and its capture count, and appends them to
``<out>/lightning-runs.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lightning_cafin import AdaFisher, CAFINCallback  # noqa: E402


class SmallCNN(LightningModule):
    def __init__(self, shard: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shard = shard
        self.net = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
                                 nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.Flatten(),
                                 nn.Linear(32 * 14 * 14, 64), nn.LayerNorm(64), nn.ReLU(), nn.Linear(64, 10))
        self.last_loss = float("nan")

    def configure_model(self) -> None:
        if not self.shard:
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        fully_shard(self.net[8], mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.last_loss = float(loss.detach())
        return loss

    def configure_optimizers(self) -> AdaFisher:
        return AdaFisher(self.parameters(), lr=1e-3, TCov=10, weight_decay=5e-4)

    def on_train_end(self) -> None:
        opt = self.trainer.optimizers[0]
        self.report = {"summary": opt.summary(), "captures": opt.health["capture_steps"],
                       "statistics_bytes": opt.statistics_reduction.last.bytes}


def data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 1, 28, 28, generator=g)
    y = (x[:, 0, :14].mean((1, 2)) * 4).long().clamp(-5, 4) + 5
    return DataLoader(TensorDataset(x, y), batch_size=64, shuffle=False)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strategy", choices=("ddp", "fsdp2"), required=True)
    ap.add_argument("--steps", type=int, default=20, help="train until this global step")
    ap.add_argument("--save", type=Path, help="save a checkpoint here at the end")
    ap.add_argument("--resume", type=Path, help="resume from this checkpoint")
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    devices = torch.cuda.device_count() if cuda else 1
    devices = int(os.environ.get("WORLD_SIZE", devices))
    strategy = (ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1) if args.strategy == "fsdp2"
                else DDPStrategy())
    model = SmallCNN(shard=args.strategy == "fsdp2")
    trainer = Trainer(accelerator="gpu" if cuda else "cpu", devices=devices, strategy=strategy, max_steps=args.steps,
                      precision="bf16-mixed" if cuda else "32-true", callbacks=[CAFINCallback()], logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=str(args.out))
    trainer.fit(model, data(), ckpt_path=str(args.resume) if args.resume else None)
    if args.save:
        trainer.save_checkpoint(args.save)
    if trainer.is_global_zero:
        record = {"strategy": args.strategy, "devices": devices, "step": trainer.global_step, "loss": model.last_loss,
                  "resumed_from": str(args.resume) if args.resume else None, **model.report}
        print(json.dumps(record))
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "lightning-runs.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
