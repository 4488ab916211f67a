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
* it explains itself: no config points at ``configs/`` and the quick start; a refused
  hyper-parameter is a usage error naming the argument (exit 2) before anything runs; a
  missing dataset names ``--data.init_args.root=...`` and ``download: true``; a run shorter
  than the logging interval is warned about; a run that fails before its first step
  leaves no empty ``version_N`` folder behind.
"""

from __future__ import annotations

import importlib
import re
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch import LightningDataModule, Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_warn
from torch.optim import Optimizer
from typing_extensions import override

from .callback import CAFINCallback
from .data.download import DownloadError
from .data.idx import DataNotFoundError
from .optimizer import _AdaFisherBase
from .tasks import ImageClassifier

DEFAULT_OPTIMIZER = {"class_path": "lightning_cafin.AdaFisher", "init_args": {"lr": 1e-3}}
SUBCOMMANDS = ("fit", "validate", "test", "predict")
#: The shipped configs, beside the package in a checkout (a wheel does not carry them).
CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
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
        kwargs.setdefault("parser_kwargs", {"prog": "cafin"})
        self._new_log_dirs: list[Path] = []
        try:
            super().__init__(*args, **kwargs)
        except BaseException:
            self._discard_log_dirs_of_a_run_that_never_stepped()
            raise

    @override
    def before_instantiate_classes(self) -> None:
        """Refuse bad optimizer hyper-parameters as a usage error, before a logger or trainer exists."""
        config = self.config.get(str(self.subcommand), self.config)
        optimizer = config.get("optimizer")
        optimizer_class = self._optimizer_class()
        if optimizer is None or optimizer_class is None:
            return
        init_args = dict(getattr(optimizer, "init_args", None) or {})
        probe = [torch.nn.Parameter(torch.zeros(1))]
        try:
            optimizer_class(probe, **init_args)
        except (ValueError, TypeError) as exc:
            self.parser.error(_name_the_argument(str(exc), init_args, optimizer_class.__name__))

    def _discard_log_dirs_of_a_run_that_never_stepped(self) -> None:
        trainer = getattr(self, "trainer", None)
        if trainer is not None and trainer.global_step > 0:
            return
        for path in self._new_log_dirs:  # the version folder, then the parents it made, if empty
            if path == self._new_log_dirs[0]:
                shutil.rmtree(path, ignore_errors=True)
            elif path.is_dir() and not any(path.iterdir()):
                path.rmdir()

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # Registered here (LightningCLI would add the same group after this hook) so that it
        # can carry a default; still 'AUTOMATIC', i.e. wired into configure_optimizers.
        parser.add_optimizer_args((Optimizer,))
        parser.set_defaults({"optimizer": DEFAULT_OPTIMIZER})

    def _optimizer_class(self) -> Optional[type]:
        config = self.config.get(str(self.subcommand), self.config)
        optimizer = config.get("optimizer")
        return _imports(getattr(optimizer, "class_path", None) if optimizer is not None else None)

    @override
    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        configured = self._get(self.config_init, "trainer", default={}).get("callbacks") or []
        callbacks = list(configured) if isinstance(configured, (list, tuple)) else [configured]
        optimizer_class = self._optimizer_class()
        wants_callback = optimizer_class is not None and issubclass(optimizer_class, _AdaFisherBase)
        if wants_callback and not any(isinstance(c, CAFINCallback) for c in callbacks):
            callbacks.append(CAFINCallback())
            kwargs["callbacks"] = callbacks
        trainer = super().instantiate_trainer(**kwargs)
        for logger in trainer.loggers:
            # The version folder does not exist yet (loggers create it on first write): remember the
            # ones this run will create, so that a run that fails before its first step removes them.
            if isinstance(logger, TensorBoardLogger) and trainer.is_global_zero:
                log_dir = Path(logger.log_dir).absolute()
                created = [d for d in (log_dir, *log_dir.parents) if not d.exists()]
                self._new_log_dirs += created  # deepest first
        return trainer

    def before_fit(self) -> None:  # (no @override: LightningCLI calls before_<subcommand> by name)
        _warn_if_no_cafin_scalars(self.trainer)

    def _add_configure_optimizers_method_to_model(self, subcommand: Optional[str]) -> None:
        # ImageClassifier's own configure_optimizers is the Python default; replacing it by the
        # config's optimizer is the point here, not something to warn about.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*configure_optimizers` will be overridden")
            super()._add_configure_optimizers_method_to_model(subcommand)


def _name_the_argument(message: str, init_args: dict, class_name: str) -> str:
    """``--optimizer.init_args.<name>=<value>`` for the argument the optimizer's message names."""
    named = [(m.start(), k) for k in init_args for m in [re.search(rf"\b{re.escape(k)}\b", message)] if m]
    if named:
        key = min(named)[1]
        return f"--optimizer.init_args.{key}={init_args[key]!r} is refused by {class_name}: {message}"
    return f"--optimizer.init_args refused by {class_name}: {message}"


