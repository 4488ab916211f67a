"""What ``CAFINCallback`` costs: a Lightning training step with it against the same step without.

Two ``lightning.Trainer`` fits of the matrix's CIFAR ResNet-18 (``workloads.py``), the same
seeded model and one in-memory batch (data loading is not measured), a
``TensorBoardLogger`` in a temporary folder, no progress bar, no checkpoints:

* ``bare``: ``configure_optimizers`` returns ``AdaFisher(model, ...)``, bound to the model
  directly; no callback;
* ``callback``: ``AdaFisher(self.parameters(), ...)`` and ``CAFINCallback()`` at its default
  settings (binding, backend, TensorBoard dashboard, shadow baseline every 500 steps).

The two fits run in two threads that take turns (:class:`Baton`): one block of ``block``
steps each, never both at once, so clock and allocator drift fall on both alike.  A block
is timed by the wall clock between two device synchronisations (``timing.elapsed_ms``'s
way), host work included: what a training loop sees.  Each block is tagged with the steps
in it that do more than a normal step: ``logging`` (Lightning's ``log_every_n_steps``, when
the dashboard writes), ``capture`` (every ``TCov`` steps) and ``shadow`` (the callback's
baseline step).  The figures:

* ``quiet_ratio``: the paired per-block ratio (callback over bare) over blocks where
  neither fit had any such step: the goal, at most 1.01x;
* ``overall_ratio``: total time over every timed block, those steps at their default
  frequency (the timed steps cover whole capture and logging periods);
* ``extra_ms``: per tag, what a block with such a step costs above the bare block beside it;
* ``syncs``: after the timed blocks the callback's fit runs ``count_steps`` more steps under
  :func:`syncs.counting_syncs`: the monitoring code's host reads and device waits per step,
  apart for logging, shadow and the other (non-logging) steps, which should have none.
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator, Optional, Union

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger

from .. import AdaFisher, AdaFisherW, CAFINCallback
from .goals import goal_rows
from .syncs import counting_syncs
from .timing import spread, spread_text, sync
from .workloads import Workload

VARIANTS = ("bare", "callback")
TAGS = ("logging", "capture", "shadow")


@dataclass
class CallbackConfig:
    warmup: int = 100  # steps before the first timed block: binding, the first captures and logs, the step-1 shadow
    block: int = 10  # steps per timed block
    blocks: int = 60  # timed blocks per variant: 600 steps, 6 capture periods of TCov=100, 12 logging periods of 50
    count_steps: int = 100  # steps of the callback's fit counted for host syncs after the timed blocks
    log_every_n_steps: int = 50  # the Trainer's (Lightning's default)
    TCov: int = 100  # AdaFisher's default

    def __post_init__(self) -> None:
        for name in ("block", "blocks", "count_steps", "log_every_n_steps", "TCov"):
            if getattr(self, name) < 1:
                raise ValueError(f"CallbackConfig.{name} must be at least 1 (got {getattr(self, name)})")
        if self.warmup < 0 or self.warmup % self.block:
            raise ValueError(f"CallbackConfig.warmup must be a multiple of block={self.block} (got {self.warmup})")

    @classmethod
    def quick(cls) -> "CallbackConfig":
        return cls(warmup=2, block=2, blocks=6, count_steps=6, log_every_n_steps=6, TCov=6)

    @property
    def timed_end(self) -> int:
        """The step at which the last timed block ends (the first step not timed)."""
        return self.warmup + self.block * self.blocks


class Baton:
    """Threads that take turns, in a fixed order; one that has finished is skipped."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.order = list(names)
        self.turn = 0
        self.done: set[str] = set()
        self.cond = threading.Condition()

    def take(self, name: str) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.order[self.turn] == name)

    def pass_on(self, name: str, finished: bool = False) -> None:
        with self.cond:
            if finished:
                self.done.add(name)
            n = len(self.order)
            for k in range(1, n + 1):
                if self.order[(self.turn + k) % n] not in self.done:
                    self.turn = (self.turn + k) % n
                    break
            self.cond.notify_all()

    def hand_over(self, name: str) -> None:
        self.pass_on(name)
        self.take(name)


@dataclass
class Block:
    start: int  # first step of the block
    ms: float  # wall-clock milliseconds per step
    tags: list[str] = field(default_factory=list)


