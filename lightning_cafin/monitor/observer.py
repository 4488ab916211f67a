"""The passive observer of one optimizer: what it records inside ``step()`` and what it reports.

Inside a step it only records: CUDA events (or clock readings on the CPU) around the
update and around a capture step's factor work, and device copies of the factors after a
capture.  It never reads a device value on the host there, never asks the optimizer to
read ``found_inf``, and never changes the capture schedule.  Everything is read in
:meth:`OptimizerMonitor.report`, on logging steps.  The exception is the sampled shadow
baseline step (``shadow_due``): it copies the parameters, replays the update with the
baseline backend and compares, which reads values on the host by design.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import Tensor
from torchmetrics.aggregation import MaxMetric, MeanMetric

from ..backends import StepBackend, make_backend
from .capture_cost import CaptureCost
from .memory import AllocatedMemory
from .preconditioner import PreconditionerHealth
from .shadow import Divergence, Snapshot, divergence, replay, take_snapshot
from .tags import tag
from .timing import StepTimer

#: (series or None for the training run, tag) -> value
Samples = dict[tuple[Optional[str], str], float]

_MB = 2.0**20


def device_of(opt: Any) -> torch.device:
    for group in opt.param_groups:
        for p in group["params"]:
            return p.device
    return torch.device("cpu")


def lambda_of(opt: Any) -> float:
    """The ``Lambda`` the Preconditioner section uses: the param groups' common value, else the default."""
    values = {float(g["Lambda"]) for g in opt.param_groups}
    return values.pop() if len(values) == 1 else float(opt.defaults["Lambda"])


class OptimizerMonitor:
    """Step observer of one AdaFisher-family optimizer (register it with ``register_step_observer``).

    Args:
        opt: the optimizer.
        suffix: appended to every tag (``/opt1``) when several optimizers are watched.
        baseline_backend: backend of the shadow step (``reference``: the oracle).
        on_divergence: called with ``(monitor, Divergence)`` after each shadow step.
        histogram_layers: the number of layers (first by name), or their names, whose
            ``S`` / ``H`` histograms are written.
    """

    def __init__(self, opt: Any, suffix: str = "", baseline_backend: str = "reference",
                 on_divergence: Optional[Callable[["OptimizerMonitor", Divergence], None]] = None,
                 histogram_layers: Union[int, Sequence[str]] = 3) -> None:
        self.opt, self.suffix = opt, suffix
        self.device = device_of(opt)
        self.baseline_backend = baseline_backend
        self.on_divergence = on_divergence
        self.timer = StepTimer(self.device)
        self.capture_cost = CaptureCost(self.device)
        self.preconditioner = PreconditionerHealth(histogram_layers)
        self.shadow_due = False
        self._shadow_results: list[dict[tuple[Optional[str], str], float]] = []
        # this process's own figures: no collective at compute() (under NCCL, a sync of these CPU
        # states would fail, and the dashboard must add no traffic to a data-parallel run)
        self._step_mean, self._step_max = MeanMetric(sync_on_compute=False), MaxMetric(sync_on_compute=False)
        self._snapshot: Optional[Snapshot] = None
        self._live_memory: Optional[AllocatedMemory] = None
        self._baseline: Optional[StepBackend] = None

    # ------------------------------------------------------- inside step()
    def before_capture(self, opt: Any) -> None:
        self.capture_cost.start()

    def after_capture(self, opt: Any) -> None:
        self.capture_cost.stop()
        self.preconditioner.on_capture(opt.factors())

    def before_update(self, opt: Any, found_inf: Optional[Tensor] = None) -> None:
        if self.shadow_due:
            self._snapshot = take_snapshot(opt)
            self._live_memory = AllocatedMemory(self.device)
            self._live_memory.start()
        self.timer.start()

    def after_update(self, opt: Any, found_inf: Optional[Tensor] = None) -> None:
        self.timer.stop()
        if self._live_memory is None:
            return
        live_bytes = self._live_memory.stop()  # always pops what before_update pushed
        snapshot, self._snapshot, self._live_memory, self.shadow_due = self._snapshot, None, None, False
        assert snapshot is not None  # taken in before_update together with _live_memory
        if self._baseline is None:
            self._baseline = make_backend(self.baseline_backend)
        timer = StepTimer(self.device)
        with AllocatedMemory(self.device) as base_memory:
            timer.start()
            replay(opt, snapshot, self._baseline, found_inf)
            timer.stop()
        d = divergence(snapshot)
        base_ms = timer.drain()[0]
        live_mb, base_mb = live_bytes / _MB, base_memory.bytes / _MB
        self._shadow_results.append({
            ("baseline", tag("step_ms", self.suffix)): base_ms,
            ("live", tag("update_alloc_mb", self.suffix)): live_mb,
            ("baseline", tag("update_alloc_mb", self.suffix)): base_mb,
            (None, tag("memory_saved_mb", self.suffix)): base_mb - live_mb,
            (None, tag("divergence_max_abs", self.suffix)): d.max_abs,
            (None, tag("divergence_rel", self.suffix)): d.rel,
        })
        if self.on_divergence is not None:
            self.on_divergence(self, d)

    # ------------------------------------------------------ logging steps
    @property
    def pending(self) -> bool:
        """Whether anything was recorded since the last report."""
        return bool(self.timer.pending or self.capture_cost.pending or self.preconditioner.pending)

    def report(self) -> Samples:
        """Read everything recorded since the last report (the only host reads)."""
        out: Samples = {}
        for t in self.timer.drain():
            self._step_mean.update(t)
            self._step_max.update(t)
        if self._step_mean.update_count:
            out["live", tag("step_ms", self.suffix)] = float(self._step_mean.compute())
            out["live", tag("step_ms_max", self.suffix)] = float(self._step_max.compute())
        self._step_mean.reset()
        self._step_max.reset()
        device_ms, host_ms = self.capture_cost.drain()
        if host_ms:
            out["host", tag("capture_ms", self.suffix)] = sum(host_ms) / len(host_ms)
            if self.capture_cost.on_gpu:
                out["device", tag("capture_ms", self.suffix)] = sum(device_ms) / len(device_ms)
        if self._shadow_results:
            out.update(self._shadow_results[-1])
            self._shadow_results = []
        for series, stats in self.preconditioner.read(lambda_of(self.opt)).items():
            for key, value in stats.items():
                out[series, tag(key, self.suffix)] = value
        health = self.opt.health
        out[None, tag("skipped_steps", self.suffix)] = float(health["skipped_steps"])
        out["no_layer", tag("f_one", self.suffix)] = float(health["params_f_one"])
        out["not_fired", tag("f_one", self.suffix)] = float(len(health["modules_not_fired"]))
        return out

    def histograms(self) -> dict[str, tuple[Tensor, Tensor]]:
        """``S`` / ``H`` host copies of the chosen layers, after a report that read a capture."""
        return self.preconditioner.histograms()