def _warn_if_no_cafin_scalars(trainer: Trainer) -> None:
    """A fit shorter than the logging interval writes no ``cafin/`` scalars: say so before it starts."""
    # (attributes Lightning sets in its connectors, which its type hints do not declare)
    fast_dev_run, callbacks = getattr(trainer, "fast_dev_run", False), getattr(trainer, "callbacks", [])
    if not trainer.loggers or fast_dev_run or trainer.max_steps is None or trainer.max_steps < 0:
        return
    for callback in [c for c in callbacks if isinstance(c, CAFINCallback)]:
        every = callback.log_every_n_steps or getattr(trainer, "log_every_n_steps", None) or 50
        if trainer.max_steps < every:
            rank_zero_warn(
                f"cafin: --trainer.max_steps={trainer.max_steps} is below the logging interval "
                f"(log_every_n_steps={every}): no cafin/ scalars will be written. Lower "
                f"--trainer.log_every_n_steps (or the callback's log_every_n_steps) to see them.",
                category=UserWarning,
            )
            return


def _usage_hint() -> str:
    configs = sorted(p.name for p in CONFIG_DIR.glob("*.yaml")) if CONFIG_DIR.is_dir() else []
    where = (f"the shipped configs are in {CONFIG_DIR}: {', '.join(configs)}" if configs
             else "the configs/ folder of the lightning_cafin repository holds the shipped configs")
    return (
        "cafin: a run needs a config. Start with the quick start:\n"
        "  cafin fit --config configs/quickstart.yaml\n"
        f"({where}; the README's 'Quick start' explains what it does; `cafin --help` lists the options)"
    )


def _needs_a_config(argv: list[str]) -> bool:
    if not argv:
        return True
    if argv[0] not in SUBCOMMANDS:
        return False
    given = ("-c", "--config", "--model", "--data", "-h", "--help", "--print_config")
    return not any(a == g or a.startswith(g + "=") for a in argv[1:] for g in given)


def _missing_data_hint(exc: BaseException) -> str:
    return (
        f"cafin: {exc}\n"
        "From the command line: --data.init_args.root=/path/to/the/folder, or let the datamodule fetch "
        "the files with --data.init_args.download=true (in a config: `download: true` under data.init_args)."
    )


def _print_log_location(cli: CafinCLI) -> None:
    trainer = getattr(cli, "trainer", None)
    if trainer is None or not trainer.is_global_zero:
        return
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            print(f"TensorBoard logs: {logger.log_dir}\n  open them with: tensorboard --logdir {logger.save_dir}"
                  "  (the CAFIN page is under 'Custom Scalars')", flush=True)


def main(argv: Optional[list[str]] = None) -> int:
    """Run the CLI; returns the exit status (2 for a usage error or missing data)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if _needs_a_config(args):
        print(_usage_hint(), file=sys.stderr)
        return 2
    try:
        cli = CafinCLI(args=argv)  # None: LightningCLI reads sys.argv itself
    except DataNotFoundError as exc:
        print(_missing_data_hint(exc), file=sys.stderr)
        return 2
    except DownloadError as exc:
        print(f"cafin: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # argparse's usage errors: an exit status, not a traceback
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    _print_log_location(cli)
    return 0


if __name__ == "__main__":
    sys.exit(main())
