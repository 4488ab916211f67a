"""What a capture step adds to a train step, kernel by kernel, on the bench's workloads.

The bench (``python -m lightning_cafin.bench``) says *how much* a capture step costs
above a normal one (``sync.capture_above_normal_ms``) and how the host's share splits
over the forward, backward and step (``host``); this says *where the device's share
goes*.  For each workload of the matrix (``lightning_cafin.bench.workloads``), trained
with AdaFisher(W) as the bench trains it (the default backend, TCov 100, capture steps
forced with ``capture_next_step``), it

* times synchronised train steps, normal and capture interleaved in pairs (median of
  the pairs' differences, the bench's ``extra_ms``);
* profiles ``--steps`` normal and as many capture steps with ``torch.profiler``, in
  ``--rounds`` alternating rounds, and sums each kernel's device time per step (on a
  machine without a GPU: each CPU op's own time, a smoke run);
* prints the kernels whose time per step a capture step changes most, the device time
  of the package's own kernels (``lightning_cafin::``) and what the others add;
* times a forward's host cost per captured layer (``--reps`` interleaved rounds, medians):
  a normal step's, a capture step's with every call declined inside ``no_capture()``
  (what the armed hooks cost by themselves), with Python hooks and with the C++ taps;
* says, at the end of each phase (forward with the loss, backward, optimizer step) of a
  synchronised normal and capture step, how far the host and the device have got
  (host clock; the device's arrival at the host's mark by a CUDA event recorded there):
  where the device arrives just after the host it was waiting for the host, so the host's
  extra work up to that mark is on the step's critical path; where it arrives well after,
  the host ran ahead (``--reps`` interleaved rounds, medians);
* lists, for each of those phases, the host operations (``torch.profiler``, host only)
  whose time per step a capture step changes most, the package's own C++ calls among them
  (``lightning_cafin::tap``, ``lightning_cafin::layer_stats``, ...), and the phase's host
  time outside every recorded operation (``--reps`` steps of each kind, interleaved);
* profiles the host (``cProfile``) in a capture step's forward (with the loss) and in its
  ``optimizer.step()``, each from a synchronised device, and prints the functions that
  take the most of it (the bench's ``host`` says how much each phase adds per layer).

    python scripts/profile_capture.py --workload gpt --out $OUT
    python scripts/profile_capture.py --workload all --out $OUT      # every workload, in turn
    python scripts/profile_capture.py --quick --workload resnet18   # tiny models, any machine

Each workload's report is printed and written to ``<out>/profile-capture-<workload>.txt``.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import statistics
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightning_cafin import no_capture  # noqa: E402
from lightning_cafin.bench import MATRIX_WORKLOADS, workloads  # noqa: E402
from lightning_cafin.bench.launches import is_device_operation  # noqa: E402
from lightning_cafin.bench.matrix import PHASES, Trainer, adafisher  # noqa: E402
from lightning_cafin.bench.timing import free_memory, kernel_name, sync, time_ms  # noqa: E402
from lightning_cafin.capture import taps  # noqa: E402
from lightning_cafin.provenance import machine_name  # noqa: E402

OURS = "lightning_cafin::"  # the namespace of the package's kernels in their names
NAME_WIDTH = 96


def event_times(trainer: Trainer, capture: bool, steps: int, device: torch.device) -> dict[str, tuple[int, float]]:
    """``{name: (calls, microseconds)}`` over ``steps`` train steps: each kernel's device time
    on a GPU, each op's own host time on a CPU."""
    on_gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    sync(device)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            trainer.capture_step() if capture else trainer.step()
        sync(device)
    out: dict[str, tuple[int, float]] = {}
    for evt in prof.key_averages():
        us = counted_us(evt, on_gpu)
        if us > 0:
            calls, total = out.get(evt.key, (0, 0.0))
            out[evt.key] = (calls + evt.count, total + us)
    return out


def counted_us(evt: Any, on_gpu: bool) -> float:
    """The microseconds ``event_times`` counts for one averaged profiler event: on a GPU a
    kernel's (or copy's) own device time, nothing for host ops (their kernels are listed on
    their own) and nothing for regions the host marked (``Optimizer.step#AdaFisherW.step``:
    on the device such a region spans kernels listed on their own and the gaps between
    them, so it counted the step kernel twice and the host's gaps as device time); on a CPU
    each op's own host time."""
    if not on_gpu:
        return float(evt.self_cpu_time_total)
    if not is_device_operation(evt):
        return 0.0
    us = getattr(evt, "self_device_time_total", None)
    return float(evt.self_cuda_time_total if us is None else us)


