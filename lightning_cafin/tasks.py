"""``ImageClassifier``: the LightningModule the configs train (any ``nn.Module`` as the network).

Cross-entropy training with loss and accuracy logged under ``train/``, ``val/`` and
``test/`` (accuracy through torchmetrics, so it aggregates correctly across batches and
ranks).  Its own ``configure_optimizers`` returns an :class:`~lightning_cafin.AdaFisher`
over its parameters with the paper's defaults, for use from Python; the ``cafin`` CLI
replaces it with the ``optimizer:`` / ``lr_scheduler:`` of the config.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy
from typing_extensions import override

from .optimizer import AdaFisher


def _num_classes(net: nn.Module) -> int:
    """The output width of the last Linear layer: what the accuracy metric needs."""
    last = None
    for module in net.modules():
        if isinstance(module, nn.Linear):
            last = module
    if last is None:
        raise ValueError(
            f"cannot tell the number of classes of {type(net).__name__} (it has no nn.Linear); pass num_classes="
        )
    return last.out_features


class ImageClassifier(LightningModule):
    """Classify images with ``net``.

    Args:
        net: the network, ``(N, C, H, W) -> (N, num_classes)`` logits.
        num_classes: the number of classes (default: the last Linear layer's width).
        label_smoothing: cross-entropy label smoothing.
        channels_last: train in the channels-last memory format (faster convolutions on GPUs).
    """

    def __init__(self, net: nn.Module, num_classes: int | None = None, label_smoothing: float = 0.0,
                 channels_last: bool = False) -> None:
        super().__init__()
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
        self.save_hyperparameters(ignore=["net"])
        self.net = net
        classes = num_classes if num_classes is not None else _num_classes(net)
        self.label_smoothing = label_smoothing
        self.channels_last = channels_last
        self.train_accuracy = MulticlassAccuracy(classes, average="micro")
        self.val_accuracy = MulticlassAccuracy(classes, average="micro")
        self.test_accuracy = MulticlassAccuracy(classes, average="micro")
        if channels_last:
            self.net = self.net.to(memory_format=torch.channels_last)

    @override
    def forward(self, x: Tensor) -> Tensor:
        if self.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return self.net(x)

    def _shared(self, batch: Any, stage: str, metric: MulticlassAccuracy) -> Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y, label_smoothing=self.label_smoothing if stage == "train" else 0.0)
        metric(logits.detach(), y)
        on_step = stage == "train"
        self.log(f"{stage}/loss", loss, prog_bar=True, on_step=on_step, on_epoch=not on_step, batch_size=y.numel())
        self.log(f"{stage}/accuracy", metric, prog_bar=True, on_step=on_step, on_epoch=not on_step,
                 batch_size=y.numel())
        return loss

    @override
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self._shared(batch, "train", self.train_accuracy)

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._shared(batch, "val", self.val_accuracy)

    @override
    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._shared(batch, "test", self.test_accuracy)

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        # Parameters only, as LightningCLI would: CAFINCallback binds the layers at fit start.
        return AdaFisher(self.parameters())
