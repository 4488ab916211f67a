"""A compiled train step: AdaFisher at TCov=100 against Adam(W)(fused=True), both on ``torch.compile(model)``.

For the matrix's ``resnet18`` and ``gpt`` workloads (``workloads.py``): two copies of the
same seeded model, each wrapped by ``torch.compile`` (inductor, default mode); AdaFisher
(``backend="auto"``) is bound to one copy, torch's fused Adam/AdamW steps the other; the
optimizer steps run eagerly, as in most training loops.

* warm-up: ``warmup`` train steps per variant, one variant after the other, with a capture
  forced every ``capture_every`` steps, so that compilation, the capture step's own graphs
  (its hooks are compiler-disabled: a graph break per bound module) and any recompile they
  cause are done before timing; each variant's compile wall time, graphs compiled, graph
  breaks and frames left eager at dynamo's recompile limit (``torch._dynamo.utils.counters``)
  are recorded;
* timed: ``blocks`` blocks of ``block`` back-to-back train steps per variant, alternating
  (``timing.interleaved``), each timed by the wall clock between two synchronisations;
  ``blocks * block`` spans whole TCov periods, so captures count at their real frequency.
  ``ratio`` is AdaFisher's total time over Adam's (the goal: at most 1.05x), ``block_ratio``
  the spread of the paired per-block ratios; graphs compiled while timing are counted (0
  expected: a recompile there would be timed).

``--quick`` compiles with ``aot_eager`` (dynamo and AOT autograd, no code generation): on a
CPU it checks the plumbing in seconds where inductor takes minutes.
"""

from __future__ import annotations

import functools
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Callable, cast

import torch
from torch import nn

from .goals import goal_rows
from .matrix import Trainer
from .timing import elapsed_ms, free_memory, interleaved, paired, ratio, spread, spread_text, sync
from .workloads import Workload

#: The workloads compiled (names of ``workloads.workloads``).
COMPILED_WORKLOADS = ("resnet18", "gpt")
VARIANTS = ("adam", "adafisher")


@dataclass
class CompiledConfig:
    warmup: int = 30  # steps per variant before timing: compilation and three capture steps
    capture_every: int = 10  # during warm-up, a capture is forced every this many steps
    block: int = 20  # steps per timed block
    blocks: int = 20  # timed blocks per variant: 400 steps, four capture periods of TCov=100
    TCov: int = 100
    backend: str = "inductor"  # torch.compile's backend

    def __post_init__(self) -> None:
        for name in ("warmup", "capture_every", "block", "blocks", "TCov"):
            if getattr(self, name) < 1:
                raise ValueError(f"CompiledConfig.{name} must be at least 1 (got {getattr(self, name)})")

    @classmethod
    def quick(cls) -> "CompiledConfig":
        return cls(warmup=4, capture_every=2, block=2, blocks=3, TCov=3, backend="aot_eager")


def dynamo_counts() -> dict[str, int]:
    """So far in this process: graphs dynamo compiled, graph breaks it met, and frames it gave
    up on at the recompile limit (those run eagerly from then on)."""
    counters = torch._dynamo.utils.counters
    return {"graphs": int(counters["stats"]["unique_graphs"]), "graph_breaks": int(sum(counters["graph_break"].values())),
            "recompile_limit": int(sum(n for why, n in counters["unimplemented"].items() if "recompile limit" in why))}


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after}


def compiled_trainers(wl: Workload, device: torch.device, cfg: CompiledConfig) -> dict[str, Trainer]:
    """Adam(W)(fused=True) and AdaFisher(W) at ``cfg.TCov``, each on its own compiled copy of the model."""
    batch = wl.batch(device)
    out = {}
    for name in VARIANTS:
        model = wl.model(device)
        opt = (wl.adam_cls(model.parameters(), lr=wl.lr, weight_decay=wl.weight_decay, fused=True) if name == "adam"
               else wl.ada_cls(model, lr=wl.lr, weight_decay=wl.weight_decay, TCov=cfg.TCov))
        compiled = cast(nn.Module, torch.compile(model, backend=cfg.backend))  # an OptimizedModule
        out[name] = Trainer(wl, compiled, opt, batch, device)
    return out


def warm_up(t: Trainer, cfg: CompiledConfig, device: torch.device) -> dict[str, Any]:
    """``cfg.warmup`` steps, captures forced on AdaFisher every ``cfg.capture_every``; what they compiled."""
    before, t0 = dynamo_counts(), time.perf_counter()
    for i in range(cfg.warmup):
        if i and i % cfg.capture_every == 0 and hasattr(t.opt, "capture_next_step"):
            t.opt.capture_next_step()
        t.step()
    sync(device)
    return {"seconds": time.perf_counter() - t0, **_delta(before, dynamo_counts())}


