"""The workloads of the benchmark's matrix: what users train, each with its batch, loss,
precision and memory format, in a full size for a GPU and a tiny one for ``--quick``.

A :class:`Workload` builds a fresh model (already on the device and in its memory format),
one fixed batch, and runs one forward + loss under its autocast; the matrix (``matrix.py``)
does the timing.
"""

from __future__ import annotations

import argparse
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, ContextManager, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import AdaFisher, AdaFisherW
from ..models import ResNet18
from ..models.gpt import GPT, lm_loss
from ..models.resnet50 import ResNet50

#: The matrix's workloads, in the order they run and print.
NAMES = ("resnet18", "resnet18-bf16cl", "resnet50", "gpt")


@dataclass
class Workload:
    name: str
    description: str
    make_model: Callable[[], nn.Module]
    make_batch: Callable[[torch.device], tuple[Tensor, Tensor]]
    loss_fn: Callable[[Tensor, Tensor], Tensor]
    ada_cls: type  # AdaFisher or AdaFisherW
    lr: float
    weight_decay: float
    autocast: Optional[torch.dtype] = None
    channels_last: bool = False
    #: the capture-step goal: "ms" (at most 1 ms above a normal step) or "ratio" (at most 5% above)
    capture_goal: str = "ratio"

    @property
    def adam_cls(self) -> type:
        return torch.optim.AdamW if self.ada_cls is AdaFisherW else torch.optim.Adam

    def model(self, device: torch.device, seed: int = 0) -> nn.Module:
        """A fresh model, the same weights for every optimizer (one seed)."""
        torch.manual_seed(seed)
        with device:  # built where it runs: a 163M-parameter LM initialises in seconds on a CPU
            m = self.make_model()
        return m.to(memory_format=torch.channels_last) if self.channels_last else m

    def batch(self, device: torch.device) -> tuple[Tensor, Tensor]:
        torch.manual_seed(1)
        x, y = self.make_batch(device)
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x, y

    def precision(self, device: torch.device) -> ContextManager:
        return torch.autocast(device.type, dtype=self.autocast) if self.autocast is not None else nullcontext()

    def loss(self, model: nn.Module, x: Tensor, y: Tensor, device: torch.device) -> Tensor:
        with self.precision(device):
            return self.loss_fn(model(x), y)


def resnet50_batch(device: torch.device) -> int:
    """ResNet-50's batch sized to the device: 128 on an 80 GB+ GPU, 64 on a 40 GB one, else 32."""
    if device.type != "cuda":
        return 32
    total = torch.cuda.get_device_properties(device).total_memory
    return 128 if total >= 70e9 else 64 if total >= 35e9 else 32


def workloads(device: torch.device, quick: bool) -> dict[str, Workload]:
    """Every workload by name, full-sized or (``quick``) tiny enough for a CPU."""
    def images(bs: int, px: int, classes: int):
        return lambda dev: (torch.randn(bs, 3, px, px, device=dev), torch.randint(0, classes, (bs,), device=dev))

    r18_bs, r18_width = (4, 8) if quick else (256, 64)
    r50_bs, r50_px, r50_width = (2, 64, 8) if quick else (resnet50_batch(device), 224, 64)
    vocab, dim, depth, heads, bs, T = (128, 32, 2, 2, 2, 16) if quick else (50257, 768, 12, 12, 16, 512)

    def tokens(dev: torch.device) -> tuple[Tensor, Tensor]:
        seq = torch.randint(0, vocab, (bs, T + 1), device=dev)
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    r18 = dict(make_model=lambda: ResNet18(10, 3, r18_width), make_batch=images(r18_bs, 32, 10),
               loss_fn=F.cross_entropy, ada_cls=AdaFisher, lr=1e-3, weight_decay=5e-4, capture_goal="ms")
    return {
        "resnet18": Workload("resnet18", f"CIFAR ResNet-18 (width {r18_width}) b{r18_bs}, fp32", **r18),
        "resnet18-bf16cl": Workload("resnet18-bf16cl", f"CIFAR ResNet-18 (width {r18_width}) b{r18_bs}, bf16 autocast + channels_last",
                                    autocast=torch.bfloat16, channels_last=True, **r18),
        "resnet50": Workload("resnet50", f"ResNet-50 (width {r50_width}) {r50_px}px b{r50_bs}, bf16 autocast + channels_last",
                             make_model=lambda: ResNet50(1000, 3, r50_width), make_batch=images(r50_bs, r50_px, 1000),
                             loss_fn=F.cross_entropy, ada_cls=AdaFisher, lr=1e-3, weight_decay=5e-5,
                             autocast=torch.bfloat16, channels_last=True),
        "gpt": Workload("gpt", f"GPT decoder {depth}x{dim}, {heads} heads, vocab {vocab}, b{bs}x{T}, bf16 autocast, AdaFisherW",
                        make_model=lambda: GPT(vocab, dim, depth, heads, max(T, 16)), make_batch=tokens,
                        loss_fn=lm_loss, ada_cls=AdaFisherW, lr=3e-4, weight_decay=0.1, autocast=torch.bfloat16),
    }


def script_arguments(description: str, counts: dict[str, tuple],
                     argv: Optional[Sequence[str]] = None,
                     switches: Optional[dict[str, str]] = None, per_workload: bool = True) -> argparse.Namespace:
    """The arguments of a script that measures the matrix's workloads one by one
    (``scripts/statistics_bandwidth.py``, ``scripts/step_bandwidth.py``): ``--workload`` (a
    name or all), ``--device`` (cuda, or cpu for a smoke run), ``--quick`` (the tiny
    workloads), the script's counts (``counts``: flag -> (default, help) for a count of at
    least 1, or (default, help, least)), checked, each error naming its flag, and its on/off
    switches (``switches``: flag -> help, off unless given).  ``per_workload`` False: a
    script that picks its own models (``scripts/host_costs.py``), without ``--workload`` and
    ``--quick``."""
    ap = argparse.ArgumentParser(description=description)
    if per_workload:
        ap.add_argument("--workload", default="all", help=f"one of {', '.join(NAMES)} or all (default)")
        ap.add_argument("--quick", action="store_true", help="the tiny workloads")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke run)")
    for flag, (default, text, *_) in counts.items():
        ap.add_argument(f"--{flag}", type=int, default=default, help=f"{text} (default {default})")
    for flag, text in (switches or {}).items():
        ap.add_argument(f"--{flag}", action="store_true", help=text)
    args = ap.parse_args(argv)
    if per_workload and args.workload != "all" and args.workload not in NAMES:
        raise SystemExit(f"--workload: unknown workload '{args.workload}'; choose from {', '.join(NAMES)} or all")
    for flag, (_, _, *least) in counts.items():
        lowest, value = (least[0] if least else 1), getattr(args, flag.replace("-", "_"))  # (argparse's dest)
        if value < lowest:
            raise SystemExit(f"--{flag} must be at least {lowest}, got {value}")
    if args.device not in ("cuda", "cpu"):
        raise SystemExit(f"--device: expected cuda or cpu, got '{args.device}'")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (pass --device cpu"
                         + (" --quick" if per_workload else "") + " for a smoke run)")
    return args


def print_reports(args: argparse.Namespace, report: Callable[[Workload, torch.device, argparse.Namespace], str]) -> int:
    """Print ``report(workload, device, args)`` for each workload :func:`script_arguments`'
    ``--workload`` names, built for ``--device``, as each is done; the script's exit status."""
    device = torch.device(args.device)
    every = workloads(device, args.quick)
    for name in NAMES if args.workload == "all" else [args.workload]:
        print(report(every[name], device, args), flush=True)
    return 0
