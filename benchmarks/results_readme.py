"""Write the README's results section from the measured files in ``docs/results/`` (never by hand).

    python benchmarks/results_readme.py            # rewrite the section between the markers
    python benchmarks/results_readme.py --check    # exit 1 if the README is not what the files say

Inputs: the benchmark's JSON (``python -m lightning_cafin.bench``: the optimizer-step table, the
workload matrix, the callback's cost and the compiled train step, each rendered when present) and the convergence
study's ``convergence.json`` (``benchmarks/convergence.py``).  A file whose ``provenance``
block lacks any of command, commit, machine, torch or date is refused: a figure without
its origin does not go into the README.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

from lightning_cafin.bench.floor import capture_allowance_ms
from lightning_cafin.bench.goals import Goal, format_value
from lightning_cafin.bench.matrix import SIDE_BLOCKS, default_was_current_stream
from lightning_cafin.bench.timing import spread_text
from lightning_cafin.provenance import REQUIRED_FIELDS

REPO = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
DEFAULT_BENCH = REPO / "docs" / "results" / "bench-h200.json"
#: a later matrix-only run (``python -m lightning_cafin.bench --matrix-only``); where it exists
#: the matrix section is rendered from it, with its own provenance, the rest from the bench
DEFAULT_MATRIX = REPO / "docs" / "results" / "bench-matrix-h200-0458b79.json"
#: a second matrix run shown beside it (its values and verdicts in two more columns): the
#: latest code's run where the goal machine was not to be had, or the run before a change
DEFAULT_SECOND_MATRIX = REPO / "docs" / "results" / "bench-matrix-h100-385ef91.json"
DEFAULT_CONVERGENCE = REPO / "docs" / "results" / "convergence-h200" / "convergence.json"
DEFAULT_MULTIGPU = REPO / "docs" / "results" / "multigpu-h200"


class ProvenanceError(ValueError):
    """A results file does not say where it came from."""


def load_measured(path: Path) -> dict:
    data = json.loads(path.read_text())
    prov = data.get("provenance")
    if not isinstance(prov, dict):
        raise ProvenanceError(f"{path} has no 'provenance' block; re-run the tool that wrote it")
    missing = [k for k in REQUIRED_FIELDS if not prov.get(k) or prov.get(k) == "unknown"]
    if missing:
        raise ProvenanceError(f"{path}: provenance lacks {', '.join(missing)}; re-run the tool that wrote it "
                              "(from a git checkout, or with CAFIN_COMMIT set)")
    return data


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def _source(path: Path, prov: dict) -> str:
    return (f"Source: `{_rel(path)}`, measured on {prov['machine']} (torch {prov['torch']}) at commit "
            f"`{prov['commit'][:12]}` on {prov['date']} by `{prov['command']}`.")


def _fmt(value: Optional[float], spec: str, suffix: str = "") -> str:
    return "-" if value is None else format(value, spec) + suffix


def bench_section(path: Path) -> str:
    data = load_measured(path)
    rows = data["results"]
    lines = ["### Optimizer step, capture cost and memory", "",
             "Medians of one run; `vs fused Adam` is the step time over torch's fused Adam/AdamW step on the "
             "same workload, `vs reference` how many times faster than the `reference` backend.", "",
             "| workload | variant | step ms | vs fused Adam | vs reference | capture ms | temp MB | state MB "
             "| of copy BW |", "|---|---|---|---|---|---|---|---|---|"]
    for workload in dict.fromkeys(r["workload"] for r in rows):
        group = [r for r in rows if r["workload"] == workload]
        adam = next((r["step_ms"] for r in group if r["variant"] in ("Adam(fused)", "AdamW(fused)")), None)
        ref = next((r["step_ms"] for r in group if r["variant"].endswith("[reference]")), None)
        for r in group:
            vs_adam = r["step_ms"] / adam if adam and r["step_ms"] else None
            vs_ref = ref / r["step_ms"] if ref and r["step_ms"] and "AdaFisher" in r["variant"] else None
            lines.append(
                f"| {workload} | {r['variant']} | {_fmt(r['step_ms'], '.3f')} | {_fmt(vs_adam, '.2f', 'x')} | "
                f"{_fmt(vs_ref, '.1f', 'x')} | {_fmt(r.get('capture_ms'), '.2f')} | {_fmt(r.get('temp_mb'), '.1f')} | "
                f"{_fmt(r.get('state_mb'), '.1f')} | {_fmt(r.get('of_copy'), '.3f')} |"
            )
    lines += ["", _source(path, data["provenance"])]
    return "\n".join(lines)


def _goal_value(goal: dict) -> str:
    return format_value(goal["value"], goal["unit"])


def _goal_limit(goal: dict) -> str:
    return Goal(**goal).goal_text


def _met(goal: dict) -> str:
    """The verdict: by the value's 90% interval where the run measured one (``verdict``),
    else by the value; "within noise" where the interval spans the goal."""
    decided = goal.get("verdict")
    if decided is None:
        return "-" if goal["met"] is None else ("yes" if goal["met"] else "**no**")
    return {"met": "yes", "not met": "**no**"}.get(decided, "within noise")


def _goal_interval(goal: dict) -> str:
    interval = goal.get("interval")
    if interval is None:
        return "-"
    low, high = (format_value(v, goal["unit"]) for v in interval)
    return f"{low} to {high}"


#: under a matrix table whose run measured intervals: how its verdicts are read
INTERVAL_NOTE = ("Interval: the 90% interval of the value (for a median, its order statistics; for the pipelined "
                 "ratio of total times, a bootstrap over the paired blocks). Met: yes where the interval lies at or "
                 "under the goal, **no** where it lies wholly above it, within noise where it spans the goal: the "
                 "host's spread leaves that goal undecided by this run.")

KEPT_UNRECORDED = ("This run timed its step-synchronous C++-tap capture steps on the factor update's general path, "
                   "not on the launch a training run's repeated capture steps keep and take (`KeptLaunch`, "
                   "`lightning_cafin/capture/factors.py`): each of its rounds also timed a capture step with the "
                   "Python hooks, which then dropped the kept launch. Later runs keep it, and record the share of "
                   "their timed capture steps that took it (`docs/results/README.md`).")


def _kept_text(matrix: dict) -> Optional[str]:
    """Whether the timed step-synchronous capture steps took the kept factor update, per
    workload (None for a matrix without step-synchronous figures)."""
    synced = {name: w["sync"] for name, w in matrix["workloads"].items() if "sync" in w}
    if not synced:
        return None
    shares = {name: s.get("capture_kept_launch_share") for name, s in synced.items()}
    if any(v is None for v in shares.values()):
        return KEPT_UNRECORDED
    return ("Timed step-synchronous capture steps that took the factor update kept from the capture step before, "
            "as a training run's repeated capture steps do: " + "; ".join(f"`{n}` {v:.0%}" for n, v in shares.items())
            + ".")


#: a run from before ``capture_stream="auto"`` became the default (d617a91), whose pipelined
#: side-stream blocks were timed against the current stream (``matrix.default_was_current_stream``)
DEFAULT_WAS_CURRENT = ("In this run a capture step's statistics ran on the current stream by default: the rows "
                       "that name no stream are the current stream's. Since d617a91 the default is "
                       "`capture_stream='auto'`, whose rows are what a default optimizer now does.")
#: a run since then
DEFAULT_IS_AUTO = ("The rows that name no stream are the default, `capture_stream='auto'`, timed after its trials "
                   "chose a stream.")


def _default_stream_text(matrix: dict) -> Optional[str]:
    """Which stream the rows that name none were timed on, from the pipelined side-stream
    blocks' key (None for a matrix without them)."""
    blocks = [w["pipelined"][SIDE_BLOCKS] for w in matrix["workloads"].values() if SIDE_BLOCKS in w.get("pipelined", {})]
    if not blocks:
        return None
    return DEFAULT_WAS_CURRENT if any(default_was_current_stream(b) for b in blocks) else DEFAULT_IS_AUTO


