"""Several GPUs: AdaFisher under DDP and FSDP2 against fused Adam(W), and parity with one GPU.

    torchrun --nproc-per-node N benchmarks/multigpu.py --out docs/results/multigpu-h200
    python benchmarks/multigpu.py --quick --out /tmp/mg     # one CPU process (gloo), a smoke run

Each rank trains the benchmark's CIFAR ResNet-18 and GPT-style LM (``lightning_cafin.bench``
workloads, the same per-GPU batch at every N: weak scaling) under each strategy with three
optimizers, timed in interleaved blocks of steps (pipelined: one synchronisation per
block): fused Adam(W), AdaFisher at TCov = 100 and at TCov = 10.  Also measured per rank:
the collectives and bytes AdaFisher's ``step()`` sends on a normal and on a capture step
(the strategy's own gradient traffic is outside ``step()``), and the peak memory.  With
``--parity``, float32 AdaFisher at TCov = 2 for 7 steps on the global batch split over
the ranks is compared per step with one replica on rank 0 that trains on the same
micro-batches.  Rank 0 writes ``<out>/multigpu-<N>.json`` with provenance; the NVLink
multicast switches are set off as the multi-GPU machines set them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any, Callable, Optional

for _key in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ.setdefault(_key, "0" if _key == "NCCL_NVLS_ENABLE" else "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lightning_cafin import AdaFisher, AdaFisherW  # noqa: E402
from lightning_cafin.bench.collectives import CountCollectives  # noqa: E402
from lightning_cafin.bench.timing import elapsed_ms, sync  # noqa: E402
from lightning_cafin.bench.workloads import Workload, workloads  # noqa: E402
from lightning_cafin.provenance import provenance  # noqa: E402

STRATEGIES = ("ddp", "fsdp2")


def setup() -> tuple[int, int, torch.device]:
    if "RANK" not in os.environ:  # one process without torchrun
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29571"))
    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    return dist.get_rank(), dist.get_world_size(), device


def wrap(model: nn.Module, strategy: str, device: torch.device) -> nn.Module:
    """The model the loss runs through: DDP around it, or FSDP2 applied to it in place
    (each block of a ``ModuleList`` or ``Sequential`` child, then the root)."""
    if strategy == "ddp":
        return nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    from torch.distributed.fsdp import fully_shard

    for child in model.children():
        units = list(child) if isinstance(child, (nn.ModuleList, nn.Sequential)) else []
        for unit in units:
            if any(p.requires_grad for p in unit.parameters()):
                fully_shard(unit)
    fully_shard(model)
    return model


def make(wl: Workload, strategy: str, device: torch.device, optimizer: str) -> tuple[Callable[[], None], Any]:
    """One training step of ``wl`` under ``strategy`` with ``optimizer``, and the optimizer."""
    model = wl.model(device)
    net = wrap(model, strategy, device)
    if optimizer == "adam":
        try:
            opt: Any = wl.adam_cls(model.parameters(), lr=wl.lr, weight_decay=wl.weight_decay, fused=device.type == "cuda")
        except (RuntimeError, TypeError):  # a torch whose fused Adam does not take DTensors
            opt = wl.adam_cls(model.parameters(), lr=wl.lr, weight_decay=wl.weight_decay, foreach=True)
    else:
        opt = wl.ada_cls(model, lr=wl.lr, weight_decay=wl.weight_decay, TCov=int(optimizer.split("=")[1]))
    x, y = wl.batch(device)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        wl.loss(net, x, y, device).backward()
        opt.step()

    return step, opt


def time_variants(steps: dict[str, Callable[[], None]], device: torch.device, blocks: int, per_block: int) -> dict[str, list[float]]:
    for step in steps.values():
        for _ in range(3):
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(blocks):
        for name, step in steps.items():
            def block(step: Callable[[], None] = step) -> None:
                for _ in range(per_block):
                    step()
            dist.barrier()
            times[name].append(elapsed_ms(block, device) / per_block)
    return times


def communication(step: Callable[[], None], opt: Any) -> dict[str, Any]:
    """Collectives and bytes inside ``opt.step()`` on a normal and on a capture step."""
    out: dict[str, Any] = {}
    original = opt.step
    for _ in range(2 * opt.defaults["TCov"] + 1):
        kind = "capture" if opt.capture_due else "normal"
        counter = CountCollectives()

        def counted(*a: Any, counter: CountCollectives = counter, **k: Any) -> Any:
            with counter:
                return original(*a, **k)

        opt.step = counted
        step()
        opt.step = original
        out[kind] = {"collectives": len(counter.ops), "bytes": counter.bytes}
    return out


def peak_bytes(step: Callable[[], None], n: int, device: torch.device) -> Optional[int]:
    if device.type != "cuda":
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    for _ in range(n):
        step()
    sync(device)
    return int(torch.cuda.max_memory_allocated(device))


def parity(wl: Workload, strategy: str, device: torch.device, rank: int, world: int) -> float:
    """Largest per-step relative difference between the N-rank run and one replica (rank 0).

    Deterministic cuDNN, no TF32: AdaFisher's early steps are about ``lr / Lambda`` per
    element, so a nondeterministic convolution's last-bit differences grow to order one
    within a few steps through BatchNorm, and the comparison would measure that instead."""
    flags = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32,
             torch.backends.cuda.matmul.allow_tf32)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return _parity(wl, strategy, device, rank, world)
    finally:
        (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32,
         torch.backends.cuda.matmul.allow_tf32) = flags


def _parity(wl: Workload, strategy: str, device: torch.device, rank: int, world: int) -> float:
    cls = AdaFisherW if wl.ada_cls is AdaFisherW else AdaFisher
    model = wl.model(device).float()
    net = wrap(model, strategy, device)
    opt = cls(model, lr=wl.lr, weight_decay=wl.weight_decay, TCov=2)
    replica = wl.model(device).float() if rank == 0 else None
    ropt = cls(replica, lr=wl.lr, weight_decay=wl.weight_decay, TCov=2) if replica is not None else None
    worst = 0.0
    for i in range(7):
        torch.manual_seed(100 + i)
        x, y = wl.make_batch(device)
        xs, ys = torch.cat([x] * world), torch.cat([y] * world)  # the global batch: every rank's
        xs = xs + 0.01 * torch.arange(world, device=device).repeat_interleave(x.shape[0]).view(-1, *[1] * (x.dim() - 1)) \
            if xs.is_floating_point() else xs
        opt.zero_grad()
        wl.loss_fn(net(xs.chunk(world)[rank]), ys.chunk(world)[rank]).backward()
        opt.step()
        full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
        if replica is not None and ropt is not None:
            ropt.zero_grad()
            for xm, ym in zip(xs.chunk(world), ys.chunk(world)):
                (wl.loss_fn(replica(xm), ym) / world).backward()
            ropt.step()
            for a, b in zip(full, replica.parameters()):
                worst = max(worst, float((a.detach() - b.detach()).abs().max() / b.detach().abs().max().clamp_min(1e-30)))
    return worst


def summary(times: list[float]) -> dict[str, float]:
    q = statistics.quantiles(times, n=10) if len(times) > 1 else [times[0]] * 9
    return {"median": statistics.median(times), "p10": q[0], "p90": q[-1]}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--workloads", default="resnet18,gpt")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--blocks", type=int, default=8, help="timed blocks per optimizer (interleaved)")
    ap.add_argument("--per-block", type=int, default=10, help="steps per block")
    ap.add_argument("--parity", action="store_true", help="also compare with one replica per step")
    ap.add_argument("--quick", action="store_true", help="tiny models (a CPU smoke run)")
    args = ap.parse_args(argv)
    rank, world, device = setup()
    all_workloads = workloads(device, args.quick)
    results: dict[str, Any] = {}
    for name in args.workloads.split(","):
        wl = all_workloads[name]
        for strategy in args.strategies.split(","):
            made = {opt: make(wl, strategy, device, opt) for opt in ("adam", "adafisher TCov=100", "adafisher TCov=10")}
            times = time_variants({k: v[0] for k, v in made.items()}, device, args.blocks, args.per_block)
            adam = times["adam"]
            entry: dict[str, Any] = {"ms_per_step": {k: summary(v) for k, v in times.items()}}
            for k in ("adafisher TCov=100", "adafisher TCov=10"):
                entry[f"ratio {k} vs adam"] = summary([a / b for a, b in zip(times[k], adam)])
            batch = wl.batch(device)[0].shape[0]
            entry["samples_per_s_per_gpu"] = {k: 1e3 * batch / v["median"] for k, v in entry["ms_per_step"].items()}
            entry["communication"] = communication(*made["adafisher TCov=10"])
            entry["peak_bytes"] = {k: peak_bytes(v[0], 11, device) for k, v in made.items()}
            if args.parity:
                entry["parity_max_rel"] = parity(wl, strategy, device, rank, world)
                entry["parity_deterministic"] = True  # cuDNN deterministic, no TF32 (see parity())
            results[f"{name}/{strategy}"] = entry
            del made
            if rank == 0:
                r = entry["ratio adafisher TCov=100 vs adam"]["median"]
                print(f"{name}/{strategy} N={world}: AdaFisher TCov=100 / Adam {r:.3f}x; step() sends "
                      f"{entry['communication']}", flush=True)
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        command = f"torchrun --nproc-per-node {world} benchmarks/multigpu.py " + " ".join(sys.argv[1:])
        (args.out / f"multigpu-{world}.json").write_text(json.dumps(
            {"provenance": provenance(device, command), "world_size": world, "results": results}, indent=1) + "\n")
        print(f"wrote {args.out / f'multigpu-{world}.json'}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
