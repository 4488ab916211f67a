"""``CAFINCallback``: AdaFisher in a Lightning ``Trainer`` in one line.

``Trainer(callbacks=[CAFINCallback()])`` with ``configure_optimizers`` returning
``lightning_cafin.AdaFisher(self.parameters(), ...)``.  The callback

* binds every AdaFisher-family optimizer of the trainer to the LightningModule's layers
  (at ``on_fit_start``: Lightning creates optimizers after ``setup``), replacing any
  binding of an earlier fit or learning-rate search, and unbinds at ``teardown``;
* switches them to the requested backend (``auto``: fused where it can run) and logs
  once which backend runs and why;
* measures through the optimizer's step observers (no patching of Lightning): the
  update's latency on every step without host synchronisation, read on logging steps;
  the extra cost of capture steps; and, every ``divergence_every_n_steps``, a shadow
  baseline update on copies, its latency, the divergence of the live result from it,
  and the temporary memory saved;
* logs all of it under ``cafin/`` to ``trainer.loggers`` with a TensorBoard
  custom-scalars page, aggregated over the logging window (and across ranks) with
  torchmetrics.
"""

from __future__ import annotations

import statistics
import warnings
from collections import deque
from typing import Any, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torchmetrics.aggregation import MaxMetric, MeanMetric

from .backends import BACKEND_NAMES, make_backend
from .monitor.memory import TemporaryMemory
from .monitor.shadow import divergence, replay, take_snapshot
from .monitor.tags import custom_scalars_layout, tag
from .monitor.timing import StepTimer
from .model_offers import offer_model, withdraw_model
from .optimizer import _AdaFisherBase

_ON_DIVERGENCE = ("warn", "raise", "fallback")


class DivergenceError(RuntimeError):
    """The live update left the baseline by more than the configured threshold."""


def _device_of(opt: _AdaFisherBase) -> torch.device:
    for group in opt.param_groups:
        for p in group["params"]:
            return p.device
    return torch.device("cpu")


class _OptimizerMonitor:
    """Observer of one optimizer: times every update, runs the shadow step when asked."""

    def __init__(self, callback: "CAFINCallback", opt: _AdaFisherBase, suffix: str):
        self.cb, self.opt, self.suffix = callback, opt, suffix
        self.device = _device_of(opt)
        self.timer = StepTimer(self.device)
        self.span = StepTimer(self.device)  # batch start -> update start (forward, backward, capture)
        self.span_is_capture: list[bool] = []
        self.normal_spans: deque[float] = deque(maxlen=32)
        self.capture_spans: list[float] = []
        self.shadow_due = False
        self.shadow_results: list[dict[str, float]] = []
        self.step_mean, self.step_max = MeanMetric(), MaxMetric()
        self._snapshot = None
        self._fused_mem: Optional[TemporaryMemory] = None
        self._span_open = False
        self._baseline = None

    # called by the callback
    def batch_start(self) -> None:
        if not self._span_open:
            self.span_is_capture.append(self.opt.capture_due)
            self.span.start()
            self._span_open = True

    # StepObserver protocol
    def before_update(self, opt: _AdaFisherBase, found_inf: Optional[torch.Tensor] = None) -> None:
        if self._span_open:
            self.span.stop()
            self._span_open = False
        if self.shadow_due:
            self._snapshot = take_snapshot(opt)
            self._fused_mem = TemporaryMemory(self.device).__enter__()
        self.timer.start()

    def after_update(self, opt: _AdaFisherBase, found_inf: Optional[torch.Tensor] = None) -> None:
        self.timer.stop()
        if self._snapshot is None:
            return
        self._fused_mem.__exit__(None, None, None)
        if found_inf is not None and found_inf.item() != 0:  # skipped on the device: nothing to compare
            self._snapshot, self._fused_mem = None, None  # (a host read only on the shadow step, which waits anyway)
            return
        if self._baseline is None:
            self._baseline = make_backend(self.cb.baseline_backend)
        base_timer = StepTimer(self.device)
        with TemporaryMemory(self.device) as base_mem:
            base_timer.start()
            replay(opt, self._snapshot, self._baseline)
            base_timer.stop()
        d = divergence(self._snapshot)
        self.shadow_results.append(
            {
                "baseline_step_ms": base_timer.drain()[0],
                "divergence_max_abs": d.max_abs,
                "divergence_rel": d.rel,
                "memory_saved_mb": (base_mem.bytes - self._fused_mem.bytes) / 2**20,
            }
        )
        self._snapshot, self._fused_mem, self.shadow_due = None, None, False
        self.cb._check_divergence(self, d)

    # read on logging steps
    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        times = self.timer.drain()
        for t in times:
            self.step_mean.update(t)
            self.step_max.update(t)
        if self.step_mean.update_count:
            out[tag("step_ms", self.suffix)] = float(self.step_mean.compute())
            out[tag("step_ms_max", self.suffix)] = float(self.step_max.compute())
        self.step_mean.reset()
        self.step_max.reset()
        spans = self.span.drain()
        flags, self.span_is_capture = self.span_is_capture[: len(spans)], self.span_is_capture[len(spans) :]
        for span, is_capture in zip(spans, flags):
            (self.capture_spans if is_capture else self.normal_spans).append(span)
        if self.capture_spans and len(self.normal_spans) >= 3:
            typical = statistics.median(self.normal_spans)
            out[tag("capture_ms", self.suffix)] = statistics.fmean(s - typical for s in self.capture_spans)
            self.capture_spans = []
        if self.shadow_results:
            latest = self.shadow_results[-1]
            out.update({tag(k, self.suffix): v for k, v in latest.items()})
            self.shadow_results = []
        health = self.opt.health
        out[tag("skipped_steps", self.suffix)] = float(health["skipped_steps"])
        out[tag("modules_not_fired", self.suffix)] = float(len(health["modules_not_fired"]))
        out[tag("params_f_one", self.suffix)] = float(health["params_f_one"])
        return out