def accumulate(into: dict[str, list[float]], times: dict[str, tuple[int, float]], steps: int) -> None:
    """Add one round's per-step calls and milliseconds to ``into`` ({name: [calls, ms]})."""
    for name, (calls, us) in times.items():
        row = into.setdefault(name, [0.0, 0.0])
        row[0] += calls / steps
        row[1] += us / 1e3 / steps


def paired_extra_ms(normal: Callable[[], None], capture: Callable[[], None], device: torch.device,
                    reps: int) -> tuple[float, float, float]:
    """Medians of a synchronised normal step, a capture step and their paired difference."""
    pairs = [(time_ms(normal, device), time_ms(capture, device)) for _ in range(reps)]
    return (statistics.median(a for a, _ in pairs), statistics.median(b for _, b in pairs),
            statistics.median(b - a for a, b in pairs))


def report(name: str, description: str, layers: int, device: torch.device, timing: tuple[float, float, float],
           normal: dict[str, list[float]], capture: dict[str, list[float]], rounds: int, top: int) -> list[str]:
    unit = "device time" if device.type == "cuda" else "host time of each op (no GPU: a smoke run)"
    per_round = {k: {n: [c / rounds, ms / rounds] for n, (c, ms) in d.items()} for k, d in
                 (("normal", normal), ("capture", capture))}
    n, c = per_round["normal"], per_round["capture"]
    total_n, total_c = sum(v[1] for v in n.values()), sum(v[1] for v in c.values())
    ours_n = sum(v[1] for k, v in n.items() if OURS in k)
    ours_c = sum(v[1] for k, v in c.items() if OURS in k)
    lines = [
        f"workload {name}: {description}; {layers} layers with factors; {machine_name(device)}, torch {torch.__version__}",
        f"synchronised train step (median of paired steps): normal {timing[0]:.3f} ms, capture {timing[1]:.3f} ms, "
        f"capture - normal {timing[2]:+.3f} ms",
        f"{unit} per step: normal {total_n:.3f} ms, capture {total_c:.3f} ms ({total_c - total_n:+.3f}); "
        f"the package's kernels: normal {ours_n:.3f} ms, capture {ours_c:.3f} ms ({ours_c - ours_n:+.3f}); "
        f"everything else {(total_c - ours_c) - (total_n - ours_n):+.3f} ms",
        "",
        f"the {top} largest changes per step (capture - normal), then each side's calls per step:",
    ]
    return lines + change_rows(n, c, top)


def change_rows(normal: dict[str, list[float]], capture: dict[str, list[float]], top: int) -> list[str]:
    """The ``top`` names whose milliseconds per step a capture step changes most ({name:
    [calls, ms]} per step, each side), largest change first, under their header: change,
    each side's ms and calls."""
    n, c = normal, capture
    rows = sorted(set(n) | set(c), key=lambda k: -abs(c.get(k, [0, 0])[1] - n.get(k, [0, 0])[1]))[:top]
    lines = [f"{'change ms':>10} {'capture ms':>11} {'calls':>7} {'normal ms':>10} {'calls':>7}  name"]
    for k in rows:
        cc, cm = c.get(k, [0.0, 0.0])
        nc, nm = n.get(k, [0.0, 0.0])
        short = kernel_name(k) if k.startswith("void ") else k  # (a kernel's signature says nothing here)
        short = short if len(short) <= NAME_WIDTH else short[: NAME_WIDTH - 3] + "..."
        lines.append(f"{cm - nm:+10.3f} {cm:11.3f} {cc:7.1f} {nm:10.3f} {nc:7.1f}  {short}")
    return lines


#: the forwards ``host_forward_per_layer`` times: (label, a capture step?, the block it runs in)
FORWARDS: tuple[tuple[str, bool, Callable[[], contextlib.AbstractContextManager]], ...] = (
    ("normal step", False, contextlib.nullcontext),
    ("capture step, every call declined (no_capture)", True, no_capture),
    ("capture step, Python hooks", True, lambda: taps.using(False)),
    ("capture step, C++ taps", True, lambda: taps.using(True)),
)


def host_forward_per_layer(trainer: Trainer, layers: int, reps: int) -> list[str]:
    """Host microseconds per captured layer of a train step's forward (with the loss), from a
    synchronised device, for each of ``FORWARDS`` in turn, ``reps`` rounds: what the armed
    hooks cost by themselves, and what each way of taking the statistics adds to that."""
    times: dict[str, list[float]] = {label: [] for label, _, _ in FORWARDS}
    for _ in range(reps):
        for label, capture, block in FORWARDS:
            with block():
                forward_ms = trainer.host_phases(capture)[0]  # the bench's host timing of a step's phases
            times[label].append(forward_ms * 1e3 / layers)
    med = {label: statistics.median(v) for label, v in times.items()}
    base = med[FORWARDS[0][0]]
    lines = ["", f"host, a forward (with the loss) per captured layer, median of {reps} interleaved rounds:"]
    lines += [f"  {label:48s} {us:8.1f} us  ({us - base:+.1f} above a normal step)" for label, us in med.items()]
    return lines


