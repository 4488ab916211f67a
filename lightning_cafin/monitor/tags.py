"""Every tag the dashboard writes, the chart that shows it, and the Custom Scalars layout.

Curves that belong in one chart are *series*: TensorBoard runs of their own under the
training run's folder (``<log_dir>/cafin/<series>``), so TensorBoard gives each its own
colour and lists it by name.  A chart's tag is the same in each of its series.
``series=()`` means the training run itself.  The README's tag table is generated from
this list (``readme_table``) and a test checks it against the tags a run writes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

CAFIN = "CAFIN"
PRECONDITIONER = "Preconditioner"
ALL_LAYERS = "all_layers"  # the Preconditioner series over every layer of the model
LAYER_TYPES = "<layer type>"  # stands for one series per layer type (Conv2d, Linear, ...)


@dataclass(frozen=True)
class Chart:
    key: str
    tag: str
    section: str
    title: str
    series: tuple[str, ...]
    meaning: str


CHARTS: tuple[Chart, ...] = (
    Chart("step_ms", "cafin/step_ms", CAFIN, "update latency, mean over the logging window (ms)", ("live", "baseline"),
          "the parameter update inside step() (CUDA events on a GPU, wall clock on a CPU); baseline: the shadow "
          "update on copies, on the steps that sample it"),
    Chart("step_ms_max", "cafin/step_ms_max", CAFIN, "update latency, max over the logging window (ms)", ("live",),
          "the slowest update of the window"),
    Chart("capture_ms", "cafin/capture_ms", CAFIN, "capture step: factor work inside step() (ms)", ("device", "host"),
          "statistics join + reduction + factor update of a capture step, mean over the window's capture steps; "
          "device: CUDA events (GPU only), host: wall clock"),
    Chart("update_alloc_mb", "cafin/update_alloc_mb", CAFIN, "memory allocated by one update (MB)",
          ("live", "baseline"),
          "bytes the update asked the allocator for (allocator counter delta on a GPU; new tensors on a CPU), "
          "on the steps that sample the baseline"),
    Chart("memory_saved_mb", "cafin/memory_saved_mb", CAFIN, "memory saved per update: baseline - live (MB)", (),
          "the difference of the two series above, same step"),
    Chart("divergence_rel", "cafin/divergence_rel", CAFIN, "divergence {compared}: max |dp| / max |p| (ratio)", (),
          "how far the live update landed from the baseline replayed on copies with the same factors"),
    Chart("divergence_max_abs", "cafin/divergence_max_abs", CAFIN, "divergence {compared}: max |dp| (parameter units)",
          (), "the largest absolute difference between live and baseline parameters"),
    Chart("skipped_steps", "cafin/skipped_steps", CAFIN, "steps skipped by the loss scaler (count, cumulative)", (),
          "found_inf steps the host has learnt of"),
    Chart("F_max", "cafin/precond/F_max_per_Lambda", PRECONDITIONER,
          "F = S*H + Lambda: largest element (in units of Lambda)", (ALL_LAYERS, LAYER_TYPES),
          "after the latest capture read on this logging step; 1 means the curvature term adds nothing"),
    Chart("F_min", "cafin/precond/F_min_per_Lambda", PRECONDITIONER,
          "F = S*H + Lambda: smallest element (in units of Lambda)", (ALL_LAYERS, LAYER_TYPES),
          "the other end of the range"),
    Chart("lambda_dominated", "cafin/precond/lambda_dominated", PRECONDITIONER,
          "share of elements where S*H < Lambda (fraction)", (ALL_LAYERS, LAYER_TYPES),
          "where the damping outweighs the curvature estimate"),
    Chart("factor_change", "cafin/precond/factor_change", PRECONDITIONER,
          "change of S*H since the previous capture (relative Frobenius norm, max over layers)",
          (ALL_LAYERS, LAYER_TYPES), "||S H^T - S0 H0^T|| / ||S0 H0^T||; absent after the first capture"),
    Chart("f_one", "cafin/precond/f_one", PRECONDITIONER, "on F = 1, by reason (count)", ("no_layer", "not_fired"),
          "no_layer: parameter tensors of no supported layer; not_fired: layers no training forward reached "
          "before the last capture"),
)

BY_KEY = {c.key: c for c in CHARTS}
TEXT_TAG = "cafin/backend"  # add_text writes it as cafin/backend/text_summary
HISTOGRAM_TAGS = ("cafin/precond/S/<layer>", "cafin/precond/H/<layer>")
HPARAM_KEYS = ("optimizer", "backend", "lr", "beta", "gamma", "Lambda", "TCov", "weight_decay", "capture_impl")


def tag(key: str, suffix: str = "") -> str:
    """The tag for ``key``; ``suffix`` tells several optimizers apart (``/opt1`` ...)."""
    return BY_KEY[key].tag + suffix


def _exact(t: str) -> str:
    return "^" + re.escape(t) + "$"


def custom_scalars_layout(suffixes: list[str], compared: str = "live vs baseline") -> dict:
    """The 'CAFIN' and 'Preconditioner' sections; ``compared`` names the divergence's two backends."""
    layout: dict[str, dict] = {CAFIN: {}, PRECONDITIONER: {}}
    for chart in CHARTS:
        title = chart.title.format(compared=compared)
        layout[chart.section][title] = ["Multiline", [_exact(chart.tag + s) for s in suffixes]]
    return layout


def readme_table() -> str:
    """The README's tag table (Markdown), generated from ``CHARTS``."""
    rows = ["| tag | series (runs under `<log_dir>/cafin/`) | chart | what is measured |", "|---|---|---|---|"]
    for c in CHARTS:
        series = ", ".join(f"`{s}`" if s != LAYER_TYPES else "one per layer type (`Conv2d`, `Linear`, ...)"
                           for s in c.series) or "the training run"
        title = c.title.format(compared="`<live> vs <baseline>`").replace("|", "\\|")
        rows.append(f"| `{c.tag}` | {series} | {c.section}: {title} | {c.meaning.replace('|', chr(92) + '|')} |")
    rows.append(f"| `{TEXT_TAG}/text_summary` | the training run | Text | which backend runs, what divergence "
                "compares |")
    rows.append(f"| `{HISTOGRAM_TAGS[0]}`, `{HISTOGRAM_TAGS[1]}` | the training run | Histograms | the factor "
                "vectors of a few layers (`histogram_layers`), on logging steps after a capture |")
    rows.append("| `cafin/" + "`, `cafin/".join(HPARAM_KEYS) + "` | the training run | HParams | the optimizer's "
                "settings (first param group), capture implementation |")
    return "\n".join(rows)
