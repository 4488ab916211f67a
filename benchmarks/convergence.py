"""The convergence study: does fused AdaFisher train like the reference, and how does it compare?

ResNet-18 (the paper's CIFAR-style network, one input channel) on the real Fashion-MNIST
split (60,000 training / 10,000 test images), trained with AdaFisher through the fused
CUDA step and through the ``reference`` backend, with Adam and with SGD + momentum:
the same seeds (so the same initial weights and the same batch order and augmentation
for every optimizer), the same epochs and the same cosine schedule.  It records, per run
and epoch, the training loss, the test loss and accuracy, the training wall-clock time,
and the time spent in ``optimizer.step()`` (CUDA events on a GPU) as a share of the whole
train step; then, per optimizer, the final test accuracy (mean and standard deviation
over seeds) and the time to a target accuracy.

    python benchmarks/convergence.py --out docs/results/convergence-h200      # the study (GPU)
    python benchmarks/convergence.py --smoke --out /tmp/smoke                 # seconds, on a CPU

Each finished run is appended to ``<out>/runs.jsonl`` at once (one line a run: one file
however many runs, and nothing lost when a study is cut short), so an interrupted study
resumes with ``--resume`` and one split over several invocations is summarised with
``--report-only`` (append the other invocations' lines to one ``runs.jsonl`` first).
The summary is ``convergence.json`` (with provenance), ``.csv`` and ``.png``.  If fused
and reference AdaFisher do not agree within seed noise the script says so and exits
with status 1: that is a defect to find, not a result to report.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_cafin import AdaFisher
from lightning_cafin.capture import kernels as capture_impl
from lightning_cafin.data.augment import prepare_batch
from lightning_cafin.data.datamodules import IDX_STATS, IDXDataModule
from lightning_cafin.data.idx import load_idx_split
from lightning_cafin.models import ResNet18
from lightning_cafin.provenance import provenance

#: The hyper-parameters of each optimizer: the paper's for AdaFisher, the usual ones otherwise.
OPTIMIZERS: dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
    "adafisher-fused": lambda m: AdaFisher(m, lr=1e-3, weight_decay=5e-4, backend="fused"),
    "adafisher-reference": lambda m: AdaFisher(m, lr=1e-3, weight_decay=5e-4, backend="reference"),
    "adafisher-foreach": lambda m: AdaFisher(m, lr=1e-3, weight_decay=5e-4, backend="foreach"),
    # the fused step with the factor statistics taken by the torch ops instead of the capture kernels
    "adafisher-fused-torchcapture": lambda m: AdaFisher(m, lr=1e-3, weight_decay=5e-4, backend="fused"),
    "adam": lambda m: torch.optim.Adam(m.parameters(), lr=1e-3, weight_decay=5e-4,
                                       fused=next(m.parameters()).is_cuda),
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4, nesterov=True),
}
STUDY_OPTIMIZERS = ["adafisher-fused", "adafisher-reference", "adafisher-fused-torchcapture", "adam", "sgd"]
REFERENCE = "adafisher-reference"


@dataclass
class StudyConfig:
    epochs: int = 10
    batch_size: int = 256
    width: int = 64
    train_size: Optional[int] = None  # None: all 60,000
    test_size: Optional[int] = None  # None: all 10,000
    target_accuracy: float = 0.90
    augment: bool = True
    data_root: Optional[str] = None


@dataclass
class Run:
    optimizer: str
    seed: int
    config: dict
    epochs: list = field(default_factory=list)
    final_test_accuracy: Optional[float] = None
    time_to_target_s: Optional[float] = None
    step_share: Optional[float] = None
    diverged: bool = False
    provenance: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------- data
def load_split(split: str, root: Optional[str], size: Optional[int], device: torch.device) -> tuple[Tensor, Tensor]:
    """Fashion-MNIST images as uint8 (N, 1, 28, 28) and int64 labels, on ``device`` (47 MB for all of it)."""
    x, y = load_idx_split("fashion-mnist", split, root)
    if size is not None:
        x, y = x[:size], y[:size]
    return x.to(device), y.to(device)


def preprocess(x: Tensor, augment: bool, generator: Optional[torch.Generator]) -> Tensor:
    mean, std = IDX_STATS["fashion-mnist"]
    return prepare_batch(x, mean, std, IDXDataModule.crop_padding if augment else None, generator=generator)


# ---------------------------------------------------------------------------- timing
class StepClock:
    """Time inside ``optimizer.step()`` and over the whole train step, without a host sync per step."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def add(self, start, step_start, step_end) -> None:
        self.marks.append((start, step_start, step_end))

    def totals_ms(self) -> tuple[float, float]:
        """(time in step, time in train step), summed over the epoch; synchronises once."""
        if self.cuda:
            torch.cuda.synchronize()
            step = sum(a.elapsed_time(b) for _, a, b in self.marks)
            whole = sum(s.elapsed_time(b) for s, _, b in self.marks)
        else:
            step = sum(b - a for _, a, b in self.marks) * 1e3
            whole = sum(b - s for s, _, b in self.marks) * 1e3
        self.marks = []
        return step, whole


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------- one run
@torch.no_grad()
def evaluate(model: nn.Module, x: Tensor, y: Tensor, batch: int = 2000) -> tuple[float, float]:
    model.eval()
    loss_sum = torch.zeros((), device=x.device)
    correct = torch.zeros((), device=x.device, dtype=torch.long)
    for i in range(0, len(x), batch):
        logits = model(preprocess(x[i : i + batch], augment=False, generator=None))
        loss_sum += F.cross_entropy(logits, y[i : i + batch], reduction="sum")
        correct += (logits.argmax(1) == y[i : i + batch]).sum()
    model.train()
    return float(loss_sum) / len(x), int(correct) / len(x)


