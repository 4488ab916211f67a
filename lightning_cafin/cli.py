"""``cafin``: the LightningCLI entry point (``cafin fit|validate|test --config configs/<name>.yaml``).

What it adds to a plain ``LightningCLI``:

* ``optimizer:`` defaults to :class:`lightning_cafin.AdaFisher` (so an ``lr_scheduler:``
  alone is honoured too); ``AdaFisher`` / ``AdaFisherW`` receive only the parameters,
  as every LightningCLI optimizer does, and :class:`~lightning_cafin.CAFINCallback`
  binds them to the model's layers;
* a ``CAFINCallback`` with its defaults is added when the optimizer is an AdaFisher and
  the config has none (an unbound AdaFisher would silently be momentum SGD);
* TensorBoard logging under ``lightning_logs/`` by default, and the log folder printed at
  the end with the command that opens it;
* a missing dataset ends with the message that says where it looked, not a traceback.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from typing import Any, Optional

from lightning.pytorch import LightningDataModule, Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger
from torch.optim import Optimizer

from .callback import CAFINCallback
from .data.download import DownloadError
from .data.idx import DataNotFoundError
from .optimizer import _AdaFisherBase
from .tasks import ImageClassifier

DEFAULT_OPTIMIZER = {"class_path": "lightning_cafin.AdaFisher", "init_args": {"lr": 1e-3}}
DEFAULT_LOGGER = {
    "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
    "init_args": {"save_dir": "lightning_logs", "name": "cafin"},
}


def _imports(class_path: Optional[str]) -> Optional[type]:
    if not class_path:
        return None
    module, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


class CafinCLI(LightningCLI):
    """LightningCLI with AdaFisher, the callback and TensorBoard as the defaults (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("model_class", ImageClassifier)
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("datamodule_class", LightningDataModule)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("trainer_defaults", {"logger": DEFAULT_LOGGER})
        super().__init__(*args, **kwargs)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # Registered here (LightningCLI would add the same group after this hook) so that it
        # can carry a default; still 'AUTOMATIC', i.e. wired into configure_optimizers.
        parser.add_optimizer_args((Optimizer,))
        parser.set_defaults({"optimizer": DEFAULT_OPTIMIZER})

    def _optimizer_class(self) -> Optional[type]:
        config = self.config.get(str(self.subcommand), self.config)
        optimizer = config.get("optimizer")
        return _imports(getattr(optimizer, "class_path", None) if optimizer is not None else None)

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        configured = self._get(self.config_init, "trainer", default={}).get("callbacks") or []
        callbacks = list(configured) if isinstance(configured, (list, tuple)) else [configured]
        optimizer_class = self._optimizer_class()
        wants_callback = optimizer_class is not None and issubclass(optimizer_class, _AdaFisherBase)
        if wants_callback and not any(isinstance(c, CAFINCallback) for c in callbacks):
            callbacks.append(CAFINCallback())
            kwargs["callbacks"] = callbacks
        return super().instantiate_trainer(**kwargs)

    def _add_configure_optimizers_method_to_model(self, subcommand: Optional[str]) -> None:
        # ImageClassifier's own configure_optimizers is the Python default; replacing it by the
        # config's optimizer is the point here, not something to warn about.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*configure_optimizers` will be overridden")
            super()._add_configure_optimizers_method_to_model(subcommand)


def _print_log_location(cli: CafinCLI) -> None:
    trainer = getattr(cli, "trainer", None)
    if trainer is None or not trainer.is_global_zero:
        return
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            print(f"TensorBoard logs: {logger.log_dir}\n  open them with: tensorboard --logdir {logger.save_dir}"
                  "  (the CAFIN page is under 'Custom Scalars')", flush=True)


def main(argv: Optional[list[str]] = None) -> int:
    """Run the CLI; returns the exit status (2 when the data is missing)."""
    try:
        cli = CafinCLI(args=argv)
    except (DataNotFoundError, DownloadError) as exc:
        print(f"cafin: {exc}", file=sys.stderr)
        return 2
    _print_log_location(cli)
    return 0


if __name__ == "__main__":
    sys.exit(main())