class BlockTimer(Callback):
    """Times blocks of steps, tags them, and hands the device to the other fit between blocks.

    First in the trainer's callback list, so that a block runs from the start of its first
    step to the start of the step after its last (every callback's batch-end work included)."""

    def __init__(self, name: str, baton: Baton, cfg: CallbackConfig, device: torch.device,
                 cafin: Optional[CAFINCallback] = None) -> None:
        self.name, self.baton, self.cfg, self.device, self.cafin = name, baton, cfg, device, cafin
        self.blocks: list[Block] = []
        self.t0: Optional[float] = None
        self.tags: set[str] = set()

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step <= self.cfg.timed_end and step % self.cfg.block == 0:
            sync(self.device)
            if self.t0 is not None and step > self.cfg.warmup:
                ms = (time.perf_counter() - self.t0) * 1e3 / self.cfg.block
                self.blocks.append(Block(step - self.cfg.block, ms, sorted(self.tags)))
            self.baton.hand_over(self.name)
            self.t0, self.tags = time.perf_counter(), set()
        if adafisher_of(trainer).capture_due:
            self.tags.add("capture")
        if self.cafin is not None and self.cafin.samples_baseline_at(step):
            self.tags.add("shadow")

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if logging_step(trainer):
            self.tags.add("logging")


def adafisher_of(trainer: Trainer) -> Union[AdaFisher, AdaFisherW]:
    opt = trainer.optimizers[0]
    if not isinstance(opt, (AdaFisher, AdaFisherW)):
        raise TypeError(f"the benchmarked fit's optimizer is {type(opt).__name__}, not AdaFisher(W)")
    return opt


def logging_step(trainer: Trainer) -> bool:
    """Whether the step just taken writes its logs (the callback's dashboard included)."""
    return bool(trainer._logger_connector.should_update_logs)


class SyncProbe(Callback):
    """The monitoring code's host syncs per step, from ``from_step`` on.  Last in the callback
    list, so that its batch end follows ``CAFINCallback``'s."""

    def __init__(self, cafin: CAFINCallback, from_step: int) -> None:
        self.cafin, self.from_step = cafin, from_step
        self.per_step: list[tuple[str, int]] = []  # (logging / shadow / quiet, syncs)
        self.ctx: Any = None
        self.counter: Any = None

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_step >= self.from_step:
            self.ctx = counting_syncs()
            self.counter = self.ctx.__enter__()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.ctx is None:
            return
        self.ctx.__exit__(None, None, None)
        self.ctx = None
        kind = ("logging" if logging_step(trainer) else
                "shadow" if self.cafin.samples_baseline_at(trainer.global_step - 1) else "quiet")
        self.per_step.append((kind, self.counter.count))


class Model(LightningModule):
    """The workload's model and batch in a LightningModule; AdaFisher bound directly or through the callback."""

    def __init__(self, wl: Workload, device: torch.device, TCov: int, bind_directly: bool) -> None:
        super().__init__()
        self.wl, self.TCov, self.bind_directly = wl, TCov, bind_directly
        self.net = wl.model(device)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.wl.loss(self.net, x, y, self.device)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        target = self.net if self.bind_directly else self.parameters()
        return self.wl.ada_cls(target, lr=self.wl.lr, weight_decay=self.wl.weight_decay, TCov=self.TCov)


class SameBatch:
    """One batch, ``length`` times: a loader that costs nothing."""

    def __init__(self, batch: tuple[torch.Tensor, torch.Tensor], length: int) -> None:
        self.batch, self.length = batch, length

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return (self.batch for _ in range(self.length))


def _fit(name: str, wl: Workload, device: torch.device, cfg: CallbackConfig, baton: Baton, root: str,
         out: dict[str, Any]) -> None:
    """One variant's fit, in its own thread, holding the baton whenever it runs."""
    baton.take(name)
    try:
        cafin = CAFINCallback() if name == "callback" else None
        timer = BlockTimer(name, baton, cfg, device, cafin)
        callbacks: list[Callback] = [timer]
        steps = cfg.timed_end + 1  # the last block ends where a step starts
        if cafin is not None:
            probe = SyncProbe(cafin, cfg.timed_end)
            callbacks += [cafin, probe]
            steps = cfg.timed_end + cfg.count_steps
            out["probe"] = probe
        trainer = Trainer(
            accelerator="gpu" if device.type == "cuda" else "cpu", devices=[device.index or 0] if device.type == "cuda" else 1,
            max_steps=steps, logger=TensorBoardLogger(root, name=name), callbacks=callbacks,
            log_every_n_steps=cfg.log_every_n_steps, enable_progress_bar=False, enable_checkpointing=False,
            enable_model_summary=False, precision="32-true", default_root_dir=root,
        )
        model = Model(wl, device, cfg.TCov, bind_directly=cafin is None)
        trainer.fit(model, train_dataloaders=SameBatch(wl.batch(device), steps + 1))
        out["timer"] = timer
        out["backend"] = adafisher_of(trainer).backend
    except BaseException as exc:  # the main thread re-raises it
        out["error"] = exc
    finally:
        baton.pass_on(name, finished=True)


def _quiet(block: Block) -> bool:
    return not block.tags


