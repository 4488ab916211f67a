"""The workload matrix: AdaFisher against torch's Adam/AdamW(fused=True) on what users train.

For each workload (``workloads.py``), on the same model, batch and precision:

* ``pipelined``: train steps (zero_grad, forward, backward, step) back to back with no
  synchronisation, timed in blocks of ``block`` steps (wall clock between two device
  synchronisations, divided by the steps), for AdaFisher at TCov = 100 / 10 / 1 and Adam.
  Blocks of the four variants alternate, so each AdaFisher block has an Adam block beside
  it.  ``ratio`` is AdaFisher's total time over Adam's (captures counted at their
  frequency: ``blocks * block`` is a multiple of 100 by default), ``ratio_ci90`` its 90%
  interval (a bootstrap over the paired blocks); ``block_ratio`` the spread of the paired
  per-block ratios.  TCov = 1 is also run with its statistics on a side stream
  (``tcov1_side_stream``: ``vs_default_ratio`` over the default's TCov = 1 blocks, whose
  stream ``capture_stream="auto"`` chose during the warm-up; in runs before it was the
  default, ``vs_current_stream_ratio``, the default then being the current stream).
* ``sync``: one train step at a time with a synchronisation after each (what a loop that
  reads the loss every step sees): Adam's step, AdaFisher's normal step and its capture
  step, interleaved; medians, p10/p90 and the median's 90% interval (``ci90``) of the
  paired ratios and differences.  The capture step is also timed with each stream setting
  explicitly (``STREAM_SETTINGS``: the current stream, the side stream, and
  ``capture_stream="auto"`` after its trials, ``choose_stream``), and with Python tensor
  hooks beside the default C++ gradient taps, so that each default is checked against a
  figure measured side by side.  The rounds start after an untimed capture
  step: a training run's capture steps repeat one another, each taking the factor update
  the one before kept (``capture/factors.py``, ``KeptLaunch``), and so do the timed ones,
  the Python hooks' between them notwithstanding (``capture_kept_launch_share``: the
  share that did, here and in ``host``).
* ``memory``: each optimizer alone on its own model: the allocator's peak during one
  normal and one capture step, and for AdaFisher one capture step with its statistics on
  the side stream (``torch.cuda.max_memory_allocated`` after a reset), above what was
  allocated before the model was built.  On the CPU the peak is the resident
  parameters, gradients and state plus the tensors the step creates.
* ``host``: AdaFisher's normal and capture steps, interleaved, timed per phase on the host
  (forward with the loss, backward, optimizer step) from a synchronised device with no
  synchronisation between the phases, and what a capture adds per captured layer: where a
  capture step's time goes when the host is the bottleneck.
* ``optimizer_step``: ``optimizer.step()`` alone (eager, a normal step), blocks of steps
  back to back, interleaved with Adam's.
* ``state``: optimizer-state bytes (AdaFisher's ``memory_usage()``, Adam's two moments).
* ``statistics_floor``: the bytes a capture step's statistics must read and, on a GPU, the
  least device time that takes at its peak bandwidth (``floor.py``): what no kernel tuning
  can take off a capture step on the current stream.
* ``launches`` (on a GPU): the device operations of a normal and a capture step, and what
  the capture step adds beside the budget its layers allow (``launches.py``), counted after
  every timing of the run (``add_launch_counts``); ``host_us_per_added_launch`` divides
  the capture step's extra host time by them.

:func:`goals` sets each figure beside its goal (issue 16) and says whether it is met, by
its value and by its interval (``goals.py``); :func:`detail_table` prints the figures
behind them.  The host's speed varies by 40% between sessions: compare within one run.
"""

from __future__ import annotations

import contextlib
import functools
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from ..capture import streams as capture_streams
from ..capture import taps as capture_taps
from ..capture.stream_choice import MAX_TRIALS_PER_STREAM
from ..capture_options import CaptureOptions, StreamOption
from .floor import statistics_floor
from .goals import goal_rows
from .launches import capture_launches
from .timing import (diff, elapsed_ms, free_memory, interleaved, paired, ratio, ratio_of_sums_interval, run_peak,
                     spread, spread_text, sync)
from .workloads import Workload

