"""Writes the dashboard's samples: series as TensorBoard runs of their own, the rest as usual.

A sample is ``(series, tag) -> value``.  With a ``TensorBoardLogger`` a series goes to a
writer at ``<log_dir>/cafin/<series>``: TensorBoard shows it as its own run, so curves of
one chart get different colours and are named in the run list.  Samples without a series
and every other logger go through ``logger.log_metrics``; there a series is appended to
the tag (``cafin/step_ms/live``), since those loggers have no runs.
"""

from __future__ import annotations

import os
from typing import Any

from lightning.pytorch.loggers import Logger, TensorBoardLogger
from torch import Tensor

from .observer import Samples


class DashboardWriter:
    def __init__(self, loggers: list[Logger], is_global_zero: bool) -> None:
        self.loggers = loggers
        self.is_global_zero = is_global_zero
        self._series_writers: dict[tuple[int, str], Any] = {}

    def _tensorboard(self) -> list[TensorBoardLogger]:
        return [lg for lg in self.loggers if isinstance(lg, TensorBoardLogger)] if self.is_global_zero else []

    def _series_writer(self, logger: TensorBoardLogger, series: str) -> Any:
        key = (id(logger), series)
        writer = self._series_writers.get(key)
        if writer is None:
            writer = type(logger.experiment)(log_dir=os.path.join(logger.log_dir, "cafin", series))
            self._series_writers[key] = writer
        return writer

    def open_series(self, names: list[str]) -> None:
        """Create these series' runs now, in this order: TensorBoard colours runs in the order
        they appear, so the series that share charts (``live``, ``baseline``) get far-apart colours."""
        for logger in self._tensorboard():
            for name in names:
                self._series_writer(logger, name)

    def scalars(self, samples: Samples, step: int) -> None:
        plain = {t: v for (series, t), v in samples.items() if series is None}
        for logger in self.loggers:
            if isinstance(logger, TensorBoardLogger):
                if plain:
                    logger.log_metrics(plain, step=step)
                if not self.is_global_zero:
                    continue
                touched = set()
                for (series, t), v in samples.items():
                    if series is not None:
                        writer = self._series_writer(logger, series)
                        writer.add_scalar(t, v, global_step=step)
                        touched.add(id(writer))
                for writer in self._series_writers.values():
                    if id(writer) in touched:
                        writer.flush()
            else:
                flat = {(t if series is None else f"{t}/{series}"): v for (series, t), v in samples.items()}
                logger.log_metrics(flat, step=step)

    def histograms(self, prefix: str, layers: dict[str, tuple[Tensor, Tensor]], step: int, suffix: str = "") -> None:
        for logger in self._tensorboard():
            for name, (S, H) in layers.items():
                logger.experiment.add_histogram(f"{prefix}/S/{name}{suffix}", S, global_step=step)
                logger.experiment.add_histogram(f"{prefix}/H/{name}{suffix}", H, global_step=step)

    def text(self, tag: str, text: str, step: int) -> None:
        for logger in self.loggers:
            if isinstance(logger, TensorBoardLogger):
                if self.is_global_zero:
                    logger.experiment.add_text(tag, text, global_step=step)
            else:
                logger.log_hyperparams({tag: text})

    def layout(self, layout: dict) -> None:
        for logger in self._tensorboard():
            logger.experiment.add_custom_scalars(layout)

    def hparams(self, params: dict[str, Any]) -> None:
        for logger in self.loggers:
            logger.log_hyperparams(params)

    def close(self) -> None:
        for writer in self._series_writers.values():
            writer.close()
        self._series_writers = {}