def summarise(times: dict[str, list[float]], compiled: dict[str, dict[str, Any]], while_timed: dict[str, int],
              ) -> dict[str, Any]:
    """The figures of the module docstring from the interleaved block times (ms per step)."""
    ada, adam = times["adafisher"], times["adam"]
    if not ada or len(ada) != len(adam):
        raise ValueError(f"need the same non-zero number of blocks per variant (got {len(ada)} and {len(adam)})")
    out: dict[str, Any] = {
        "adam_ms": spread(adam), "adafisher_ms": spread(ada),
        "ratio": sum(ada) / sum(adam), "block_ratio": paired(ada, adam, ratio),
        "compile": compiled, "compiled_while_timed": while_timed,
    }
    out["goals"] = compiled_goals(out)
    return out


def compiled_goals(r: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's goal (at most 1.05x, captures at their frequency) and the figures beside it."""
    ada = r["compile"]["adafisher"]
    rows = [("compiled train step TCov=100 vs Adam", r["ratio"], "x", 1.05),
            ("same, median per-block ratio", r["block_ratio"]["median"], "x", None),
            ("graph breaks while warming up (AdaFisher's model)", float(ada["graph_breaks"]), "count", None),
            ("frames left eager at the recompile limit (AdaFisher's model)", float(ada["recompile_limit"]), "count", None),
            ("graphs compiled while timed", float(r["compiled_while_timed"]["graphs"]), "count", 0.0)]
    return goal_rows(rows)


def measure_compiled(wl: Workload, device: torch.device, cfg: CompiledConfig) -> dict[str, Any]:
    """Both variants compiled, warmed up, then timed in alternating blocks; warnings kept once each."""
    torch._dynamo.reset()
    # Both models are instances of one class: by default dynamo does not guard on module
    # hooks, so the second model would run the first one's graphs, AdaFisher's without its
    # capture hooks (or Adam's with AdaFisher's graph breaks).  Guarding on them gives each
    # model its own graphs, as each has when it is the only one compiled.
    with warnings.catch_warnings(record=True) as caught, torch._dynamo.config.patch(skip_nnmodule_hook_guards=False):
        warnings.simplefilter("always")
        trainers = compiled_trainers(wl, device, cfg)
        compiled = {name: warm_up(t, cfg, device) for name, t in trainers.items()}
        health = trainers["adafisher"].opt.health
        if health["modules_not_fired"] or not health["capture_steps"]:
            raise RuntimeError(f"the compiled model's capture hooks did not fire ({health}): the figures would "
                               "time AdaFisher without its captures")
        compiled["adafisher"]["capture_steps"] = health["capture_steps"]

        def block(t: Trainer) -> float:
            return elapsed_ms(functools.partial(t.steps, cfg.block), device) / cfg.block

        before = dynamo_counts()
        times = interleaved({k: functools.partial(block, t) for k, t in trainers.items()}, cfg.blocks)
        while_timed = _delta(before, dynamo_counts())
        backend = trainers["adafisher"].opt.backend
    del trainers
    free_memory(device)
    torch._dynamo.reset()
    return {"description": wl.description, "optimizer": wl.ada_cls.__name__,
            "baseline": f"{wl.adam_cls.__name__}(fused=True)", "backend": backend, "compiler": cfg.backend,
            **summarise(times, compiled, while_timed), "warnings": sorted({str(w.message) for w in caught})}


def run_compiled(names: list[str], all_workloads: dict[str, Workload], device: torch.device, cfg: CompiledConfig,
                 log: Callable[[str], None] = print) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in names:
        log(f"== compiled: {all_workloads[name].description}, torch.compile({cfg.backend}) on {device}")
        out[name] = measure_compiled(all_workloads[name], device, cfg)
    return {"config": asdict(cfg), "workloads": out}


def compiled_table(r: dict[str, Any]) -> str:
    """Milliseconds and compile figures behind the ratios: median [p10, p90]."""
    ms = spread_text
    lines = []
    for name, w in r["workloads"].items():
        c, br = w["compile"], w["block_ratio"]
        lines += [f"compiled {name}: {w['description']} ({w['optimizer']} [{w['backend']}] vs {w['baseline']}, "
                  f"torch.compile {w['compiler']})",
                  f"  ms/step: Adam {ms(w['adam_ms'])}; AdaFisher {ms(w['adafisher_ms'])}; ratio {w['ratio']:.4f} "
                  f"(per block {br['median']:.4f} [{br['p10']:.4f}, {br['p90']:.4f}])",
                  "  warm-up: " + "; ".join(f"{v} {c[v]['seconds']:.1f} s, {c[v]['graphs']} graphs, "
                                            f"{c[v]['graph_breaks']} breaks, {c[v]['recompile_limit']} at the recompile limit"
                                            for v in VARIANTS)]
        lines += [f"  warning: {x}" for x in w["warnings"]]
    return "\n".join(lines)


__all__ = ["COMPILED_WORKLOADS", "CompiledConfig", "compiled_goals", "compiled_table", "dynamo_counts",
           "measure_compiled", "run_compiled", "summarise"]
