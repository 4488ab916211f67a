"""``CAFINCallback``: AdaFisher in a Lightning ``Trainer`` in one line.

``Trainer(callbacks=[CAFINCallback()])`` with ``configure_optimizers`` returning
``lightning_cafin.AdaFisher(self.parameters(), ...)``.  The callback

* binds every AdaFisher-family optimizer of the trainer to the LightningModule's layers
  (at ``on_fit_start``: Lightning creates optimizers after ``setup``), replacing any
  binding of an earlier fit or learning-rate search, and unbinds at ``teardown``;
* switches them to the requested backend (``auto``: fused where it can run) and logs
  once which backend runs and why;
* watches each with a passive :class:`~lightning_cafin.monitor.observer.OptimizerMonitor`
  (no host synchronisation on steps that do not log), and on logging steps writes the
  CAFIN and Preconditioner dashboard (``monitor/tags.py`` lists every tag), the
  optimizer's settings as HParams, and histograms of a few layers' factors.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional, Sequence, Union

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from .backends import BACKEND_NAMES
from .binding import FSDP1_REFUSED
from .monitor.hparams import optimizer_hparams
from .monitor.observer import OptimizerMonitor, Samples
from .monitor.shadow import Divergence
from .monitor.tags import TEXT_TAG, custom_scalars_layout
from .monitor.writer import DashboardWriter
from .model_offers import offer_model, withdraw_model
from .optimizer import _AdaFisherBase

_ON_DIVERGENCE = ("warn", "raise", "fallback")


class DivergenceError(RuntimeError):
    """The live update left the baseline by more than the configured threshold."""


class CAFINCallback(Callback):
    """Bind AdaFisher to the LightningModule, run it on the fused step, and log what it costs.

    Args:
        backend: ``"auto"`` (fused CUDA where it can run, else foreach), ``"fused"``,
            ``"foreach"``, ``"reference"``, or ``None`` to keep each optimizer's own.
        log_every_n_steps: logging interval in optimizer steps (default: the trainer's).
        divergence_every_n_steps: how often to run the shadow baseline step (0: never);
            sampled on steps ``1, n, 2n, ...`` (not step 0, whose update also creates the
            optimizer's state, so its memory is not the update's).
        baseline_backend: the backend of the shadow step (the oracle by default).
        divergence_threshold: relative divergence above which ``on_divergence`` acts.
        on_divergence: ``"warn"``, ``"raise"`` (a :class:`DivergenceError`) or
            ``"fallback"`` (switch that optimizer to the baseline backend).
        histogram_layers: how many layers (the first by name), or which layer names, get
            TensorBoard histograms of their ``S`` and ``H`` factors (0 or ``[]``: none).
    """

    def __init__(
        self,
        backend: Optional[str] = "auto",
        log_every_n_steps: Optional[int] = None,
        divergence_every_n_steps: int = 500,
        baseline_backend: str = "reference",
        divergence_threshold: float = 1e-4,
        on_divergence: str = "warn",
        histogram_layers: Union[int, Sequence[str]] = 3,
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
        if isinstance(histogram_layers, int) and histogram_layers < 0:
            raise ValueError(f"histogram_layers must be >= 0 or a list of layer names, got {histogram_layers}")
        self.backend = backend
        self.log_every_n_steps = log_every_n_steps
        self.divergence_every_n_steps = divergence_every_n_steps
        self.baseline_backend = baseline_backend
        self.divergence_threshold = divergence_threshold
        self.on_divergence = on_divergence
        self.histogram_layers = histogram_layers if isinstance(histogram_layers, int) else list(histogram_layers)
        self._monitors: list[OptimizerMonitor] = []
        self._handles: list[RemovableHandle] = []
        self._watched: tuple[int, ...] = ()
        self._writer: Optional[DashboardWriter] = None
        self._layout_written: set[int] = set()

    # ------------------------------------------------------------- lifecycle
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        from lightning.pytorch.strategies import FSDPStrategy

        if isinstance(trainer.strategy, FSDPStrategy):
            raise TypeError(f"CAFINCallback: {FSDP1_REFUSED}")
        # Optimizers do not exist yet (Lightning creates them after setup); offer the
        # module so that an AdaFisher built where this callback cannot see it (a
        # learning-rate search swaps the trainer's callbacks out) still binds to it.
        offer_model(pl_module)

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._attach(trainer, pl_module, warn_if_none=True)
        if self._monitors and self._writer is not None:
            # TensorBoard's HParams view keeps the first record of a run, and Lightning writes
            # the model's right after this hook: write the model's and the optimizer's together now.
            params: dict[str, Any] = dict(pl_module.hparams_initial)
            datamodule = getattr(trainer, "datamodule", None)
            if datamodule is not None:
                params.update(datamodule.hparams_initial)
            for m in self._monitors:
                params.update(optimizer_hparams(m.opt, m.device, m.suffix))
            self._writer.hparams(params)

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
        self._writer = DashboardWriter(list(trainer.loggers), trainer.is_global_zero)
        for i, opt in enumerate(optimizers):
            opt.bind(pl_module, warn_on_takeover=False)
            if self.backend is not None:
                opt.set_backend(self.backend)
            monitor = OptimizerMonitor(
                opt, "" if len(optimizers) == 1 else f"/opt{i}", self.baseline_backend, self._check_divergence,
                self.histogram_layers,
            )
            self._handles.append(opt.register_step_observer(monitor))
            self._monitors.append(monitor)
            rank_zero_info(f"CAFINCallback: {opt.summary()}")
        on_gpu = any(m.capture_cost.on_gpu for m in self._monitors)
        self._writer.open_series(["live", "baseline", "device", "host"] if on_gpu else ["live", "baseline", "host"])
        self._log_backend(trainer)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._release()
        withdraw_model(pl_module)

    def _release(self) -> None:
        for handle in self._handles:
            handle.remove()
        for m in self._monitors:
            m.opt.unbind()
        self._handles, self._monitors = [], []
        if self._writer is not None:
            self._writer.close()

    # ------------------------------------------------------------- each batch
    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if tuple(id(o) for o in trainer.optimizers) != self._watched:
            # the optimizers were replaced after fit start (a learning-rate search does this)
            self._attach(trainer, pl_module)
        if self.samples_baseline_at(trainer.global_step):
            for m in self._monitors:
                m.shadow_due = True

    def samples_baseline_at(self, step: int) -> bool:
        """Whether optimizer step ``step`` (counted from 0) runs the shadow baseline."""
        every = self.divergence_every_n_steps
        return bool(every) and (step == 1 or (step > 0 and step % every == 0))

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self._monitors or self._writer is None or not self._should_log(trainer):
            return
        step = trainer.fit_loop.epoch_loop._batches_that_stepped
        samples: Samples = {}
        for m in self._monitors:
            samples.update(m.report())
        self._writer.scalars(samples, step)
        for m in self._monitors:
            self._writer.histograms("cafin/precond", m.histograms(), step, m.suffix)

    def _should_log(self, trainer: Trainer) -> bool:
        if self.log_every_n_steps is None:
            return trainer._logger_connector.should_update_logs
        return trainer.global_step % self.log_every_n_steps == 0 and any(m.pending for m in self._monitors)

    # -------------------------------------------------------------- reporting
    def _compared(self) -> str:
        live = sorted({m.opt.backend for m in self._monitors})
        return f"{'/'.join(live)} vs {self.baseline_backend}"

    def _log_backend(self, trainer: Trainer) -> None:
        names = ", ".join(f"{type(m.opt).__name__}{m.suffix}: {m.opt.backend}" for m in self._monitors)
        rank_zero_info(f"CAFINCallback: backend {names}")
        assert self._writer is not None
        every = self.divergence_every_n_steps
        sampled = f"at step 1, then every {every} steps" if every else "never (divergence_every_n_steps=0)"
        self._writer.text(TEXT_TAG, f"{names}; divergence compares {self._compared()}, sampled {sampled}",
                          trainer.global_step)
        new = [lg for lg in trainer.loggers if id(lg) not in self._layout_written]
        if new:
            DashboardWriter(new, trainer.is_global_zero).layout(
                custom_scalars_layout([m.suffix for m in self._monitors], self._compared()))
            self._layout_written.update(id(lg) for lg in new)

    def _check_divergence(self, monitor: OptimizerMonitor, d: Divergence) -> None:
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