def summarise(blocks: dict[str, list[Block]], per_step: list[tuple[str, int]], block: int) -> dict[str, Any]:
    """The figures of the module docstring from the two fits' blocks and the counted steps."""
    bare, cb = blocks["bare"], blocks["callback"]
    if [b.start for b in bare] != [b.start for b in cb]:
        raise RuntimeError("the two fits timed different blocks")
    quiet = [(c.ms, b.ms) for c, b in zip(cb, bare) if _quiet(c) and _quiet(b)]
    if not quiet:
        raise RuntimeError("no block without a logging, capture or shadow step: make the blocks shorter")
    out: dict[str, Any] = {
        "bare_ms": spread([b for _, b in quiet]), "callback_ms": spread([c for c, _ in quiet]),
        "quiet_ratio": spread([c / b for c, b in quiet]),
        "overall_ratio": sum(c.ms for c in cb) / sum(b.ms for b in bare),
        "blocks": {"timed": len(cb), "quiet": len(quiet)},
        "extra_ms": {},
    }
    for tag in TAGS:  # one such step in a block: the block's extra time is that step's
        extra = [(c.ms - b.ms) * block for c, b in zip(cb, bare) if tag in c.tags]
        out["extra_ms"][tag] = spread(extra) if extra else None
    counted: dict[str, list[int]] = {}
    for kind, n in per_step:
        counted.setdefault(kind, []).append(n)
    out["syncs"] = {kind: {"steps": len(ns), "total": sum(ns), "max": max(ns)} for kind, ns in sorted(counted.items())}
    return out


def callback_goals(r: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's goal (at most 1.01x on non-logging steps, no host sync there) and the figures beside it."""
    quiet_syncs = r["syncs"].get("quiet")
    rows: list[tuple[str, float, str, Optional[float]]] = [
        ("Lightning step with CAFINCallback vs without", r["quiet_ratio"]["median"], "x", 1.01),
        ("same, all steps (logging, captures)", r["overall_ratio"], "x", None),
    ]
    if quiet_syncs is not None:
        rows.append(("dashboard host syncs per non-logging step", float(quiet_syncs["max"]), "count", 0.0))
    return goal_rows(rows)


def measure_callback(wl: Workload, device: torch.device, cfg: CallbackConfig) -> dict[str, Any]:
    """Both fits, interleaved block by block; their figures, goals and the warnings they raised."""
    baton = Baton(VARIANTS)
    results: dict[str, dict[str, Any]] = {name: {} for name in VARIANTS}
    quiet_loggers = [logging.getLogger(n) for n in ("lightning.pytorch", "lightning.fabric")]
    levels = [lg.level for lg in quiet_loggers]
    with tempfile.TemporaryDirectory() as root, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for lg in quiet_loggers:
            lg.setLevel(logging.WARNING)
        threads = [threading.Thread(target=_fit, args=(name, wl, device, cfg, baton, root, results[name]),
                                    name=f"fit-{name}", daemon=True) for name in VARIANTS]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            for lg, level in zip(quiet_loggers, levels):
                lg.setLevel(level)
    for name in VARIANTS:
        if "error" in results[name]:
            raise RuntimeError(f"the {name} fit failed: {results[name]['error']!r}") from results[name]["error"]
    out = summarise({n: results[n]["timer"].blocks for n in VARIANTS}, results["callback"]["probe"].per_step, cfg.block)
    out = {"description": f"{wl.description} in a Lightning Trainer, AdaFisher bound directly vs CAFINCallback()",
           "backend": results["callback"]["backend"], "config": asdict(cfg), **out}
    out["goals"] = callback_goals(out)
    out["warnings"] = sorted({str(w.message) for w in caught if "CAFIN" in str(w.message)})
    return out


def callback_table(r: dict[str, Any]) -> str:
    """The callback's figures in a few lines: milliseconds per step, extra per tagged block, syncs."""
    ms = spread_text
    q = r["quiet_ratio"]
    lines = [f"callback: {r['description']} ({r['backend']})",
             f"  quiet blocks ({r['blocks']['quiet']} of {r['blocks']['timed']}) ms/step: bare {ms(r['bare_ms'])}; "
             f"callback {ms(r['callback_ms'])}; ratio {q['median']:.4f} [{q['p10']:.4f}, {q['p90']:.4f}]",
             f"  all timed steps: ratio {r['overall_ratio']:.4f}"]
    extra = "; ".join(f"{tag} {ms(sp)}" for tag, sp in r["extra_ms"].items() if sp is not None)
    if extra:
        lines.append(f"  a tagged step, callback above bare (ms): {extra}")
    lines.append("  dashboard host syncs per step: " + "; ".join(
        f"{kind} max {s['max']} over {s['steps']} steps" for kind, s in r["syncs"].items()))
    lines += [f"  warning: {w}" for w in r["warnings"]]
    return "\n".join(lines)


__all__ = ["Baton", "CallbackConfig", "callback_goals", "callback_table", "measure_callback", "summarise"]