class CAFINCallback(Callback):
    """Bind AdaFisher to the LightningModule, run it on the fused step, and log what it costs.

    Args:
        backend: ``"auto"`` (fused CUDA where it can run, else foreach), ``"fused"``,
            ``"foreach"``, ``"reference"``, or ``None`` to keep each optimizer's own.
        log_every_n_steps: logging interval in optimizer steps (default: the trainer's).
        divergence_every_n_steps: how often to run the shadow baseline step (0: never).
        baseline_backend: the backend of the shadow step (the oracle by default).
        divergence_threshold: relative divergence above which ``on_divergence`` acts.
        on_divergence: ``"warn"``, ``"raise"`` (a :class:`DivergenceError`) or
            ``"fallback"`` (switch that optimizer to the baseline backend).
    """

    def __init__(
        self,
        backend: Optional[str] = "auto",
        log_every_n_steps: Optional[int] = None,
        divergence_every_n_steps: int = 500,
        baseline_backend: str = "reference",
        divergence_threshold: float = 1e-4,
        on_divergence: str = "warn",
    ) -> None:
        if backend is not None and backend not in BACKEND_NAMES:
            raise ValueError(f"backend={backend!r} is not one of {BACKEND_NAMES} (or None to keep the optimizer's)")
        if baseline_backend not in ("reference", "foreach", "fused"):
            raise ValueError(f"baseline_backend={baseline_backend!r}: use 'reference' (default), 'foreach' or 'fused'")
        if on_divergence not in _ON_DIVERGENCE:
            raise ValueError(f"on_divergence={on_divergence!r} is not one of {_ON_DIVERGENCE}")
        if log_every_n_steps is not None and log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps must be >= 1, got {log_every_n_steps}")
        if divergence_every_n_steps < 0:
            raise ValueError(f"divergence_every_n_steps must be >= 0 (0 disables), got {divergence_every_n_steps}")
        if not divergence_threshold > 0:
            raise ValueError(f"divergence_threshold must be > 0, got {divergence_threshold}")
        self.backend = backend
        self.log_every_n_steps = log_every_n_steps
        self.divergence_every_n_steps = divergence_every_n_steps
        self.baseline_backend = baseline_backend
        self.divergence_threshold = divergence_threshold
        self.on_divergence = on_divergence
        self._monitors: list[_OptimizerMonitor] = []
        self._watched: tuple[int, ...] = ()
        self._layout_written: set[int] = set()

    # ------------------------------------------------------------- lifecycle
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # Optimizers do not exist yet (Lightning creates them after setup); offer the
        # module so that an AdaFisher built where this callback cannot see it (a
        # learning-rate search swaps the trainer's callbacks out) still binds to it.
        offer_model(pl_module)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._attach(trainer, pl_module, warn_if_none=True)

    def _attach(self, trainer: Trainer, pl_module: LightningModule, warn_if_none: bool = False) -> None:
        """(Re)bind to the trainer's current AdaFisher optimizers, releasing earlier ones."""
        self._release()
        optimizers = [o for o in trainer.optimizers if isinstance(o, _AdaFisherBase)]
        self._watched = tuple(id(o) for o in trainer.optimizers)
        if not optimizers:
            if warn_if_none:
                rank_zero_warn(
                    f"CAFINCallback: {type(pl_module).__name__}.configure_optimizers returned no AdaFisher/AdaFisherW "
                    "optimizer; the callback does nothing (return lightning_cafin.AdaFisher(self.parameters()) to use it)"
                )
            return
        for i, opt in enumerate(optimizers):
            opt.bind(pl_module, warn_on_takeover=False)
            if self.backend is not None:
                opt.set_backend(self.backend)
            monitor = _OptimizerMonitor(self, opt, "" if len(optimizers) == 1 else f"/opt{i}")
            opt.add_step_observer(monitor)
            self._monitors.append(monitor)
            rank_zero_info(f"CAFINCallback: {opt.summary()}")
        self._log_backend(trainer)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._release()
        withdraw_model(pl_module)

    def _release(self) -> None:
        for m in self._monitors:
            m.opt.remove_step_observer(m)
            m.opt.unbind()
        self._monitors = []

    # ------------------------------------------------------------- each batch
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if tuple(id(o) for o in trainer.optimizers) != self._watched:
            # the optimizers were replaced after fit start (a learning-rate search does this)
            self._attach(trainer, pl_module)
        every = self.divergence_every_n_steps
        for m in self._monitors:
            m.batch_start()
            if every and trainer.global_step % every == 0:
                m.shadow_due = True

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self._monitors or not self._should_log(trainer):
            return
        metrics: dict[str, float] = {}
        for m in self._monitors:
            metrics.update(m.metrics())
        step = trainer.fit_loop.epoch_loop._batches_that_stepped
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    def _should_log(self, trainer: Trainer) -> bool:
        if self.log_every_n_steps is None:
            return trainer._logger_connector.should_update_logs
        return trainer.global_step % self.log_every_n_steps == 0 and any(m.timer.pending for m in self._monitors)

    # -------------------------------------------------------------- reporting
    def _log_backend(self, trainer: Trainer) -> None:
        names = ", ".join(f"{type(m.opt).__name__}{m.suffix}: {m.opt.backend}" for m in self._monitors)
        rank_zero_info(f"CAFINCallback: backend {names}")
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger) and trainer.is_global_zero:
                writer = logger.experiment
                writer.add_text(tag("backend"), names, global_step=trainer.global_step)
                if id(writer) not in self._layout_written:
                    writer.add_custom_scalars(custom_scalars_layout([m.suffix for m in self._monitors]))
                    self._layout_written.add(id(writer))
            else:
                logger.log_hyperparams({tag("backend"): names})

    def _check_divergence(self, monitor: _OptimizerMonitor, d) -> None:
        if d.rel <= self.divergence_threshold:
            return
        message = (
            f"CAFINCallback: {type(monitor.opt).__name__}{monitor.suffix} ({monitor.opt.backend}) diverged from the "
            f"{self.baseline_backend} baseline: max abs {d.max_abs:.3g}, relative {d.rel:.3g} > "
            f"{self.divergence_threshold:g}"
        )
        if self.on_divergence == "raise":
            raise DivergenceError(message)
        if self.on_divergence == "fallback":
            monitor.opt.set_backend(self.baseline_backend)
            message += f"; switched to the {self.baseline_backend} backend"
        warnings.warn(message, stacklevel=2)