TCOVS = (100, 10, 1)
#: a step-synchronous capture step's goal above a normal step: in ms (``Workload.capture_goal``
#: "ms", the ResNet-18s) or as a ratio (the others)
CAPTURE_LIMIT_MS, CAPTURE_LIMIT_RATIO = 1.0, 1.05
#: the pipelined blocks at TCov = 1 with the statistics on the side stream
SIDE_BLOCKS = "tcov1_side_stream"
#: the stream settings whose capture steps the sync rounds time explicitly, by name
STREAM_SETTINGS: dict[str, StreamOption] = {"current": False, "side": True, "auto": "auto"}
#: AdaFisher's schedule in the sync / memory / step measurements: only forced steps capture
NEVER = 10**9


@dataclass
class MatrixConfig:
    warmup: int = 5  # train steps per variant before anything is timed (step 0 binds and captures)
    block: int = 10  # steps per timed block (pipelined and optimizer-step)
    blocks: int = 10  # timed blocks per variant (pipelined)
    sync_reps: int = 30  # step-synchronous steps per variant
    step_blocks: int = 15  # timed blocks per optimizer (optimizer step alone)

    @classmethod
    def quick(cls) -> "MatrixConfig":
        return cls(warmup=3, block=2, blocks=2, sync_reps=3, step_blocks=2)


class Trainer:
    """One model, its optimizer and a fixed batch: a train step, a capture step, steps alone."""

    def __init__(self, wl: Workload, model: nn.Module, opt: torch.optim.Optimizer, batch, device: torch.device):
        self.wl, self.model, self.device = wl, model, device
        self.opt: Any = opt  # AdaFisher's public surface (capture_next_step, memory_usage, backend) or Adam
        self.x, self.y = batch

    def step(self) -> None:
        self.opt.zero_grad()
        self.wl.loss(self.model, self.x, self.y, self.device).backward()
        self.opt.step()

    def capture_step(self) -> None:
        self.opt.capture_next_step()  # AdaFisher's public request: the next step captures
        self.step()

    def host_phases(self, capture: bool, mark: Optional[Callable[[int], None]] = None) -> tuple[float, float, float]:
        """One train step's host milliseconds in the forward (with the loss), the backward and
        the optimizer step, from a synchronised device and with no synchronisation between
        the phases: what the host spends, hooks included, whatever the device does.
        ``mark(i)``, where given, is called just before the host's i-th timestamp (0: the
        start, then the end of each phase), e.g. to record a CUDA event there."""
        def stamp(i: int) -> float:
            if mark is not None:
                mark(i)
            return time.perf_counter()

        sync(self.device)
        if capture:
            self.opt.capture_next_step()
        t0 = stamp(0)
        self.opt.zero_grad()
        loss = self.wl.loss(self.model, self.x, self.y, self.device)
        t1 = stamp(1)
        loss.backward()
        t2 = stamp(2)
        self.opt.step()
        t3 = stamp(3)
        sync(self.device)
        return (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3

    def steps(self, n: int) -> None:
        for _ in range(n):
            self.step()

    def optimizer_steps(self, n: int) -> None:
        for _ in range(n):
            self.opt.step()


def adafisher(wl: Workload, device: torch.device, batch, TCov: int, capture_stream: StreamOption = None) -> Trainer:
    """A fresh model and its AdaFisher(W) as the bench trains it (``capture_stream``: the
    optimizer's, its default where None)."""
    model = wl.model(device)
    opt = wl.ada_cls(model, lr=wl.lr, weight_decay=wl.weight_decay, TCov=TCov, capture_stream=capture_stream)
    return Trainer(wl, model, opt, batch, device)


def adam(wl: Workload, device: torch.device, batch) -> Trainer:
    model = wl.model(device)
    opt = wl.adam_cls(model.parameters(), lr=wl.lr, weight_decay=wl.weight_decay, fused=True)
    return Trainer(wl, model, opt, batch, device)


def adam_state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))


def resident_bytes(t: Trainer) -> int:
    """Parameters, gradients and optimizer state held between steps."""
    params = list(t.model.parameters())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    state = t.opt.memory_usage()["total"] if hasattr(t.opt, "memory_usage") else adam_state_bytes(t.opt)
    return sum(p.numel() * p.element_size() for p in params) + grads + state


