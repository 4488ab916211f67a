"""The optimizer-step table: AdaFisher's backends beside torch's Adam and SGD, measured in one run.

Workloads: the paper's CIFAR ResNet-18 (batch 256), a small transformer (LayerNorm +
Linear, AdaFisherW) and a large flat set of Linear weights sized to the device (up to
1 billion parameters).  For each optimizer variant it measures, with CUDA events on a
GPU (the wall clock on the CPU):

* ``step_ms``: the median ``optimizer.step()`` on a non-capture step;
* ``capture_ms``: the extra forward+backward time of a capture step (AdaFisher only; the
  median of interleaved plain/capture pairs, waiting for the side-stream statistics);
* ``train_step_ms``: forward + backward + step;
* ``temp_mb``: temporary memory of one step (allocator peak above the start);
* ``state_mb``: optimizer state (momentum, factors, caches; Adam's two moments);
* ``GBps`` and ``of_copy``: on the flat set, bytes the step must move over its time,
  and that as a fraction of a device copy measured in the same run.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from .. import AdaFisher, AdaFisherW
from ..backends import fused_unavailable_reason
from ..capture import streams as capture_streams
from ..monitor.memory import TemporaryMemory
from .timing import extra_ms, median_ms, sync


@dataclass
class Result:
    workload: str
    variant: str
    step_ms: Optional[float] = None
    capture_ms: Optional[float] = None
    train_step_ms: Optional[float] = None
    temp_mb: Optional[float] = None
    state_mb: Optional[float] = None
    GBps: Optional[float] = None
    of_copy: Optional[float] = None
    note: str = ""


@dataclass
class Variant:
    name: str
    make: Callable[[nn.Module], torch.optim.Optimizer]
    graph: bool = False  # replay the step from a CUDA graph


ADAFISHERS = (AdaFisher, AdaFisherW)


def state_bytes(opt: torch.optim.Optimizer) -> int:
    seen, total = set(), 0

    def add(t):
        nonlocal total
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()

    for state in opt.state.values():
        for v in state.values():
            add(v)
    if isinstance(opt, ADAFISHERS):
        usage = opt.memory_usage()
        total += usage["factors"] + usage["cached_fisher"]
    return total


def variants(opt_cls: type, device: torch.device, lr: float, wd: float) -> list[Variant]:
    fused_reason = fused_unavailable_reason() if device.type == "cuda" else "not a CUDA device"

    def ada(backend):
        return lambda m: opt_cls(m, lr=lr, weight_decay=wd, TCov=10**9, backend=backend)

    out = [Variant(f"{opt_cls.__name__}[reference]", ada("reference")),
           Variant(f"{opt_cls.__name__}[foreach]", ada("foreach"))]
    if fused_reason is None:
        out += [Variant(f"{opt_cls.__name__}[fused]", ada("fused")),
                Variant(f"{opt_cls.__name__}[fused+graph]", ada("fused"), graph=True)]
    adam = torch.optim.AdamW if opt_cls is AdaFisherW else torch.optim.Adam
    out += [
        Variant(f"{adam.__name__}(fused)", lambda m: adam(m.parameters(), lr=lr, weight_decay=wd, fused=True)),
        Variant(f"{adam.__name__}(foreach)", lambda m: adam(m.parameters(), lr=lr, weight_decay=wd, foreach=True)),
        Variant("SGD(momentum,foreach)", lambda m: torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9, foreach=True)),
    ]
    return out


def _graphed(opt: torch.optim.Optimizer, device: torch.device) -> Callable[[], None]:
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(3):
            opt.step()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    return graph.replay


def bench_model(name: str, base: nn.Module, batch: Callable[[], tuple], loss_fn, opt_cls, device, reps, lr, wd):
    results = []
    inputs, target = batch()
    for v in variants(opt_cls, device, lr, wd):
        results.append(_bench_variant(name, v, copy.deepcopy(base).to(device), inputs, target, loss_fn, device, reps))
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the variant's model and optimizer are gone with its frame
    return results


def _bench_variant(name: str, v: Variant, model: nn.Module, inputs, target, loss_fn, device, reps) -> Result:
    opt = v.make(model)
    res = Result(name, v.name)

    def fwd_bwd() -> None:
        opt.zero_grad(set_to_none=False)
        loss_fn(model(inputs), target).backward()

    def train_step() -> None:
        fwd_bwd()
        opt.step()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            train_step()  # step 0 is a capture step; after it none (TCov is huge)
        sync(device)
        step = _graphed(opt, device) if v.graph else opt.step
        res.step_ms = median_ms(step, device, reps)
        with TemporaryMemory(device) as mem:
            step()
            sync(device)
        res.temp_mb = mem.bytes / 2**20
        res.state_mb = state_bytes(opt) / 2**20
        if not v.graph:
            res.train_step_ms = median_ms(train_step, device, reps)
        if isinstance(opt, ADAFISHERS) and not v.graph:
            ada = opt

            def capturing_fwd_bwd() -> None:
                ada.capture_next_step()
                fwd_bwd()
                ada.capture_next_step(False)
                capture_streams.join()  # as the step does: wait for the side-stream statistics
                ada.binding.discard_pending()
                capture_streams.release()

            res.capture_ms = extra_ms(fwd_bwd, capturing_fwd_bwd, device, 2 * reps)
    return res


def copy_bandwidth(device: torch.device, numel: int, reps: int) -> float:
    """GB/s of a device copy (bytes read + written), the ceiling of a streaming kernel."""
    src = torch.empty(numel, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device, reps)
    return 2 * numel * 4 / (ms * 1e-3) / 1e9


def bench_flat(total: int, width: int, device, reps, lr, wd) -> list[Result]:
    """Many large Linear weights with random factors: the step as a pure streaming kernel."""
    n = max(1, -(-total // (width * width)))  # whole layers, at least `total` elements
    copy_gbps = copy_bandwidth(device, min(total, 1 << 28), reps)
    results = []
    for v in variants(AdaFisher, device, lr, wd):
        if "reference" in v.name and total > (1 << 26) and device.type != "cuda":
            continue
        layers = nn.ModuleList(nn.Linear(width, width, bias=False, device=device) for _ in range(n))
        for p in layers.parameters():
            p.grad = torch.randn_like(p)
        opt = v.make(layers)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if isinstance(opt, ADAFISHERS):
                # factors as after a capture: ~U(0.08, 0.088); the first step (a capture step
                # where no layer fired) keeps them
                opt.binding.load_state_dict({name: {"S": 0.08 + 0.008 * torch.rand(width, device=device),
                                                    "H": 0.08 + 0.008 * torch.rand(width, device=device)}
                                             for name in opt.binding.captures})
            opt.step()
            step = _graphed(opt, device) if v.graph else opt.step
            ms = median_ms(step, device, reps)
            with TemporaryMemory(device) as mem:
                step()
                sync(device)
        elems = n * width * width
        moved = (28 if "Adam" in v.name else 20) * elems  # Adam: r p,g,m,v w p,m,v; AdaFisher/SGD: r p,g,m w p,m
        gbps = moved / (ms * 1e-3) / 1e9
        results.append(Result(f"flat {elems / 1e6:.0f}M", v.name, step_ms=ms, temp_mb=mem.bytes / 2**20,
                              state_mb=state_bytes(opt) / 2**20, GBps=gbps, of_copy=gbps / copy_gbps,
                              note=f"copy {copy_gbps:.0f} GB/s"))
        del layers, opt
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def table(results: list[Result]) -> str:
    cols = ["workload", "variant", "step_ms", "capture_ms", "train_step_ms", "temp_mb", "state_mb", "GBps", "of_copy"]
    fmt = lambda v: "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))
    rows = [cols] + [[fmt(getattr(r, c)) for c in cols] for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    return "\n".join("  ".join(cell.rjust(w) if i > 1 else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths)))
                     for row in rows)


def ratios(results: list[Result]) -> dict:
    """The figures the performance goals are judged by, from this run's own rows."""
    out = {}
    for wl in sorted({r.workload for r in results}):
        rows = {r.variant: r for r in results if r.workload == wl}
        fam = "AdaFisherW" if any(k.startswith("AdaFisherW") for k in rows) else "AdaFisher"
        adam = rows.get("AdamW(fused)") or rows.get("Adam(fused)")
        ref = rows.get(f"{fam}[reference]")
        for best in (f"{fam}[fused+graph]", f"{fam}[fused]", f"{fam}[foreach]"):
            if best in rows:
                r = rows[best]
                ms, adam_ms, ref_ms = r.step_ms, adam.step_ms if adam else None, ref.step_ms if ref else None
                out[wl] = {"variant": best,
                           "step_vs_fused_adam": ms / adam_ms if ms is not None and adam_ms else None,
                           "speedup_vs_reference": ref_ms / ms if ms and ref_ms is not None else None}
                break
    return out


def plot(results: list[Result], path: Path) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no chart (pip install matplotlib)"
    workloads = sorted({r.workload for r in results})
    fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 4), squeeze=False)
    for ax, wl in zip(axes[0], workloads):
        rows = [r for r in results if r.workload == wl and r.step_ms is not None]
        ax.barh([r.variant for r in rows], [r.step_ms for r in rows])
        ax.set_xscale("log")
        ax.set_title(wl)
        ax.set_xlabel("optimizer step (ms, log)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return None
