"""What AdaFisher communicates per capture step on each benchmark model, for the README.

Under DDP or FSDP2 a capture step sends one all-reduce: a flag, two counts per bound
layer and the layer's input- and output-statistic sums; a normal step sends nothing.
The buffer's size is fixed by the layers' shapes (not the batch, the number of ranks or
the strategy), so it is measured here by one capture step of each benchmark model on
the CPU with a small batch, sizing the buffer the reduction sends (float32 statistics:
4 bytes an element).  Writes ``docs/results/communication.json`` and the README's table
between its markers.

    python benchmarks/communication.py           # measure, write the JSON and the README table
    python benchmarks/communication.py --check   # exit 1 if the README is out of date
"""

from __future__ import annotations

import argparse
import re
import json
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.results_readme import splice  # noqa: E402
from lightning_cafin.bench.workloads import workloads  # noqa: E402

BEGIN, END = "<!-- communication:begin -->", "<!-- communication:end -->"
DEFAULT_JSON = REPO / "docs" / "results" / "communication.json"


class _Sizer:
    """A step observer that sizes the capture step's all-reduce buffer just before it is sent."""

    def __init__(self) -> None:
        self.elements = 0
        self.layers = 0

    def before_update(self, opt: Any, found_inf: Any) -> None: ...

    def after_update(self, opt: Any, found_inf: Any) -> None: ...

    def before_capture(self, opt: Any) -> None:
        captures = list(opt.binding.captures.values())
        self.layers = len(captures)
        self.elements = opt.statistics_reduction.buffer_elements(captures)


def measure() -> list[dict[str, Any]]:
    cpu = torch.device("cpu")
    rows = []
    for name, w in workloads(cpu, quick=False).items():
        if name == "resnet18-bf16cl":  # the same layers as resnet18
            continue
        model = w.model(cpu)
        opt = w.ada_cls(model, lr=w.lr, weight_decay=w.weight_decay, backend="foreach")
        sizer = _Sizer()
        opt.register_step_observer(sizer)
        x, y = w.batch(cpu)
        x, y = (x[:2], y[:2]) if x.dim() == 4 else (x[:1, :32], y[:1, :32])
        w.loss_fn(model(x.float() if x.is_floating_point() else x), y).backward()
        opt.step()
        params = sum(p.numel() for p in model.parameters())
        rows.append({"workload": name, "description": w.description, "parameters": params, "layers": sizer.layers,
                     "elements": sizer.elements, "bytes": 4 * sizer.elements})
        print(f"{name}: {params:,} parameters, {sizer.layers} layers, {sizer.elements:,} elements", flush=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [BEGIN, "", "| model | parameters | bound layers | all-reduce per capture step | share of a full gradient all-reduce |",
             "|---|---:|---:|---:|---:|"]
    for r in rows:
        share = r["elements"] / r["parameters"]
        model = re.sub(r" b[0-9]+(x[0-9]+)?$", "", r["description"].split(",")[0])  # the batch does not matter here
        lines.append(f"| {model} | {r['parameters'] / 1e6:.1f} M | {r['layers']} | "
                     f"{r['bytes'] / 1e6:.3f} MB | {100 * share:.3f}% |")
    lines += ["", "Measured by `python benchmarks/communication.py` (one capture step per model; the sizes depend "
              "on the layers' shapes only).", "", END]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON)
    ap.add_argument("--readme", type=Path, default=REPO / "README.md")
    ap.add_argument("--check", action="store_true", help="do not measure; exit 1 if the README differs from the JSON")
    args = ap.parse_args(argv)
    if not args.check:
        provenance = {"command": "python benchmarks/communication.py", "torch": torch.__version__,
                      "date": time.strftime("%Y-%m-%d"), "machine": "CPU (the sizes do not depend on the machine)"}
        args.json.write_text(json.dumps({**provenance, "rows": measure()}, indent=1) + "\n")
    rows = json.loads(args.json.read_text())["rows"]
    current = args.readme.read_text()
    wanted = splice(current, table(rows), BEGIN, END, anchor="\n## Results")
    if args.check:
        return 0 if wanted == current else 1
    args.readme.write_text(wanted)
    print(f"wrote {args.json} and the communication table of {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