def _launch_text(name: str, w: dict) -> str:
    launches, per_launch = w["launches"], w.get("host_us_per_added_launch")
    host = "" if per_launch is None else f", {per_launch:.0f} us of host each"
    return f"`{name}` +{launches['added']:.0f} (budget {launches['budget']}{host})"


def _run_label(prov: dict) -> str:
    """A run named in a column head: its machine (without the vendor) and short commit."""
    return f"{prov['machine'].removeprefix('NVIDIA ')} at `{prov['commit'][:7]}`"


def _second_goals(path: Optional[Path]) -> Optional[tuple[dict, dict, Path]]:
    """A second matrix run's goals by (workload, figure), the run's data and its file, or
    None where no such file (or no matrix in it) is given."""
    if path is None or not path.is_file():
        return None
    data = load_measured(path)
    matrix = data.get("matrix")
    if not matrix:
        return None
    return {(name, g["figure"]): g for name, w in matrix["workloads"].items() for g in w["goals"]}, data, path


def matrix_section(path: Path, second: Optional[Path] = None) -> Optional[str]:
    """The workload matrix (what users run, against fused Adam(W)), or None for a bench file
    without one.  ``second``: another matrix run, before or after this one, whose values and
    verdicts go in two more columns beside this run's (a change read against the run before
    it, or the latest code measured on another machine than the goals': the source lines
    say which machine and commit each run had)."""
    data = load_measured(path)
    matrix = data.get("matrix")
    if not matrix:
        return None
    other = _second_goals(second)
    cfg = matrix["config"]
    lines = ["### The workload matrix: AdaFisher against fused Adam(W) where users are", "",
             f"Per workload, AdaFisher's resolved backend against torch's `Adam`/`AdamW(fused=True)` on the same "
             f"seeded model and batch, measured side by side: pipelined train steps in interleaved blocks of "
             f"{cfg['block']} ({cfg['blocks']} per variant, captures at their real frequency), step-synchronous "
             f"steps in {cfg['sync_reps']} rotated rounds (paired medians), the optimizer step alone, peak "
             "allocated memory per step type and optimizer state.", ""]
    with_intervals = any("interval" in g for w in matrix["workloads"].values() for g in w["goals"])
    head = ["workload", "figure", "value"] + (["interval"] if with_intervals else []) + ["goal", "met"]
    if other is not None:
        head += [f"second run: {_run_label(other[1]['provenance'])}", "met there"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, w in matrix["workloads"].items():
        for goal in w["goals"]:
            cells = [name, goal["figure"], _goal_value(goal)] + ([_goal_interval(goal)] if with_intervals else [])
            cells += [_goal_limit(goal), _met(goal)]
            if other is not None:
                then = other[0].get((name, goal["figure"]))
                cells += ["-", "-"] if then is None else [_goal_value(then), _met(then)]
            lines.append("| " + " | ".join(cells) + " |")
    if with_intervals:
        lines += ["", INTERVAL_NOTE]
    for text in (_default_stream_text(matrix), _kept_text(matrix)):
        if text:
            lines += ["", text]
    counted = {name: w for name, w in matrix["workloads"].items() if w.get("launches")}
    if counted:
        lines += ["", "Device operations (kernels, copies, fills) a capture step adds to a train step, beside the budget "
                  "its layers allow (per layer one launch per statistic: a conv's input two and its output gradient's one, "
                  "a linear layer's two, a norm's one; and 8 per step), and the capture step's extra host time per added "
                  "one: " + "; ".join(_launch_text(name, w) for name, w in counted.items()) + "."]
    speed = matrix.get("host_speed")
    if speed:
        lines += ["", f"This machine's host took {speed['op_us']['median']:.1f} us to issue one torch op (a one-element "
                  f"in-place add) and {speed['alloc_us']['median']:.1f} us for a small allocation and its free, measured "
                  "before the workloads (`bench/host_speed.py`): the price of each added launch before any work of the "
                  "package's own. In those units, a step-synchronous capture step's time above a normal step's was "
                  + "; ".join(f"`{name}` {w['sync']['capture_above_normal_ms']['median'] * 1e3 / speed['op_us']['median']:.0f}"
                              for name, w in matrix["workloads"].items()) + " ops."]
    floors = _floors_text(matrix)
    if floors:
        lines += ["", "The least device time a capture step's statistics can take, each captured layer's input and "
                  f"output gradient read once at this device's peak memory bandwidth ({floors}. On the current "
                  "stream no kernel takes a capture step below its normal step plus this; where the floor comes near "
                  "what the goal allows, only overlap with the backward pass (the side stream) or reading fewer "
                  "bytes can meet it."]
    lines += ["", "Workloads: " + "; ".join(f"`{n}` {w['description']} ({w['backend']})"
                                          for n, w in matrix["workloads"].items()) + ".",
              "", _source(path, data["provenance"])]
    if other is not None:
        then_kept = _kept_text(other[1]["matrix"])
        then_floors = _floors_text(other[1]["matrix"])
        lines += ["", "The second run's columns: " + _source(other[2], other[1]["provenance"]).removeprefix("Source: ")
                  + (f" {then_kept}" if then_kept else "")
                  + (f" Its statistics floor, at that device's peak bandwidth ({then_floors}." if then_floors else "")]
    return "\n".join(lines)


def _floors_text(matrix: dict) -> Optional[str]:
    """"<bandwidth> TB/s; `floor.py`): <each workload's floor>", or None for a run that
    knew no bandwidth (a CPU run)."""
    floors = {n: w["statistics_floor"] for n, w in matrix["workloads"].items()
              if (w.get("statistics_floor") or {}).get("floor_ms") is not None}
    if not floors:
        return None
    bandwidth = next(iter(floors.values()))["bandwidth_tbs"]
    return (f"{bandwidth:.2f} TB/s; `lightning_cafin/bench/floor.py`): "
            + "; ".join(_floor_text(n, f, matrix["workloads"][n]) for n, f in floors.items()))


def _floor_text(name: str, floor: dict, w: dict) -> str:
    """One workload's statistics floor, beside what its capture-step goal allows."""
    text = f"`{name}` {floor['floor_ms']:.2f} ms ({(floor['inputs'] + floor['gradients']) / 1e9:.2f} GB"
    allowed = capture_allowance_ms(w)
    return text + (")" if allowed is None else f"; the goal allows {allowed:.2f} ms)")


def _not_measured(title: str, path: Path, key: str) -> str:
    return "\n".join([title, "", f"Not measured yet: `{_rel(path)}` has no `{key}` entry (run "
                      f"`python -m lightning_cafin.bench --only {key}` on a GPU and merge its `{key}` "
                      "entry, or re-run the whole bench)."])


def _spread_ms(sp: Optional[dict]) -> str:
    """``median [p10, p90]`` of a spread, in ms (``-`` when not measured)."""
    return "-" if sp is None else spread_text(sp)


def callback_section(path: Path) -> str:
    """The callback's cost (``python -m lightning_cafin.bench --only callback``), or a note that the file lacks it."""
    data = load_measured(path)
    title = "### The callback's cost: a Lightning step with `CAFINCallback` against the same step without"
    r = data.get("callback")
    if not r:
        return _not_measured(title, path, "callback")
    cfg, q, blocks = r["config"], r["quiet_ratio"], r["blocks"]

    lines = [title, "",
             f"{r['description']} ({r['backend']}): two fits on the same seeded model and in-memory batch, "
             f"TensorBoard logging every {cfg['log_every_n_steps']} steps, TCov {cfg['TCov']}, taking turns in "
             f"blocks of {cfg['block']} steps ({cfg['blocks']} per fit after {cfg['warmup']} warm-up steps). "
             f"The first figure is the median paired per-block ratio over the {blocks['quiet']} of {blocks['timed']} "
             f"blocks with no logging, capture or shadow step (p10 {q['p10']:.3f}x, p90 {q['p90']:.3f}x); the "
             "second counts every timed step; the host syncs are the dashboard's own, counted per step.", "",
             "| figure | value | goal | met |", "|---|---|---|---|"]
    for goal in r["goals"]:
        lines.append(f"| {goal['figure']} | {_goal_value(goal)} | {_goal_limit(goal)} | {_met(goal)} |")
    lines += ["", "| ms, median [p10, p90] | value |", "|---|---|",
              f"| bare step (no logging, capture or shadow) | {_spread_ms(r['bare_ms'])} |",
              f"| step with the callback, the same steps | {_spread_ms(r['callback_ms'])} |"]
    lines += [f"| a {tag} step: callback above bare | {_spread_ms(sp)} |" for tag, sp in r["extra_ms"].items()]
    lines += ["", _source(path, data["provenance"])]
    return "\n".join(lines)


def compiled_section(path: Path) -> str:
    """The compiled train step (``python -m lightning_cafin.bench --only compiled``), or a note that the file lacks it."""
    data = load_measured(path)
    title = "### A compiled train step: AdaFisher at TCov=100 against fused Adam(W), both under `torch.compile`"
    r = data.get("compiled")
    if not r:
        return _not_measured(title, path, "compiled")
    cfg = r["config"]

    lines = [title, "",
             f"Per workload, two copies of the same seeded model, each `torch.compile(model)` ({cfg['backend']}), "
             f"one trained by AdaFisher (TCov {cfg['TCov']}, its resolved backend), one by torch's fused Adam/AdamW; "
             f"{cfg['warmup']} warm-up steps each (compilation and forced capture steps), then back-to-back train "
             f"steps in alternating blocks of {cfg['block']} ({cfg['blocks']} per variant, captures at their real "
             "frequency). The ratio is total time over total time; the per-block ratio is the median of the paired "
             "blocks.", "",
             "| workload | figure | value | goal | met |", "|---|---|---|---|---|"]
    for name, w in r["workloads"].items():
        for goal in w["goals"]:
            lines.append(f"| {name} | {goal['figure']} | {_goal_value(goal)} | {_goal_limit(goal)} | {_met(goal)} |")
    lines += ["", "| workload | Adam(W) ms/step | AdaFisher ms/step | per-block ratio | compile s (Adam / AdaFisher) "
              "| graphs (Adam / AdaFisher) |", "|---|---|---|---|---|---|"]
    for name, w in r["workloads"].items():
        c = w["compile"]
        lines.append(f"| {name} | {_spread_ms(w['adam_ms'])} | {_spread_ms(w['adafisher_ms'])} | "
                     f"{w['block_ratio']['median']:.3f}x [{w['block_ratio']['p10']:.3f}, {w['block_ratio']['p90']:.3f}] | "
                     f"{c['adam']['seconds']:.0f} / {c['adafisher']['seconds']:.0f} | "
                     f"{c['adam']['graphs']} / {c['adafisher']['graphs']} |")
    lines += ["", "Workloads: " + "; ".join(f"`{n}` {w['description']} ({w['optimizer']} [{w['backend']}] vs "
                                          f"{w['baseline']})" for n, w in r["workloads"].items()) + ".",
              "", _source(path, data["provenance"])]
    return "\n".join(lines)


def multigpu_section(folder: Path) -> str:
    """``benchmarks/multigpu.py``'s runs (one file per number of GPUs), or a note that none is committed."""
    files = sorted(folder.glob("multigpu-*.json"), key=lambda f: int(f.stem.split("-")[1])) if folder.is_dir() else []
    head = "### Several GPUs: DDP and FSDP2 against fused Adam(W)"
    if not files:
        return f"{head}\n\nNot measured yet (`torchrun --nproc-per-node N benchmarks/multigpu.py --out {_rel(folder)}`)."
    lines = [head, "", "| workload / strategy | GPUs | TCov=100 vs Adam | TCov=10 vs Adam | samples/s per GPU "
             "(Adam / AdaFisher) | `step()` collectives, normal / capture | peak GB (Adam / TCov=10) | parity |",
             "|---|---:|---|---|---|---|---|---:|"]
    sources, nondeterministic = [], False
    for f in files:
        data = load_measured(f)
        sources.append(_source(f, data["provenance"]))
        for name, r in data["results"].items():
            def ratio(key: str, r: dict = r) -> str:
                q = r[f"ratio adafisher {key} vs adam"]
                return f"{q['median']:.3f}x [{q['p10']:.2f}, {q['p90']:.2f}]"
            tput, comm, peak = r["samples_per_s_per_gpu"], r["communication"], r["peak_bytes"]
            gb = " / ".join("-" if peak[k] is None else f"{peak[k] / 1e9:.2f}" for k in ("adam", "adafisher TCov=10"))
            par = r.get("parity_max_rel")
            nondeterministic |= par is not None and par > 1e-3 and not r.get("parity_deterministic")
            lines.append(
                f"| {name} | {data['world_size']} | {ratio('TCov=100')} | {ratio('TCov=10')} | "
                f"{tput['adam']:.0f} / {tput['adafisher TCov=100']:.0f} | "
                f"{comm['normal']['collectives']} ({comm['normal']['bytes']} B) / "
                f"{comm['capture']['collectives']} ({comm['capture']['bytes']} B) | {gb} | "
                f"{'-' if par is None else f'{par:.1e}'} |")
    lines += ["", "Ratios: median over interleaved blocks [p10, p90]. Parity: largest relative difference, over 7 "
              "steps at TCov = 2, between the run and one replica trained on the same micro-batches. With one GPU "
              "the statistics need no all-reduce (0 collectives); weak-scaling efficiency needs runs on several.", ""]
    if nondeterministic:
        lines += ["A parity far above float32 rounding in a run that did not record `parity_deterministic` is cuDNN's "
                  "nondeterministic convolution kernels: AdaFisher's first steps move each element by about "
                  "lr / Lambda, and BatchNorm amplifies last-bit differences to order one within a few steps. "
                  "`benchmarks/multigpu.py` now checks parity with deterministic cuDNN and no TF32; re-run it.", ""]
    return "\n".join(lines + sources)


def convergence_section(path: Path) -> str:
    data = load_measured(path)
    cfg = data["config"]
    size = cfg.get("train_size") or 60000
    lines = ["### Convergence: ResNet-18 on Fashion-MNIST", "",
             f"{cfg['epochs']} epochs, batch {cfg['batch_size']}, cosine schedule, {size:,} training images; "
             f"test accuracy on {cfg.get('test_size') or 10000:,} images; time to {cfg['target_accuracy']:.0%} "
             "test accuracy counts training time only.", "",
             "| optimizer | final test accuracy (mean ± std) | seeds | epoch s (median) | time to target s "
             "| optimizer step share |", "|---|---|---|---|---|---|"]
    for name, s in data["summary"].items():
        target = (f"{s['time_to_target_s_mean']:.1f} ({s['runs_reaching_target']}/{len(s['seeds'])} runs)"
                  if s["time_to_target_s_mean"] is not None else "not reached")
        lines.append(f"| {name} | {s['final_test_accuracy_mean']:.4f} ± {s['final_test_accuracy_std']:.4f} | "
                     f"{len(s['seeds'])} | {s['epoch_s_median']:.2f} | {target} | {s['step_share_mean']:.1%} |")
    for name, a in data.get("agreement", {}).items():
        lines += ["", f"{name} against {a['against']}: mean difference {a['mean_difference']:+.4f}, tolerance "
                  f"{a['tolerance']:.4f} ({data.get('agreement_rule', '')}): "
                  f"**{'agree' if a['agree'] else 'DO NOT AGREE'}**."]
    png = path.with_suffix(".png")
    if png.is_file():
        lines += ["", f"![convergence curves]({_rel(png)})"]
    lines += ["", _source(path, data["provenance"])]
    return "\n".join(lines)


def results_section(bench: Path, convergence: Path, multigpu: Path = DEFAULT_MULTIGPU,
                    matrix_file: Optional[Path] = None, second_matrix: Optional[Path] = None) -> str:
    """The README's results section; ``matrix_file`` (a matrix-only bench run), where given
    and present, renders the matrix section instead of ``bench``'s matrix, with
    ``second_matrix`` (another run), where present, beside it."""
    parts = [BEGIN, "## Results", "",
             "_Generated by `python benchmarks/results_readme.py` from the files named below; do not edit._", "",
             bench_section(bench), ""]
    matrix = matrix_section(matrix_file if matrix_file is not None and matrix_file.is_file() else bench, second_matrix)
    if matrix is not None:
        parts += [matrix, ""]
    parts += [callback_section(bench), "", compiled_section(bench), "", multigpu_section(multigpu), ""]
    if convergence.is_file():
        parts.append(convergence_section(convergence))
    else:
        parts.append(f"No convergence study is committed yet (`{_rel(convergence)}`: "
                     "run `python benchmarks/convergence.py --out docs/results/convergence-h200` on a GPU).")
    parts.append(END)
    return "\n".join(parts)


def splice(readme: str, section: str, begin: str = BEGIN, end: str = END, anchor: str = "\n## Layout") -> str:
    """``readme`` with the text between ``begin`` and ``end`` replaced by ``section`` (which
    carries both markers), or ``section`` inserted before ``anchor`` the first time."""
    if begin in readme and end in readme:
        head, rest = readme.split(begin, 1)
        _, tail = rest.split(end, 1)
        return head + section + tail
    if anchor in readme:
        head, tail = readme.split(anchor, 1)
        return head.rstrip("\n") + "\n\n" + section + "\n" + anchor + tail
    return readme.rstrip("\n") + "\n\n" + section + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench", type=Path, default=DEFAULT_BENCH)
    ap.add_argument("--matrix", type=Path, default=DEFAULT_MATRIX,
                    help="a matrix-only bench run rendered as the matrix section where the file exists "
                         "(default: %(default)s); the bench file's matrix otherwise")
    ap.add_argument("--second-matrix", type=Path, default=DEFAULT_SECOND_MATRIX,
                    help="another matrix run, whose values and verdicts go beside its own where the file "
                         "exists (default: %(default)s)")
    ap.add_argument("--convergence", type=Path, default=DEFAULT_CONVERGENCE)
    ap.add_argument("--multigpu", type=Path, default=DEFAULT_MULTIGPU)
    ap.add_argument("--readme", type=Path, default=REPO / "README.md")
    ap.add_argument("--check", action="store_true", help="do not write; exit 1 if the README is out of date")
    args = ap.parse_args(argv)
    try:
        section = results_section(args.bench, args.convergence, args.multigpu, args.matrix, args.second_matrix)
    except ProvenanceError as exc:
        print(f"results_readme: {exc}", file=sys.stderr)
        return 2
    current = args.readme.read_text()
    wanted = splice(current, section)
    if args.check:
        if wanted != current:
            print(f"{args.readme} is out of date with the results files: run python benchmarks/results_readme.py",
                  file=sys.stderr)
            return 1
        return 0
    args.readme.write_text(wanted)
    print(f"wrote the results section of {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