def _memory_of(name: str, wl: Workload, device: torch.device, batch, cfg: MatrixConfig) -> dict[str, float]:
    """One optimizer alone: its peak per step type; everything it built is gone when this returns."""
    free_memory(device)
    baseline = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    t = adam(wl, device, batch) if name == "adam" else adafisher(wl, device, batch, NEVER)
    t.steps(cfg.warmup)
    kinds: dict[str, Callable[[], Any]] = {"normal": t.step}
    if name != "adam":  # (the side stream holds the activation and gradient it reads until it has read them)
        kinds.update(capture=t.capture_step, capture_side_stream=functools.partial(capture_step_on, t, True))
    row: dict[str, float] = {}
    for kind, fn in kinds.items():
        before, peak = run_peak(fn, device)
        total = peak - baseline if device.type == "cuda" else resident_bytes(t) + peak
        row[f"{kind}_peak_mb"] = total / 2**20
        row[f"{kind}_above_start_mb"] = (peak - before) / 2**20
    return row


def measure_memory(wl: Workload, device: torch.device, batch, cfg: MatrixConfig) -> dict[str, Any]:
    """Peak bytes of one step per step type, each optimizer alone on the device."""
    out: dict[str, Any] = {name: _memory_of(name, wl, device, batch, cfg) for name in ("adam", "adafisher")}
    free_memory(device)
    ada = out["adafisher"]
    out["capture_vs_normal_ratio"] = ada["capture_peak_mb"] / ada["normal_peak_mb"]
    out["capture_side_stream_vs_normal_ratio"] = ada["capture_side_stream_peak_mb"] / ada["normal_peak_mb"]
    out["normal_vs_adam_ratio"] = ada["normal_peak_mb"] / out["adam"]["normal_peak_mb"]
    return out


@contextlib.contextmanager
def capture_stream_set(t: Trainer, stream: StreamOption) -> Iterator[None]:
    """Inside: ``t``'s optimizer has ``capture_stream=stream`` (``True``: the statistics on the
    side stream; ``False``: on the current stream; ``"auto"``: the one its capture steps'
    timings chose, ``capture/stream_choice.py``, a choice kept across uses); its options and
    the process-wide stream setting (which an explicit option changes for every optimizer)
    are restored on the way out."""
    options, previous = t.opt.capture_options, capture_streams.setting()
    t.opt.capture_options = CaptureOptions.checked(None, stream)
    try:
        yield
    finally:
        t.opt.capture_options = options
        capture_streams.set_enabled(previous)


def capture_step_on(t: Trainer, stream: StreamOption) -> None:
    """A capture step with ``capture_stream=stream`` (:func:`capture_stream_set`)."""
    with capture_stream_set(t, stream):
        t.capture_step()


def capture_step_at_high_priority(t: Trainer) -> None:
    """A capture step with the statistics on a high-priority side stream (the extension's
    default is a default-priority one: ``capture/streams.py``'s ``side_priority``), a second
    side stream beside the default's; on a CPU, which has no streams, the side-stream
    setting's capture step."""
    priority = capture_streams.side_priority(True) if t.device.type == "cuda" else contextlib.nullcontext()
    with priority:
        capture_step_on(t, True)


def choose_stream(t: Trainer) -> dict[str, Any]:
    """Run ``t``'s capture steps with ``capture_stream="auto"``, synchronised as the timed
    rounds are, until its timings have chosen a stream (its untimed first step and its trials
    each way), so that the timed auto steps are the run's steps after the choice.  Returns the
    choice (``side``: True for the side stream, None where nothing was timed) and each trial's
    time in ms, by stream."""
    chooser = t.opt.stream_chooser
    if t.device.type == "cuda":  # (elsewhere nothing is timed: the current stream, no choice)
        for _ in range(2 * MAX_TRIALS_PER_STREAM + 4):  # (the first capture step, the trials, their events' completion)
            capture_step_on(t, "auto")
            sync(t.device)
            chooser.poll()
            if chooser.choice is not None:
                break
    return {"side": chooser.choice, "trial_ms": {"side": chooser.times[True], "current": chooser.times[False]}}


