"""AdaFisher in PyTorch Lightning: one callback, TensorBoard dashboard included.

Trains a small CNN on real Fashion-MNIST with ``CAFINCallback`` (binds AdaFisher to
the module's layers, picks the fused CUDA step when a GPU is there, logs its cost
under ``cafin/``), validates on the test split, and says where the logs are.

    python examples/lightning_module.py --max-steps 600
"""

from __future__ import annotations

import argparse

import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader, Subset

from lightning_cafin import AdaFisher, CAFINCallback
from lightning_cafin.data import load_idx_dataset
from lightning_cafin.models import SmallCNN


class FashionCNN(LightningModule):
    def __init__(self, lr: float = 1e-3, weight_decay: float = 5e-4):
        super().__init__()
        self.save_hyperparameters()
        self.net = SmallCNN(num_classes=10, in_channels=1)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val/loss", F.cross_entropy(logits, y))
        self.log("val/accuracy", (logits.argmax(1) == y).float().mean(), prog_bar=True)

    def configure_optimizers(self):
        # What LightningCLI would build too: parameters only; the callback binds the layers.
        return AdaFisher(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-root", default=None)
    ap.add_argument("--max-steps", type=int, default=600)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--val-samples", type=int, default=5000, help="test images used for validation")
    ap.add_argument("--logdir", default="lightning_logs")
    ap.add_argument("--name", default="quickstart")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    seed_everything(args.seed, verbose=False)
    train = load_idx_dataset("fashion-mnist", "train", args.data_root)
    test = load_idx_dataset("fashion-mnist", "test", args.data_root)
    test = Subset(test, range(min(args.val_samples, len(test))))
    logger = TensorBoardLogger(args.logdir, name=args.name)
    trainer = Trainer(
        max_steps=args.max_steps, logger=logger, callbacks=[CAFINCallback(divergence_every_n_steps=200)],
        log_every_n_steps=25, val_check_interval=args.max_steps, check_val_every_n_epoch=None,
        enable_checkpointing=False, enable_model_summary=False, accelerator="auto", devices=1,
    )
    model = FashionCNN()
    trainer.fit(model, DataLoader(train, args.batch_size, shuffle=True, drop_last=True, num_workers=0),
                DataLoader(test, 1000))
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    print(f"validation accuracy {metrics.get('val/accuracy', float('nan')):.4f}")
    print(f"TensorBoard logs: {logger.log_dir}\n  open them with: tensorboard --logdir {args.logdir}"
          "  (the CAFIN page is under 'Custom Scalars')")
    return {"metrics": metrics, "log_dir": logger.log_dir}


if __name__ == "__main__":
    main()
