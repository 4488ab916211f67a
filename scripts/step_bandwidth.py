"""How close the fused optimizer step comes to the memory bandwidth on the bench's
workloads, beside torch's fused Adam(W) and a plain copy of as many bytes.

    python scripts/step_bandwidth.py --workload gpt
    python scripts/step_bandwidth.py --quick --device cpu --workload resnet18   # a smoke run

Why: the bench's optimizer-step row (``optimizer_step.vs_adam_ratio``, goal at most 0.6x)
is a ratio of two memory-bound steps.  AdaFisher's step reads the parameter, its gradient
and its momentum and writes the parameter and the momentum (the factors it also reads are
a few hundred KB); Adam's reads and writes a second moment besides.  Where AdaFisher's
ratio misses its goal, the question is whether its kernel leaves bandwidth unused, and a
copy of the same bytes (``torch.Tensor.copy_``: half read, half written) is a bandwidth a
stream of these bytes demonstrably reaches on this device.

What is timed, per workload: ``optimizer.step()`` of AdaFisher(W) as the bench builds it
(a normal step, its factors from one capture step) and of Adam(W)(fused=True) on a twin
model, each on gradients from one backward of the workload's batch, and the copy: the
device time of the kernels each launches (``bench.timing.device_us_per_call``), ``--reps``
calls per profiled range, ``--rounds`` interleaved rounds, the median per call.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional

import torch
from torch import Tensor

from lightning_cafin.bench.matrix import NEVER  # (the schedule here: only the first step captures)
from lightning_cafin.bench.timing import device_us_per_call
from lightning_cafin.bench.workloads import Workload, print_reports, script_arguments


def moved_bytes(params: list[Tensor], state_tensors: list[Tensor]) -> int:
    """The bytes one step moves at least: each parameter read and written, its gradient read,
    each state tensor read and written."""
    tensors = sum(2 * p.numel() * p.element_size() + p.grad.numel() * p.grad.element_size() for p in params)
    return tensors + sum(2 * s.numel() * s.element_size() for s in state_tensors)


def trained_once(wl: Workload, device: torch.device, make_opt: Callable) -> tuple[torch.optim.Optimizer, int]:
    """A fresh model with gradients from one backward, its optimizer after one step (its
    state made), and the bytes its step moves."""
    model = wl.model(device)
    opt = make_opt(model)
    x, y = wl.batch(device)
    wl.loss(model, x, y, device).backward()
    opt.step()
    params = [p for p in model.parameters() if p.grad is not None]
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, Tensor) and v.numel() > 1]
    return opt, moved_bytes(params, state)


def report(wl: Workload, device: torch.device, reps: int, rounds: int) -> str:
    ada, ada_bytes = trained_once(wl, device, lambda m: wl.ada_cls(m, lr=wl.lr, weight_decay=wl.weight_decay,
                                                                    TCov=NEVER))
    adam, adam_bytes = trained_once(wl, device, lambda m: wl.adam_cls(m.parameters(), lr=wl.lr,
                                                                      weight_decay=wl.weight_decay, fused=True))
    half = ada_bytes // 2
    src, dst = torch.empty(half, dtype=torch.uint8, device=device), torch.empty(half, dtype=torch.uint8, device=device)
    src.fill_(1)
    (ada_us, adam_us, copy_us), = device_us_per_call([[ada.step, adam.step, lambda: dst.copy_(src)]], device,
                                                     reps, rounds)

    def gbs(nbytes: int, us: float) -> str:
        return f"{nbytes / (us * 1e-6) / 1e9:6.0f} GB/s" if us > 0 else "   n/a GB/s"

    unit = "device" if device.type == "cuda" else "host"
    return "\n".join([
        f"workload {wl.name}: {wl.description}; {unit} us per step, median of {rounds} rounds of {reps}",
        f"  {wl.ada_cls.__name__:<22} {ada_us:9.1f} us  {ada_bytes / 1e9:6.3f} GB  {gbs(ada_bytes, ada_us)}",
        f"  {wl.adam_cls.__name__ + '(fused=True)':<22} {adam_us:9.1f} us  {adam_bytes / 1e9:6.3f} GB  "
        f"{gbs(adam_bytes, adam_us)}",
        f"  {'copy of as many bytes':<22} {copy_us:9.1f} us  {2 * half / 1e9:6.3f} GB  {gbs(2 * half, copy_us)}",
        f"  step vs {wl.adam_cls.__name__}: {ada_us / adam_us:.3f}x; vs the copy: {ada_us / copy_us:.3f}x",
    ])


#: the script's counts: flag -> (default, help)
COUNTS = {"reps": (10, "steps per profiled range"), "rounds": (5, "interleaved rounds")}


def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    return script_arguments(__doc__.split("\n\n")[0], COUNTS, argv)


def main(argv: Optional[list[str]] = None) -> int:
    return print_reports(parse(argv), lambda wl, device, a: report(wl, device, a.reps, a.rounds))


if __name__ == "__main__":
    sys.exit(main())
