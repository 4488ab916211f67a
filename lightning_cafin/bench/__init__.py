"""``python -m lightning_cafin.bench``: AdaFisher beside torch's optimizers, measured in one run.

Three parts, all written to ``bench.json`` (with the run's provenance) in ``--out``:

* the optimizer-step table (``optimizer_step.py``): AdaFisher's backends beside Adam and
  SGD on the paper's ResNet-18, a small transformer and a flat set of weights sized to the
  device (``results`` and ``ratios``, and ``bench.png`` when matplotlib is installed);
* the workload matrix (``matrix.py``, ``workloads.py``): CIFAR ResNet-18 in fp32 and in
  bf16 autocast + channels_last, an ImageNet ResNet-50 (bf16 + channels_last) and a
  GPT-2-small-shaped LM (bf16, AdaFisherW), each against Adam(W)(fused=True) on the same
  model: pipelined train steps at TCov 100 / 10 / 1, step-synchronous normal and capture
  steps, peak memory per step type, the optimizer step alone, optimizer-state bytes
  (``matrix``), with the host's own price of a torch op and of an allocation measured first
  (``host_speed.py``).  Its table of figures beside their goals prints last;
* the callback's cost (``callback_overhead.py``, ``--only callback``): a Lightning training
  step of the CIFAR ResNet-18 with ``CAFINCallback()`` and its TensorBoard dashboard
  against the same step with AdaFisher bound to the model directly, interleaved fits, and
  the dashboard's host syncs on steps that do not log (``callback``);
* a compiled train step (``compiled.py``, ``--only compiled``): ``torch.compile(model)`` with
  AdaFisher at TCov=100 against fused Adam(W) on the matrix's resnet18 and gpt workloads,
  interleaved blocks, compile time and graph breaks (``compiled``).

``--quick`` shrinks everything so that CI runs it on a CPU; ``--matrix-only`` skips the
optimizer-step table, the callback and the compiled step; ``--only`` picks workloads by
name.  A ``--quick`` run leaves the compiled step out unless ``--only`` names it (compiling
takes a while even on the CPU).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .. import AdaFisher, AdaFisherW
from ..models import ResNet18, TransformerClassifier
from ..provenance import provenance
from .callback_overhead import CallbackConfig, callback_table, measure_callback
from .compiled import COMPILED_WORKLOADS, CompiledConfig, compiled_table, run_compiled
from .host_speed import host_speed, host_speed_text
from .goals import goals_table
from .matrix import MatrixConfig, add_launch_counts, detail_table, run_matrix
from .optimizer_step import Result, bench_flat, bench_model, plot, ratios, state_bytes, table, variants
from .timing import extra_ms, median_ms
from .workloads import NAMES as MATRIX_WORKLOADS
from .workloads import workloads

#: The optimizer-step table's workloads.
TABLE_WORKLOADS = ("resnet18", "transformer", "flat")
#: The callback's cost (on the matrix's resnet18 workload).
CALLBACK = "callback"
#: The compiled train step (on the matrix's workloads of ``compiled.COMPILED_WORKLOADS``).
COMPILED = "compiled"

__all__ = ["CALLBACK", "COMPILED", "MATRIX_WORKLOADS", "TABLE_WORKLOADS", "Result", "bench_flat", "bench_model", "extra_ms", "main",
           "median_ms", "ratios", "state_bytes", "table", "variants"]


def parse_only(text: Optional[str], quick: bool = False) -> set[str]:
    """``--only``'s comma list, checked against the workloads the parts know (none given:
    all of them, less the compiled step in a ``quick`` run)."""
    known = set(TABLE_WORKLOADS) | set(MATRIX_WORKLOADS) | {CALLBACK, COMPILED} | set(compiled_names(COMPILED_WORKLOADS))
    if not text:
        return known - {COMPILED, *compiled_names(COMPILED_WORKLOADS)} if quick else known
    names = {n.strip() for n in text.split(",") if n.strip()}
    unknown = names - known
    if unknown or not names:
        raise SystemExit(f"--only: unknown workload(s) {sorted(unknown)}; choose from {', '.join(sorted(known))}")
    return names


def compiled_names(names: tuple[str, ...]) -> list[str]:
    """``compiled:<workload>``: one workload of the compiled step (``compiled`` picks them all)."""
    return [f"{COMPILED}:{n}" for n in names]


def run_table(only: set[str], device: torch.device, quick: bool, reps: int, flat: Optional[float]) -> list[Result]:
    torch.manual_seed(0)
    results: list[Result] = []
    if "resnet18" in only:
        bs, width = (4, 8) if quick else (256, 64)
        net: nn.Module = ResNet18(10, 3, width)
        batch = lambda: (torch.randn(bs, 3, 32, 32, device=device), torch.randint(0, 10, (bs,), device=device))
        print(f"== CIFAR ResNet-18 (width {width}, batch {bs}) on {device}", flush=True)
        results += bench_model(f"resnet18 b{bs}", net, batch, F.cross_entropy, AdaFisher, device, reps, 1e-3, 5e-4)
    if "transformer" in only:
        bs, T, dim, depth = (4, 16, 32, 2) if quick else (64, 128, 256, 4)
        net = TransformerClassifier(vocab=1000, num_classes=10, dim=dim, depth=depth, heads=4, max_len=T)
        batch = lambda: (torch.randint(0, 1000, (bs, T), device=device), torch.randint(0, 10, (bs,), device=device))
        print(f"== transformer (dim {dim}, depth {depth}, batch {bs}x{T}) on {device}", flush=True)
        results += bench_model(f"transformer b{bs}", net, batch, F.cross_entropy, AdaFisherW, device, reps, 1e-3, 1e-2)
    if "flat" in only:
        if flat is not None:
            total = int(flat)
        elif quick:
            total = 1 << 20
        elif device.type == "cuda":
            free = torch.cuda.mem_get_info(device)[0]
            total = int(min(1e9, free / 44))  # p, g, states, caches, a reference F: < 40 B/element, rounded up to whole layers
        else:
            total = 1 << 24
        width = 1024 if quick else 8192
        print(f"== flat parameter set ({total / 1e6:.0f}M elements) on {device}", flush=True)
        results += bench_flat(total, width, device, reps, 1e-3, 0.0)
    return results


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lightning_cafin.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (CI on a CPU)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="bench_out", help="folder for bench.json and bench.png")
    ap.add_argument("--reps", type=int, default=None, help="timed calls per variant in the optimizer-step table")
    ap.add_argument("--blocks", type=int, default=None,
                    help="timed blocks per variant in the matrix's pipelined figures (default 10; 2 with --quick)")
    ap.add_argument("--flat", type=float, default=None, help="flat parameter count (default: sized to the device)")
    ap.add_argument("--only", default=None,
                    help=f"comma list of workloads: table {','.join(TABLE_WORKLOADS)}; matrix {','.join(MATRIX_WORKLOADS)} "
                         f"(resnet18 is in both); {CALLBACK} (the callback's cost); {COMPILED} (a compiled train step "
                         f"on {', '.join(COMPILED_WORKLOADS)}; or one of {', '.join(compiled_names(COMPILED_WORKLOADS))})")
    ap.add_argument("--matrix-only", action="store_true",
                    help="skip the optimizer-step table, the callback and the compiled step; run only the matrix")
    args = ap.parse_args(argv)
    raw_argv = argv if argv is not None else sys.argv[1:]
    device = torch.device(args.device)
    quick = args.quick
    only = parse_only(args.only, quick)
    if args.blocks is not None and args.blocks < 1:
        raise SystemExit(f"--blocks must be at least 1 (got {args.blocks})")

    cfg = MatrixConfig.quick() if quick else MatrixConfig()
    if args.blocks is not None:
        cfg.blocks = args.blocks
    threads = torch.get_num_threads()
    if quick and device.type == "cpu":
        # tiny shapes gain nothing from intra-op threads, and on a shared CPU spinning
        # threads make a --quick run ten times slower
        torch.set_num_threads(1)
    try:
        results = [] if args.matrix_only else run_table(only, device, quick, args.reps or (3 if quick else 30), args.flat)
        matrix_names = [n for n in MATRIX_WORKLOADS if n in only]
        speed = host_speed(device) if matrix_names else None  # the host's own price of a launch, device idle
        matrix = run_matrix(matrix_names, workloads(device, quick), device, cfg)
        callback = None
        if CALLBACK in only and not args.matrix_only:
            wl = workloads(device, quick)["resnet18"]
            print(f"== callback: {wl.description} in a Lightning Trainer on {device}", flush=True)
            callback = measure_callback(wl, device, CallbackConfig.quick() if quick else CallbackConfig())
        compiled = None
        compiled_wls = [n for n in COMPILED_WORKLOADS if {COMPILED, f"{COMPILED}:{n}"} & only]
        if compiled_wls and not args.matrix_only:
            compiled = run_compiled(compiled_wls, workloads(device, quick), device,
                                    CompiledConfig.quick() if quick else CompiledConfig(),
                                    log=lambda line: print(line, flush=True))
        add_launch_counts(matrix, workloads(device, quick), device)  # last: it profiles
    finally:
        torch.set_num_threads(threads)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = ratios(results)
    record = {"provenance": provenance(device, "python -m lightning_cafin.bench " + " ".join(raw_argv)),
              "results": [asdict(r) for r in results], "ratios": summary,
              "matrix": {"config": asdict(cfg), "workloads": matrix, "host_speed": speed}}
    if callback is not None:
        record["callback"] = callback
    if compiled is not None:
        record["compiled"] = compiled
    (out / "bench.json").write_text(json.dumps(record, indent=2))
    chart_note = plot(results, out / "bench.png") if results else "no optimizer-step table: no chart"
    if results:
        print(table(results))
        for wl, r in summary.items():
            svs = "-" if r["step_vs_fused_adam"] is None else f"{r['step_vs_fused_adam']:.2f}x"
            spd = "-" if r["speedup_vs_reference"] is None else f"{r['speedup_vs_reference']:.1f}x"
            print(f"{wl}: {r['variant']} step = {svs} of torch fused Adam's, {spd} faster than reference")
    print(f"wrote {out / 'bench.json'}" + (f"; {chart_note}" if chart_note else f" and {out / 'bench.png'}"))
    if matrix:
        print(detail_table(matrix))
        if speed is not None:
            print(host_speed_text(speed))
    if callback is not None:
        print(callback_table(callback))
    if compiled is not None:
        print(compiled_table(compiled))
    judged = {**matrix, **({CALLBACK: callback} if callback is not None else {})}
    if compiled is not None:
        judged.update({f"{COMPILED}:{n}": w for n, w in compiled["workloads"].items()})
    if judged:
        print(goals_table(judged))
    return 0