def phase_ends(trainer: Trainer, capture: bool, device: torch.device) -> tuple[list[float], Optional[list[float]]]:
    """One synchronised train step (the bench's ``host_phases``): milliseconds from its start
    to the end of each of ``PHASES`` on the host, and when the device reached the same marks
    (CUDA events recorded there; None on a CPU, where the host does the work itself)."""
    # made before the step: only their records fall inside it
    events = [torch.cuda.Event(enable_timing=True) for _ in range(4)] if device.type == "cuda" else []
    phases = trainer.host_phases(capture, mark=(lambda i: events[i].record()) if events else None)
    host = [sum(phases[: i + 1]) for i in range(len(PHASES))]
    return host, ([events[0].elapsed_time(e) for e in events[1:]] if events else None)


def phase_ends_report(trainer: Trainer, device: torch.device, reps: int) -> list[str]:
    """``phase_ends`` of normal and capture steps, interleaved, ``reps`` rounds: medians."""
    runs: dict[str, list[tuple[list[float], Optional[list[float]]]]] = {"normal": [], "capture": []}
    for _ in range(reps):
        for kind in runs:
            runs[kind].append(phase_ends(trainer, kind == "capture", device))
    lines = ["", f"phase ends, ms from a synchronised step's start, host / device (the device's arrival at the host's "
                 f"mark), median of {reps} interleaved rounds:",
             "  " + " " * 8 + "".join(f"{p:>18s}" for p in PHASES)]
    for kind, got in runs.items():
        cells = []
        for i in range(len(PHASES)):
            host = statistics.median(h[i] for h, _ in got)
            dev = "      -" if got[0][1] is None else f"{statistics.median(d[i] for _, d in got if d is not None):7.2f}"
            cells.append(f"{host:8.2f} / {dev}")
        lines.append(f"  {kind:8s}" + "".join(f"{c:>18s}" for c in cells))
    return lines


#: the profiler ranges ``host_operations`` opens around a step's phases (one per entry of ``PHASES``)
PHASE_RANGE = "profile_capture.phase:"


def phase_ranges() -> Callable[[int], None]:
    """``Trainer.host_phases``' ``mark``: a profiler range around each of ``PHASES`` (before the
    host's i-th timestamp, phase i-1's range closes and phase i's opens)."""
    ranges = [torch.profiler.record_function(PHASE_RANGE + ph) for ph in PHASES]

    def mark(i: int) -> None:
        if i > 0:
            ranges[i - 1].__exit__(None, None, None)
        if i < len(ranges):
            ranges[i].__enter__()

    return mark


def host_operations(trainer: Trainer, steps: int, top: int) -> list[str]:
    """Per phase of a train step (``PHASES``: the forward with the loss, the backward, the
    optimizer step), the host operations whose own time a capture step changes most, under
    ``torch.profiler`` (host activity only): each operation's calls and own host time per
    step over ``steps`` normal and as many capture steps, interleaved, each from a
    synchronised device (the bench's ``host_phases``, a profiler range around each phase); and
    each phase's host time outside every recorded operation (Python, hook code that records
    nothing).  An operation belongs to the phase its start falls in (the backward's run on
    autograd's own thread).  The package's C++ calls are recorded as ``lightning_cafin::<op>``
    (``csrc/record_op.h``): a C++ tap's own host time is a row of its own, apart from the torch
    operations it runs.  The profiler adds its own cost to every recorded operation, so the
    calls are exact and the times a relative picture."""
    tables: dict[str, dict[str, dict[str, list[float]]]] = {ph: {"normal": {}, "capture": {}} for ph in PHASES}
    outside: dict[str, dict[str, list[float]]] = {ph: {"normal": [], "capture": []} for ph in PHASES}
    for _ in range(steps):
        for kind in ("normal", "capture"):
            if kind == "normal" and trainer.opt.capture_due:
                trainer.step()  # the schedule's own capture step, unprofiled: the next is a normal one
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                trainer.host_phases(kind == "capture", mark=phase_ranges())
            events = list(prof.events())
            spans = {e.name[len(PHASE_RANGE):]: e.time_range for e in events if e.name.startswith(PHASE_RANGE)}
            recorded = dict.fromkeys(PHASES, 0.0)
            for e in events:
                phase = next((ph for ph, span in spans.items() if span.start <= e.time_range.start < span.end), None)
                if phase is None or e.name.startswith(PHASE_RANGE):
                    continue
                row = tables[phase][kind].setdefault(e.name, [0.0, 0.0])
                row[0] += 1 / steps
                row[1] += e.self_cpu_time_total / 1e3 / steps
                recorded[phase] += e.self_cpu_time_total
            for ph, span in spans.items():
                outside[ph][kind].append((span.end - span.start - recorded[ph]) / 1e3)
    lines = ["", f"host operations per phase, per step over {steps} normal and {steps} capture steps, interleaved "
                 f"(torch.profiler, host only; its own cost is in every operation's time):"]
    for ph in PHASES:
        n_out, c_out = (statistics.median(outside[ph][k]) for k in ("normal", "capture"))
        lines += [f"{ph}: outside every recorded operation (Python, hooks' own code), median: normal {n_out:.3f} ms, "
                  f"capture {c_out:.3f} ms ({c_out - n_out:+.3f}); the {top} largest changes per step "
                  f"(capture - normal), then each side's calls per step:",
                  *change_rows(tables[ph]["normal"], tables[ph]["capture"], top)]
    return lines