def default_was_current_stream(side_blocks: dict[str, Any]) -> bool:
    """Whether the run of these pipelined side-stream blocks is from before ``"auto"`` was the
    default, when the default was the current stream (its ratio is ``vs_current_stream_ratio``)."""
    return "vs_default_ratio" not in side_blocks


def side_vs_default(side_blocks: dict[str, Any]) -> float:
    """The pipelined side-stream blocks over the default's: ``vs_default_ratio``, or in runs
    from before ``"auto"`` was the default, ``vs_current_stream_ratio``."""
    return side_blocks["vs_current_stream_ratio" if default_was_current_stream(side_blocks) else "vs_default_ratio"]


def capture_step_with_python_hooks(t: Trainer) -> None:
    """A capture step with the statistics taken by Python tensor hooks (the alternative to
    the default C++ gradient taps, ``capture/taps.py``); the process-wide setting is
    restored after it."""
    with capture_taps.using(False):
        t.capture_step()


def _host_phases_with_python_hooks(t: Trainer) -> tuple[float, float, float]:
    with capture_taps.using(False):
        return t.host_phases(True)


PHASES = ("forward", "backward", "step")
#: the step kinds whose host phases are timed: a normal step, a capture step (the default
#: setting), and one with Python hooks instead of C++ taps
HOST_KINDS = ("normal", "capture", "capture_python_hooks")
HOST_LABELS = {"normal": "normal", "capture": "capture", "capture_python_hooks": "capture with Python hooks"}