def train_one(name: str, seed: int, cfg: StudyConfig, data: dict, device: torch.device, log=print) -> Run:
    previous = capture_impl.set_impl("torch" if name.endswith("-torchcapture") else "auto")
    try:
        return _train(name, seed, cfg, data, device, log)
    finally:
        capture_impl.set_impl(previous)


def _train(name: str, seed: int, cfg: StudyConfig, data: dict, device: torch.device, log) -> Run:
    torch.manual_seed(seed)  # the same initial weights for every optimizer of this seed
    model = ResNet18(num_classes=10, in_channels=1, width=cfg.width).to(device)
    opt = OPTIMIZERS[name](model)
    train_x, train_y = data["train"]
    test_x, test_y = data["test"]
    steps = len(train_x) // cfg.batch_size
    if steps < 1:
        raise ValueError(f"batch_size={cfg.batch_size} is larger than the {len(train_x)} training images")
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.epochs * steps)
    generator = torch.Generator(device=device).manual_seed(seed)  # the same batches and crops for every optimizer
    run = Run(name, seed, asdict(cfg), provenance=provenance(device, " ".join(sys.argv)))
    clock, elapsed = StepClock(device), 0.0
    for epoch in range(1, cfg.epochs + 1):
        _sync(device)
        t0 = time.perf_counter()
        order = torch.randperm(len(train_x), generator=generator, device=device)
        loss_sum = torch.zeros((), device=device)
        for i in range(steps):
            idx = order[i * cfg.batch_size : (i + 1) * cfg.batch_size]
            start = clock.mark()
            x = preprocess(train_x[idx], cfg.augment, generator)
            loss = F.cross_entropy(model(x), train_y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            step_start = clock.mark()
            opt.step()
            clock.add(start, step_start, clock.mark())
            schedule.step()
            loss_sum += loss.detach()
        step_ms, train_step_ms = clock.totals_ms()
        train_s = time.perf_counter() - t0
        elapsed += train_s
        t1 = time.perf_counter()
        train_loss = float(loss_sum) / steps
        test_loss, test_acc = evaluate(model, test_x, test_y)
        run.epochs.append({
            "epoch": epoch, "train_loss": train_loss, "test_loss": test_loss, "test_accuracy": test_acc,
            "train_s": train_s, "eval_s": time.perf_counter() - t1, "step_ms_total": step_ms,
            "train_step_ms_total": train_step_ms, "step_share": step_ms / train_step_ms if train_step_ms else None,
        })
        log(f"[{name} seed {seed}] epoch {epoch}/{cfg.epochs}  train loss {train_loss:.4f}  "
            f"test acc {test_acc:.4f}  {train_s:.1f} s  (step {100 * step_ms / max(train_step_ms, 1e-9):.1f}% "
            "of the train step)")
        if run.time_to_target_s is None and test_acc >= cfg.target_accuracy:
            run.time_to_target_s = elapsed
        if not math.isfinite(train_loss):
            run.diverged = True
            log(f"[{name} seed {seed}] the training loss is {train_loss}: stopping this run")
            break
    run.final_test_accuracy = run.epochs[-1]["test_accuracy"]
    run.step_share = sum(e["step_ms_total"] for e in run.epochs) / max(
        sum(e["train_step_ms_total"] for e in run.epochs), 1e-9)
    return run


# ---------------------------------------------------------------------------- summary
def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def summarise(runs: list[dict]) -> dict:
    by_opt: dict[str, list[dict]] = {}
    for r in runs:
        by_opt.setdefault(r["optimizer"], []).append(r)
    summary = {}
    for name, rs in sorted(by_opt.items()):
        finals = [r["final_test_accuracy"] for r in rs]
        mean, std = _mean_std(finals)
        epoch_s = [e["train_s"] for r in rs for e in r["epochs"][1:]] or [e["train_s"] for r in rs for e in r["epochs"]]
        reached = [r["time_to_target_s"] for r in rs if r["time_to_target_s"] is not None]
        summary[name] = {
            "seeds": sorted(r["seed"] for r in rs),
            "final_test_accuracy_mean": mean,
            "final_test_accuracy_std": std,
            "epoch_s_median": statistics.median(epoch_s),
            "time_to_target_s_mean": statistics.fmean(reached) if reached else None,
            "runs_reaching_target": len(reached),
            "step_share_mean": statistics.fmean(r["step_share"] for r in rs),
            "diverged_runs": sum(bool(r["diverged"]) for r in rs),
        }
    return summary


#: Agreement rule: |mean difference| <= 2 * the pooled standard error of the two means, or 0.5 points.
AGREEMENT_FLOOR = 0.005


def agreement(runs: list[dict]) -> dict:
    """Every AdaFisher backend variant against ``adafisher-reference``, seed by seed."""
    finals = {}
    for r in runs:
        finals.setdefault(r["optimizer"], {})[r["seed"]] = r["final_test_accuracy"]
    out = {}
    ref = finals.get(REFERENCE)
    if not ref:
        return out
    for name, by_seed in finals.items():
        if not name.startswith("adafisher-") or name == REFERENCE:
            continue
        seeds = sorted(set(by_seed) & set(ref))
        if not seeds:
            continue
        a, b = [by_seed[s] for s in seeds], [ref[s] for s in seeds]
        (ma, sa), (mb, sb) = _mean_std(a), _mean_std(b)
        se = math.sqrt((sa**2 + sb**2) / len(seeds))
        tolerance = max(2 * se, AGREEMENT_FLOOR)
        out[name] = {
            "against": REFERENCE, "seeds": seeds, "mean_difference": ma - mb,
            "per_seed_difference": [x - y for x, y in zip(a, b)], "tolerance": tolerance,
            "agree": abs(ma - mb) <= tolerance,
        }
    return out


def write_csv(runs: list[dict], path: Path) -> None:
    cols = ["optimizer", "seed", "epoch", "train_loss", "test_loss", "test_accuracy", "train_s", "eval_s",
            "step_ms_total", "train_step_ms_total", "step_share"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, cols)
        w.writeheader()
        for r in runs:
            for e in r["epochs"]:
                w.writerow({"optimizer": r["optimizer"], "seed": r["seed"], **{k: e[k] for k in cols[2:]}})


def plot(runs: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG (re-run with --report-only where it is)", file=sys.stderr)
        return False
    fig, (ax_acc, ax_loss) = plt.subplots(1, 2, figsize=(11, 4))
    by_opt: dict[str, list[dict]] = {}
    for r in runs:
        by_opt.setdefault(r["optimizer"], []).append(r)
    for name, rs in sorted(by_opt.items()):
        n = min(len(r["epochs"]) for r in rs)
        epochs = list(range(1, n + 1))
        for ax, key in ((ax_acc, "test_accuracy"), (ax_loss, "train_loss")):
            values = [[r["epochs"][i][key] for r in rs] for i in range(n)]
            mean = [statistics.fmean(v) for v in values]
            std = [statistics.stdev(v) if len(v) > 1 else 0.0 for v in values]
            ax.plot(epochs, mean, marker="o", ms=3, label=f"{name} (n={len(rs)})")
            ax.fill_between(epochs, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.2)
    ax_acc.set(xlabel="epoch", ylabel="test accuracy", title="Fashion-MNIST test accuracy (mean ± std)")
    ax_loss.set(xlabel="epoch", ylabel="training loss", yscale="log", title="training loss (mean ± std)")
    ax_acc.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


RUNS_FILE = "runs.jsonl"


def read_runs(out: Path) -> list[dict]:
    """The finished runs in ``out/runs.jsonl``; a later line for the same optimizer and seed wins."""
    path = out / RUNS_FILE
    if not path.is_file():
        return []
    runs: dict[tuple, dict] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            run = json.loads(line)
            runs[(run["optimizer"], run["seed"])] = run
    return list(runs.values())


def report(out: Path, command: str, device: torch.device) -> dict:
    """Summarise every run in ``out/runs.jsonl`` into convergence.json / .csv / .png."""
    runs = read_runs(out)
    if not runs:
        raise SystemExit(f"no finished runs in {out / RUNS_FILE}: run the study first")
    commits = sorted({r["provenance"]["commit"] for r in runs})
    machines = sorted({r["provenance"]["machine"] for r in runs})
    prov = provenance(device, command)
    prov.update(commit=commits[0] if len(commits) == 1 else ",".join(commits), machine=", ".join(machines),
                runs_from=sorted({r["provenance"]["date"] for r in runs})[0])
    result = {"provenance": prov, "config": runs[0]["config"], "summary": summarise(runs),
              "agreement": agreement(runs), "agreement_rule": "|mean difference| <= max(2 * pooled standard error, "
              f"{AGREEMENT_FLOOR})", "runs": runs}
    (out / "convergence.json").write_text(json.dumps(result, indent=1))
    write_csv(runs, out / "convergence.csv")
    plot(runs, out / "convergence.png")
    return result


# ---------------------------------------------------------------------------- main
def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="folder for runs.jsonl and the summary files")
    ap.add_argument("--optimizers", nargs="+", choices=sorted(OPTIMIZERS), default=None)
    ap.add_argument("--seeds", nargs="+", type=int, default=None)
    ap.add_argument("--epochs", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--train-size", type=int, default=None, help="use the first N training images (default: all)")
    ap.add_argument("--test-size", type=int, default=None)
    ap.add_argument("--target", type=float, default=0.90, help="test accuracy for the time-to-target figure")
    ap.add_argument("--data-root", default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny subset, one epoch, two optimizers, a narrow network: checks the pipeline in seconds")
    ap.add_argument("--resume", action="store_true", help="skip runs already in runs.jsonl (same configuration)")
    ap.add_argument("--report-only", action="store_true", help="only summarise the runs already in --out/runs.jsonl")
    args = ap.parse_args(argv)
    command = "python benchmarks/convergence.py " + " ".join(argv if argv is not None else sys.argv[1:])
    device = torch.device(args.device)
    out: Path = args.out
    if args.report_only:
        result = report(out, command, device)
        return _verdict(result)

    if args.smoke:
        cfg = StudyConfig(epochs=args.epochs or 1, batch_size=64, width=8, train_size=args.train_size or 512,
                          test_size=args.test_size or 500, target_accuracy=args.target, data_root=args.data_root)
        names = args.optimizers or ["adafisher-foreach", "adam"]
        seeds = args.seeds or [0]
    else:
        cfg = StudyConfig(epochs=args.epochs or 10, batch_size=args.batch_size, train_size=args.train_size,
                          test_size=args.test_size, target_accuracy=args.target, data_root=args.data_root)
        names = args.optimizers or STUDY_OPTIMIZERS
        seeds = args.seeds or [0, 1, 2]
    if cfg.epochs < 1:
        ap.error("--epochs must be >= 1")
    data = {"train": load_split("train", cfg.data_root, cfg.train_size, device),
            "test": load_split("test", cfg.data_root, cfg.test_size, device)}
    print(f"convergence study on {device}: {len(data['train'][0])} training / {len(data['test'][0])} test images, "
          f"{cfg.epochs} epochs, optimizers {names}, seeds {seeds}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    done = {(r["optimizer"], r["seed"]) for r in read_runs(out) if r["config"] == asdict(cfg)} if args.resume else set()
    if not args.resume:
        (out / RUNS_FILE).unlink(missing_ok=True)
    for seed in seeds:  # seed by seed, so that a cut-short study still compares every optimizer
        for name in names:
            if (name, seed) in done:
                print(f"[{name} seed {seed}] already done ({out / RUNS_FILE})", flush=True)
                continue
            run = train_one(name, seed, cfg, data, device, log=lambda m: print(m, flush=True))
            with open(out / RUNS_FILE, "a") as f:
                f.write(json.dumps(asdict(run)) + "\n")
    return _verdict(report(out, command, device))


def _verdict(result: dict) -> int:
    print("\noptimizer              final test accuracy     epoch s   to target s   step share")
    for name, s in result["summary"].items():
        target = f"{s['time_to_target_s_mean']:.1f}" if s["time_to_target_s_mean"] is not None else "-"
        print(f"{name:22s} {s['final_test_accuracy_mean']:.4f} ± {s['final_test_accuracy_std']:.4f}   "
              f"{s['epoch_s_median']:8.2f}   {target:>10s}   {100 * s['step_share_mean']:8.1f}%")
    status = 0
    for name, a in result["agreement"].items():
        verdict = "agree" if a["agree"] else "DO NOT AGREE"
        print(f"{name} vs {a['against']}: mean difference {a['mean_difference']:+.4f} "
              f"(tolerance {a['tolerance']:.4f}): {verdict}")
        if not a["agree"]:
            status = 1
    if status:
        print("fused and reference AdaFisher disagree beyond seed noise: a defect to find", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