def host_profile(trainer: Trainer, steps: int, top: int) -> list[str]:
    """The functions taking the most host time in ``steps`` capture steps' forwards and
    optimizer steps (each phase profiled from a synchronised device, the other not)."""
    phases = {"forward (with the loss)": cProfile.Profile(), "optimizer.step()": cProfile.Profile()}
    forward, step = phases.values()
    dev = trainer.device
    for _ in range(steps):
        trainer.opt.capture_next_step()
        trainer.opt.zero_grad()
        sync(dev)
        forward.enable()
        loss = trainer.wl.loss(trainer.model, trainer.x, trainer.y, dev)
        forward.disable()
        loss.backward()
        sync(dev)
        step.enable()
        trainer.opt.step()
        step.disable()
        sync(dev)
    lines = []
    for name, prof in phases.items():
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out)
        lines += ["", f"host, a capture step's {name}: {stats.total_tt * 1e3 / steps:.3f} ms per step under cProfile "
                  f"(its overhead included); the {top} functions with the most own time:"]
        stats.sort_stats("tottime").print_stats(top)
        rows = [r for r in out.getvalue().splitlines() if _is_stats_row(r)]
        lines += ["  " + r.strip() for r in rows[:top]]
    return lines


def _is_stats_row(line: str) -> bool:
    """A function's row of a pstats table: ncalls, then four times (not its header lines)."""
    parts = line.split()
    try:
        return len(parts) >= 6 and all(float(p) >= 0 for p in parts[1:5])
    except ValueError:
        return False


def profile_workload(name: str, device: torch.device, quick: bool, steps: int, rounds: int, reps: int,
                     top: int) -> list[str]:
    wl = workloads(device, quick)[name]
    trainer = adafisher(wl, device, wl.batch(device), TCov=100)
    for _ in range(3):  # the first steps build plans, pick kernels and tune cuDNN
        trainer.step()
        trainer.capture_step()
    layers = len(trainer.opt.factors())
    timing = paired_extra_ms(trainer.step, trainer.capture_step, device, reps)
    normal: dict[str, list[float]] = {}
    capture: dict[str, list[float]] = {}
    for _ in range(rounds):
        accumulate(normal, event_times(trainer, False, steps, device), steps)
        accumulate(capture, event_times(trainer, True, steps, device), steps)
    lines = report(name, wl.description, layers, device, timing, normal, capture, rounds, top)
    lines += host_forward_per_layer(trainer, layers, reps)
    lines += phase_ends_report(trainer, device, reps)
    lines += host_operations(trainer, reps, min(top, 15))
    lines += host_profile(trainer, steps, min(top, 15))
    del trainer
    free_memory(device)
    return lines


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="all", help=f"one of {', '.join(MATRIX_WORKLOADS)}, or all (default)")
    ap.add_argument("--out", default="profile_out", help="folder for profile-capture-<workload>.txt")
    ap.add_argument("--steps", type=int, default=5, help="steps of each kind per profiled round")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of normal and capture steps")
    ap.add_argument("--reps", type=int, default=20, help="paired synchronised steps for the timing line")
    ap.add_argument("--top", type=int, default=30, help="rows of the kernel table")
    ap.add_argument("--quick", action="store_true", help="the tiny models (a smoke run on any machine)")
    args = ap.parse_args(argv)
    names = list(MATRIX_WORKLOADS) if args.workload == "all" else [args.workload]
    unknown = [n for n in names if n not in MATRIX_WORKLOADS]
    if unknown:
        ap.error(f"--workload must be one of {', '.join(MATRIX_WORKLOADS)} or all, got {args.workload!r}")
    for flag in ("steps", "rounds", "reps", "top"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        print(f"profiling {name} ...", flush=True)
        lines = profile_workload(name, device, args.quick, args.steps, args.rounds, args.reps, args.top)
        text = "\n".join(lines) + "\n"
        (out / f"profile-capture-{name}.txt").write_text(text)
        print(text, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