class KeptShare:
    """Over the capture steps of ``t`` it wraps (``counted``), how many took the factor update
    kept from the one before (``LaunchKeeper.taken``), as a training run's repeated capture
    steps do: ``share``."""

    def __init__(self, t: Trainer) -> None:
        self.keeper = t.opt.binding.launch_keeper
        self.served: list[bool] = []

    def counted(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        """``fn`` (one capture step), noting whether it took the kept factor update."""
        def run() -> Any:
            before = self.keeper.taken
            out = fn()
            self.served.append(self.keeper.taken > before)
            return out
        return run

    @property
    def share(self) -> float:
        return sum(self.served) / max(1, len(self.served))


def measure_host_phases(t: Trainer, reps: int) -> dict[str, Any]:
    """Host milliseconds per phase of AdaFisher's normal and capture steps (interleaved),
    and what a capture step adds per captured layer, in microseconds: the capture step's
    cost where the host, not the device, is the bottleneck.  ``capture_kept_launch_share``:
    the share of the timed C++-tap capture steps that took the kept factor update."""
    kept = KeptShare(t)
    timed: dict[str, Callable[[], tuple[float, float, float]]] = {
        "normal": functools.partial(t.host_phases, False),
        "capture": kept.counted(functools.partial(t.host_phases, True)),
        "capture_python_hooks": functools.partial(_host_phases_with_python_hooks, t)}
    rows: dict[str, list[tuple[float, float, float]]] = {kind: [] for kind in HOST_KINDS}
    for _ in range(reps):
        for kind in HOST_KINDS:
            rows[kind].append(timed[kind]())
    layers = max(1, len(t.opt.factors()))
    out: dict[str, Any] = {"layers": layers, "capture_kept_launch_share": kept.share}
    for kind in HOST_KINDS:
        out[kind] = {phase: spread([r[i] for r in rows[kind]]) for i, phase in enumerate(PHASES)}

    def per_layer_us(more: str, less: str) -> dict[str, float]:
        return {phase: (out[more][phase]["median"] - out[less][phase]["median"]) * 1e3 / layers for phase in PHASES}

    out["capture_extra_us_per_layer"] = per_layer_us("capture", "normal")
    out["python_hooks_extra_us_per_layer"] = per_layer_us("capture_python_hooks", "normal")
    return out


def measure_sync_step_state(wl: Workload, device: torch.device, batch, cfg: MatrixConfig) -> dict[str, Any]:
    """Step-synchronous train steps, the optimizer step alone, and the state bytes."""
    base, ada = adam(wl, device, batch), adafisher(wl, device, batch, NEVER)
    base.steps(cfg.warmup)
    ada.steps(cfg.warmup)
    # an untimed capture step: a training run's capture steps repeat one another, each taking
    # the factor update the one before kept, and the timed ones then do as well
    ada.capture_step()
    auto = choose_stream(ada)
    with_hooks = functools.partial(capture_step_with_python_hooks, ada)
    kept = KeptShare(ada)
    timed: dict[str, Callable[[], object]] = {"adam": base.step, "normal": ada.step, "capture": kept.counted(ada.capture_step)}
    for name, stream in STREAM_SETTINGS.items():  # each stream setting explicitly, whichever the default is
        timed[f"capture_{name}_stream"] = functools.partial(capture_step_on, ada, stream)
    timed["capture_side_high_priority"] = functools.partial(capture_step_at_high_priority, ada)
    timed["capture_python_hooks"] = with_hooks
    sync = interleaved({k: functools.partial(elapsed_ms, fn, device) for k, fn in timed.items()}, cfg.sync_reps)
    # gradients are left from the last train step; AdaFisher's next step is a normal one
    def per_step(t: Trainer) -> float:
        return elapsed_ms(functools.partial(t.optimizer_steps, cfg.block), device) / cfg.block

    alone = interleaved({"adam": functools.partial(per_step, base), "adafisher": functools.partial(per_step, ada)},
                        cfg.step_blocks)
    host = measure_host_phases(ada, cfg.sync_reps)
    ada_state = ada.opt.memory_usage()
    adam_state = adam_state_bytes(base.opt)
    result = {
        "backend": ada.opt.backend,
        "sync": {"adam_ms": spread(sync["adam"]), "normal_ms": spread(sync["normal"]),
                 "capture_ms": spread(sync["capture"]),
                 "normal_vs_adam_ratio": paired(sync["normal"], sync["adam"], ratio),
                 "capture_vs_normal_ratio": paired(sync["capture"], sync["normal"], ratio),
                 "capture_above_normal_ms": paired(sync["capture"], sync["normal"], diff),
                 "capture_current_stream_ms": spread(sync["capture_current_stream"]),
                 "capture_side_stream_ms": spread(sync["capture_side_stream"]),
                 "side_vs_current_stream_ratio": paired(sync["capture_side_stream"], sync["capture_current_stream"],
                                                        ratio),
                 "capture_side_high_priority_ms": spread(sync["capture_side_high_priority"]),
                 "high_vs_default_priority_ratio": paired(sync["capture_side_high_priority"],
                                                          sync["capture_side_stream"], ratio),
                 "auto_stream": auto,
                 "capture_auto_stream_ms": spread(sync["capture_auto_stream"]),
                 "auto_vs_current_stream_ratio": paired(sync["capture_auto_stream"], sync["capture_current_stream"],
                                                        ratio),
                 "auto_stream_vs_normal_ratio": paired(sync["capture_auto_stream"], sync["normal"], ratio),
                 "auto_stream_above_normal_ms": paired(sync["capture_auto_stream"], sync["normal"], diff),
                 "capture_uses_taps": capture_taps.enabled(),
                 "capture_kept_launch_share": kept.share,
                 "capture_python_hooks_ms": spread(sync["capture_python_hooks"]),
                 "python_hooks_above_normal_ms": paired(sync["capture_python_hooks"], sync["normal"], diff),
                 "python_hooks_vs_capture_ratio": paired(sync["capture_python_hooks"], sync["capture"], ratio)},
        "host": host,
        "optimizer_step": {"adam_ms": spread(alone["adam"]), "adafisher_ms": spread(alone["adafisher"]),
                           "vs_adam_ratio": paired(alone["adafisher"], alone["adam"], ratio)},
        "state": {"adafisher_bytes": ada_state, "adam_bytes": adam_state,
                  "vs_adam_ratio": ada_state["total"] / adam_state},
    }
    del base, ada
    free_memory(device)
    return result


def measure_pipelined(wl: Workload, device: torch.device, batch, cfg: MatrixConfig) -> dict[str, Any]:
    """Back-to-back train steps in alternating blocks: AdaFisher at each TCov and Adam."""
    trainers = {"adam": adam(wl, device, batch)}
    trainers.update({f"tcov{c}": adafisher(wl, device, batch, c) for c in TCOVS})
    trainers[SIDE_BLOCKS] = adafisher(wl, device, batch, 1)

    def setting(k: str, t: Trainer) -> contextlib.AbstractContextManager:
        """Where trainer ``k`` runs, its warm-up too: the side-stream blocks' with their statistics there."""
        return capture_stream_set(t, True) if k == SIDE_BLOCKS else contextlib.nullcontext()

    def block(k: str, t: Trainer) -> float:
        with setting(k, t):
            return elapsed_ms(functools.partial(t.steps, cfg.block), device) / cfg.block

    chosen: dict[str, Optional[bool]] = {}
    for k, t in trainers.items():
        with setting(k, t):
            t.steps(cfg.warmup)
        if k != SIDE_BLOCKS and k != "adam":  # the default ("auto") timed after its choice, as a run's later steps
            chosen[k] = choose_stream(t)["side"]
    times = interleaved({k: functools.partial(block, k, t) for k, t in trainers.items()}, cfg.blocks)
    out: dict[str, Any] = {"adam_ms": spread(times["adam"])}
    for c in TCOVS:
        k = f"tcov{c}"
        ci = ratio_of_sums_interval(times[k], times["adam"])
        out[k] = {"ms": spread(times[k]), "ratio": sum(times[k]) / sum(times["adam"]), "auto_stream_side": chosen[k],
                  "ratio_ci90": None if ci is None else list(ci),
                  "block_ratio": paired(times[k], times["adam"], ratio)}
    ci = ratio_of_sums_interval(times[SIDE_BLOCKS], times["tcov1"])
    out[SIDE_BLOCKS] = {"ms": spread(times[SIDE_BLOCKS]),
                        "vs_default_ratio": sum(times[SIDE_BLOCKS]) / sum(times["tcov1"]),
                        "ratio_ci90": None if ci is None else list(ci)}
    del trainers
    free_memory(device)
    return out


def measure(wl: Workload, device: torch.device, cfg: MatrixConfig) -> dict[str, Any]:
    """Every figure of one workload; warnings the optimizer raised are kept, once each."""
    batch = wl.batch(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result: dict[str, Any] = {"description": wl.description, "optimizer": wl.ada_cls.__name__,
                                  "baseline": f"{wl.adam_cls.__name__}(fused=True)"}
        result["statistics_floor"] = statistics_floor(wl, device)
        free_memory(device)
        result["memory"] = measure_memory(wl, device, batch, cfg)
        result.update(measure_sync_step_state(wl, device, batch, cfg))
        result["pipelined"] = measure_pipelined(wl, device, batch, cfg)
    result["warnings"] = sorted({str(w.message) for w in caught})
    result["goals"] = goals(wl, result)
    return result


def stream_named(side: Optional[bool]) -> str:
    """``capture_stream="auto"``'s choice in words."""
    return "no choice" if side is None else "chose the side stream" if side else "chose the current stream"


def goals(wl: Workload, r: dict[str, Any]) -> list[dict[str, Any]]:
    """Each figure of issue 16's goals, with the goal, its 90% interval and the verdicts."""
    p, s = r["pipelined"], r["sync"]

    def piped(c: int) -> tuple[float, Optional[list[float]]]:
        return p[f"tcov{c}"]["ratio"], p[f"tcov{c}"].get("ratio_ci90")

    def med(sp: dict[str, Any]) -> tuple[float, Optional[list[float]]]:
        return sp["median"], sp.get("ci90")

    rows: list[tuple[str, tuple[float, Optional[list[float]]], str, Optional[float]]] = [
        ("pipelined TCov=100 vs Adam", piped(100), "x", 1.02),
        ("pipelined TCov=10 vs Adam", piped(10), "x", 1.05),
        ("pipelined TCov=1 vs Adam", piped(1), "x", None),
        ("pipelined TCov=1, statistics on a side stream vs the default stream setting",
         (side_vs_default(p[SIDE_BLOCKS]), p[SIDE_BLOCKS].get("ratio_ci90")), "x", None),
        ("sync normal step vs Adam", med(s["normal_vs_adam_ratio"]), "x", 1.03)]
    if wl.capture_goal == "ms":
        rows.append(("sync capture step above normal", med(s["capture_above_normal_ms"]), "ms", CAPTURE_LIMIT_MS))
    else:
        rows.append(("sync capture step vs normal", med(s["capture_vs_normal_ratio"]), "x", CAPTURE_LIMIT_RATIO))
    rows += [("sync capture step, statistics on a side stream vs the current stream",
              med(s["side_vs_current_stream_ratio"]), "x", None)]
    if "high_vs_default_priority_ratio" in s:  # (older runs timed one side stream)
        rows.append(("sync capture step, side stream at high priority vs default priority (the default)",
                     med(s["high_vs_default_priority_ratio"]), "x", None))
    if "auto_stream" in s:  # (older runs did not time it; the stream it chose is in the detail table)
        rows.append(("sync capture step, capture_stream='auto' vs the current stream",
                     med(s["auto_vs_current_stream_ratio"]), "x", None))
        rows.append(("sync capture step above normal, capture_stream='auto'", med(s["auto_stream_above_normal_ms"]),
                     "ms", None) if wl.capture_goal == "ms" else
                    ("sync capture step vs normal, capture_stream='auto'", med(s["auto_stream_vs_normal_ratio"]),
                     "x", None))
    rows += [("sync capture step, Python hooks vs C++ gradient taps (the default)",
              med(s["python_hooks_vs_capture_ratio"]), "x", None),
             ("capture-step peak memory vs normal", (r["memory"]["capture_vs_normal_ratio"], None), "x", 1.05),
             ("capture-step peak memory, statistics on a side stream, vs normal",
              (r["memory"]["capture_side_stream_vs_normal_ratio"], None), "x", None),
             ("optimizer step vs Adam (eager)", med(r["optimizer_step"]["vs_adam_ratio"]), "x", 0.6),
             ("optimizer state vs Adam", (r["state"]["vs_adam_ratio"], None), "x", None)]
    return goal_rows([(figure, value, unit, limit, interval) for figure, (value, interval), unit, limit in rows])


def detail_table(matrix: dict[str, dict[str, Any]]) -> str:
    """Milliseconds and megabytes behind the ratios: median [p10, p90]."""
    ms = spread_text
    lines = []
    for name, r in matrix.items():
        p, s, o, m = r["pipelined"], r["sync"], r["optimizer_step"], r["memory"]
        lines.append(f"{name}: {r['description']} ({r['optimizer']} [{r['backend']}] vs {r['baseline']})")
        lines.append(f"  pipelined ms/step: Adam {ms(p['adam_ms'])}; " +
                     "; ".join(f"TCov={c} {ms(p[f'tcov{c}']['ms'])}" for c in TCOVS) +
                     f"; TCov=1 on a side stream {ms(p[SIDE_BLOCKS]['ms'])}")
        lines.append(f"  sync ms/step: Adam {ms(s['adam_ms'])}; normal {ms(s['normal_ms'])}; capture {ms(s['capture_ms'])}; "
                     + (f"on the current stream {ms(s['capture_current_stream_ms'])}; "
                        if "capture_current_stream_ms" in s else "") +
                     f"capture on a side stream {ms(s['capture_side_stream_ms'])}; "
                     + (f"on a high-priority side stream {ms(s['capture_side_high_priority_ms'])}; "
                        if "capture_side_high_priority_ms" in s else "")
                     + (f"capture_stream='auto' ({stream_named(s['auto_stream']['side'])}) "
                        f"{ms(s['capture_auto_stream_ms'])}; " if "auto_stream" in s else "") +
                     f"capture with Python hooks {ms(s['capture_python_hooks_ms'])}")
        if "capture_kept_launch_share" in s:  # (older runs did not record it)
            lines.append(f"  timed capture steps that took the kept factor update: sync {s['capture_kept_launch_share']:.0%}"
                         + (f", host phases {r['host']['capture_kept_launch_share']:.0%}" if "host" in r else ""))
        if "host" in r:
            h = r["host"]
            lines.append("  host ms (forward, backward, step): " + "; ".join(
                f"{HOST_LABELS[kind]} " + ", ".join(f"{h[kind][p]['median']:.2f}" for p in PHASES)
                for kind in HOST_KINDS))
            lines.append(f"  a capture adds per layer ({h['layers']}), us: " +
                         ", ".join(f"{h['capture_extra_us_per_layer'][p]:.0f}" for p in PHASES) + "; with Python hooks " +
                         ", ".join(f"{h['python_hooks_extra_us_per_layer'][p]:.0f}" for p in PHASES))
        launches = r.get("launches")
        if launches:
            per_op = r.get("host_us_per_added_launch")
            lines.append(f"  device operations per step: normal {launches['normal']:.0f}, capture {launches['capture']:.0f} "
                         f"(+{launches['added']:.0f}; the layers' budget {launches['budget']}, {launches['layers']})"
                         + ("" if per_op is None else f"; the capture step's extra host time per added one {per_op:.0f} us"))
        lines.append(f"  optimizer step ms: Adam {ms(o['adam_ms'])}; AdaFisher {ms(o['adafisher_ms'])}")
        floor = r.get("statistics_floor")
        if floor:
            at = ("" if floor["floor_ms"] is None
                  else f": {floor['floor_ms']:.2f} ms at the device's peak {floor['bandwidth_tbs']:.2f} TB/s")
            lines.append(f"  the statistics read {floor['inputs'] / 1e6:.0f} MB of inputs and "
                         f"{floor['gradients'] / 1e6:.0f} MB of output gradients ({floor['layers']} layers){at}")
        lines.append(f"  peak MB: Adam {m['adam']['normal_peak_mb']:.1f}; normal {m['adafisher']['normal_peak_mb']:.1f}; "
                     f"capture {m['adafisher']['capture_peak_mb']:.1f}, "
                     f"on a side stream {m['adafisher']['capture_side_stream_peak_mb']:.1f}; "
                     f"state MB: Adam {r['state']['adam_bytes'] / 2**20:.1f}, "
                     f"AdaFisher {r['state']['adafisher_bytes']['total'] / 2**20:.1f}")
        for w in r["warnings"]:
            lines.append(f"  warning: {w}")
    return "\n".join(lines)


def count_launches(wl: Workload, device: torch.device, batch) -> Optional[dict[str, Any]]:
    """``launches.capture_launches`` of AdaFisher on this workload (None on the CPU): the
    device operations a capture step adds, beside the budget its layers allow."""
    if device.type != "cuda":
        return None
    t = adafisher(wl, device, batch, NEVER)
    t.steps(2)
    for _ in range(3):  # its factors made, then its launch kept and taken: the steady state
        t.capture_step()
    counted = capture_launches(t.opt, t.step, t.capture_step)
    del t
    free_memory(device)
    return counted


def host_us_per_added_launch(r: dict[str, Any]) -> Optional[float]:
    """The capture step's extra host time (all three phases' medians) per device operation it
    adds: what each added launch costs this machine's host, where the launches were counted."""
    launches, host = r.get("launches"), r.get("host")
    if not launches or not host or launches["added"] <= 0:
        return None
    extra_ms = sum(host["capture"][p]["median"] - host["normal"][p]["median"] for p in PHASES)
    return extra_ms * 1e3 / launches["added"]


def run_matrix(names: list[str], all_workloads: dict[str, Workload], device: torch.device, cfg: MatrixConfig,
               ) -> dict[str, dict[str, Any]]:
    out = {}
    for name in names:
        print(f"== matrix: {all_workloads[name].description} on {device}", flush=True)
        out[name] = measure(all_workloads[name], device, cfg)
    return out


def add_launch_counts(matrix: dict[str, dict[str, Any]], all_workloads: dict[str, Workload],
                      device: torch.device) -> None:
    """Each measured workload's ``launches`` and ``host_us_per_added_launch`` (None on the
    CPU).  Called once every timing of the run is done: the profiler's hooks must not slow
    a timed step."""
    for name, r in matrix.items():
        wl = all_workloads[name]
        r["launches"] = count_launches(wl, device, wl.batch(device))
        r["host_us_per_added_launch"] = host_us_per_added_launch(r)
