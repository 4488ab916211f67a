"""How close the capture statistics come to the memory bandwidth, layer by layer, on the
bench's workloads: each captured layer's one statistics call (what a tap runs when the
layer's output gradient arrives) timed on that layer's real input and output gradient,
beside torch's own full reduction of the same two tensors (of a strided 1 x 1 convolution's
input, the positions under its tap: what its statistics need, and the floor counts).

    python scripts/statistics_bandwidth.py --workload resnet50
    python scripts/statistics_bandwidth.py --workload resnet50 --kernels 3   # and the 3 worst, kernel by kernel
    python scripts/statistics_bandwidth.py --quick --device cpu --workload resnet18   # a smoke run

Why: the statistics kernels are memory-bound, so their device time is bytes over the
bandwidth they reach.  ``profile_capture.py`` gives their time per kernel name, summed over
layers; ``statistics_floor.py`` the bytes at the peak bandwidth.  Neither says which layers'
reads fall short, nor whether another kernel reads the same bytes faster.  This does:
torch's ``sum`` of both tensors (one reduction kernel each, a well-tuned read) is a
bandwidth that a read of those bytes demonstrably reaches on this device; where the
package's call is slower than it, the kernel (or its grid) leaves bandwidth unused, and
the layers' shapes say where.

What is timed per layer: ``FusedStats.run`` (the extension's ``layer_stats``: the input's
statistics and the gradient's, with their allocation of the two small outputs; where one
kernel reads both, one launch reads them together), the same sums *apart* (on a GPU: the
input's op, ``conv_input_stats`` or ``channel_stats``, then the gradient's ``channel_stats``,
so a shared launch that costs more than its parts shows), and
``x.sum(dtype=float32)`` plus ``g.sum(dtype=float32)``: the device time of the kernels each
launches (``torch.profiler``), ``--reps`` calls a layer in each of ``--rounds`` profiled
passes over every layer, the median per call.  Device time, not the time between two
events: back-to-back calls of a small layer are bounded by the host's launch rate (a few us
a launch), which would hide what the kernels take.  Norms whose capture reads neither
tensor (a training batch norm, a layer norm with a bias: they use the means autograd saved)
are left out, as in the floor; a Linear on an autocast copy of its input is given that copy
(its capture reads the one autograd saved), as the floor counts it.

``--kernels N`` then breaks down the N layers whose one call takes most above the ops apart
(above torch's read where there is no apart) kernel by kernel (``us_per_kernel``), on the
layer's real tensors and on fresh random ones of the same shape and strides: whether a slow
call is one kernel, and whether it follows the values or the layout.

These calls run out of the step, and a call's time here can differ from its time in one:
on the H200 at 45e49de this pass gave ResNet-50's layer3.x.conv2 calls 80-82 us, their
breakdown 27 us, and a real capture step 30 us for the same two kernels
(``docs/results/statistics-bandwidth-h200-45e49de.txt``).  ``step_kernels.py`` times the
kernels in real capture steps.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Callable, Optional

import torch
from torch import Tensor

from lightning_cafin.bench.floor import peak_bandwidth, reads_autocast_copy, reads_nothing, tap_positions_share
from lightning_cafin.bench.timing import device_us_per_call, us_per_kernel
from lightning_cafin.bench.workloads import Workload, print_reports, script_arguments
from lightning_cafin.capture.rules.base import FusedStats
from lightning_cafin.kernels import load_extension


@dataclass
class LayerPair:
    """One captured layer's statistics call and the two tensors it reads."""

    name: str
    x: Tensor
    grad: Tensor
    run: Callable[[], object]  # the package's statistics call on (x, grad)
    what: str  # whose input statistics: "conv" (a convolution's: window, border, parity or tap sums) or "rows" (per-channel)
    apart: Optional[Callable[[], object]] = None  # the same sums by the input's op and the gradient's (GPU only)
    stats: Optional[FusedStats] = None  # the layer's rule's plan of the call
    x_read: Optional[Tensor] = None  # what of x the statistics need (tap_positions), where not all of it

    @property
    def read(self) -> Tensor:
        return self.x if self.x_read is None else self.x_read

    @property
    def nbytes(self) -> int:
        return self.read.numel() * self.read.element_size() + self.grad.numel() * self.grad.element_size()

    def describe(self) -> str:
        layout = "cl" if self.x.dim() == 4 and self.x.is_contiguous(memory_format=torch.channels_last) \
            and not self.x.is_contiguous() else ""
        dtype = str(self.x.dtype).replace("torch.", "")
        return f"{tuple(self.x.shape)} {dtype}{' ' + layout if layout else ''} -> {tuple(self.grad.shape)}"


def layer_pairs(wl: Workload, device: torch.device) -> list[LayerPair]:
    """Every captured layer's (input, output gradient) from one forward and backward of the
    workload's batch, with the statistics call the layer's rule plans for that pair."""
    ext = load_extension()
    model = wl.model(device)
    model.train()
    captures = wl.ada_cls(model, lr=wl.lr, weight_decay=wl.weight_decay).binding.captures
    seen: dict[str, list] = {}

    def keep(name: str):
        def hook(module: torch.nn.Module, inputs: tuple, output: Tensor) -> None:
            if reads_nothing(module, inputs[0]):
                return
            # (a Linear on an autocast copy: its capture reads the copy, equal to this cast)
            x = inputs[0].detach()
            x = x.to(output.dtype) if reads_autocast_copy(module, inputs[0], output) else x
            entry = seen[name] = [x, None, tap_positions(module, x, output)]
            output.register_hook(lambda g: entry.__setitem__(1, g.detach()))
        return hook

    handles = [cap.module.register_forward_hook(keep(name)) for name, cap in captures.items()]
    try:
        x, y = wl.batch(device)
        wl.loss(model, x, y, device).backward()
    finally:
        for h in handles:
            h.remove()
    pairs = []
    for name, (inp, grad, read) in seen.items():
        if grad is None:
            continue
        stats = captures[name].fused_stats(inp, grad)
        if stats is None:
            continue
        pairs.append(LayerPair(name, inp, grad, lambda s=stats, a=inp, b=grad: s.run(ext, a, b, False),
                               "conv" if stats.input_op[0] == 1 else "rows",
                               ops_apart(ext, stats, inp, grad) if device.type == "cuda" else None, stats, read))
    return pairs


def tap_positions(module: torch.nn.Module, x: Tensor, output: Tensor) -> Optional[Tensor]:
    """The positions of ``x`` a 1 x 1 convolution without padding at a stride reads (every
    stride-th row and column, as many as its output has: the floor's count,
    ``tap_positions_share``), or None where its statistics need all of ``x``."""
    if tap_positions_share(module, x, output) == 1.0:
        return None
    # (a Conv1d/2d/3d keeps its stride as a tuple of one entry per spatial dim)
    return x[(slice(None), slice(None)) + tuple(slice(None, None, st) for st in module.stride)]


def ops_apart(ext: ModuleType, stats: FusedStats, x: Tensor, grad: Tensor) -> Callable[[], tuple[Tensor, Tensor]]:
    """``stats`` (a ``FusedStats``) as the extension's two ops apart, ``(h, s)`` as its one call
    gives them: the input's ``conv_input_stats`` (``input_op`` ``(1, kh, kw, sh, sw, pad_top,
    pad_left, dh, dw, groups, Ho, Wo)``, a 3-D input read as height 1) or ``channel_stats``
    (``(0, dim, square)``), then the gradient's ``channel_stats``.  CUDA tensors only."""
    op = stats.input_op
    if op[0] == 1:
        kh, kw, sh, sw, pt, pl, dh, dw, groups, ho, wo = op[1:]
        x4 = x if x.dim() == 4 else x.unsqueeze(-2)

        def inputs() -> Tensor:
            return ext.conv_input_stats(x4, [kh, kw], [sh, sw], [pt, pl], [dh, dw], groups, [ho, wo])
    else:
        def inputs() -> Tensor:
            return ext.channel_stats(x, op[1], bool(op[2]), stats.input_div)
    return lambda: (inputs(), ext.channel_stats(grad, stats.grad_dim, stats.grad_square, stats.grad_div))


def torch_read(pair: LayerPair) -> Callable[[], object]:
    return lambda: (pair.read.sum(dtype=torch.float32), pair.grad.sum(dtype=torch.float32))


def like(t: Tensor) -> Tensor:
    """Fresh standard-normal values in a tensor of ``t``'s shape, strides, dtype and device."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).normal_()


def kernel_lines(pair: LayerPair, reps: int) -> list[str]:
    """``pair``'s one call and (on a GPU) its ops apart, kernel by kernel, on its real tensors
    and on random ones of the same layout."""
    ext = load_extension()
    device = pair.x.device
    lines = [f"  {pair.name}: {pair.describe()}"]
    for values, x, grad in (("real", pair.x, pair.grad), ("random", like(pair.x), like(pair.grad))):
        calls = [("one call", lambda a=x, b=grad: pair.stats.run(ext, a, b, False))]
        if pair.apart is not None:
            calls.append(("apart", ops_apart(ext, pair.stats, x, grad)))
        for how, fn in calls:
            kernels = us_per_kernel(fn, device, reps)
            lines.append(f"    {values:<6} {how:<8} {sum(us for us, _ in kernels.values()):8.1f} us: "
                         + ", ".join(f"{name} {us:.1f}" + (f" x{n:g}" if n != 1 else "")
                                     for name, (us, n) in kernels.items()))
    return lines


def report(wl: Workload, device: torch.device, reps: int, rounds: int, top: int, kernels: int = 0) -> str:
    pairs = layer_pairs(wl, device)
    times = device_us_per_call([[p.run, torch_read(p)] + ([p.apart] if p.apart else []) for p in pairs], device, reps,
                               rounds)
    rows = [(p, t[0], t[1]) for p, t in zip(pairs, times)]
    apart = {p.name: t[2] for p, t in zip(pairs, times) if len(t) > 2}  # (a GPU's)
    peak = peak_bandwidth(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [f"workload {wl.name}: {wl.description}; {len(pairs)} layers whose statistics read their tensors; {name}"
             + (f", peak {peak / 1e12:.2f} TB/s" if peak else "")]

    def gbs(nbytes: float, us: float) -> float:
        return nbytes / (us * 1e-6) / 1e9 if us > 0 else float("nan")

    for what in ("conv", "rows", "all"):
        chosen = [r for r in rows if what == "all" or r[0].what == what]
        if not chosen:
            continue
        nbytes = sum(r[0].nbytes for r in chosen)
        ours, ref = sum(r[1] for r in chosen), sum(r[2] for r in chosen)
        lines.append(f"  {what:>6}: {len(chosen):3d} layers, {nbytes / 1e6:9.1f} MB: package {ours:9.1f} us"
                     f" ({gbs(nbytes, ours):6.0f} GB/s), torch sum {ref:9.1f} us ({gbs(nbytes, ref):6.0f} GB/s),"
                     f" package / torch {ours / ref:5.2f}x" + (f", floor {nbytes / peak * 1e6:8.1f} us" if peak else "")
                     + (f"; the ops apart {sum(apart[r[0].name] for r in chosen):9.1f} us" if apart else ""))
    lines.append(f"the {min(top, len(rows))} layers where the package takes most above torch's read "
                 f"({'device' if device.type == 'cuda' else 'host'} us per call"
                 + ("; apart: the same sums by the input's op and the gradient's" if apart else "") + "):")
    lines.append(f"  {'above':>8} {'package':>8} {'torch':>8}" + (f" {'apart':>8}" if apart else "")
                 + f" {'GB/s':>6}  {'MB':>7}  how    layer: input -> gradient")
    for p, ours, ref in sorted(rows, key=lambda r: r[2] - r[1])[:top]:
        lines.append(f"  {ours - ref:+8.1f} {ours:8.1f} {ref:8.1f}" + (f" {apart[p.name]:8.1f}" if apart else "")
                     + f" {gbs(p.nbytes, ours):6.0f}  {p.nbytes / 1e6:7.1f}  {p.what:<6} {p.name}: {p.describe()}")
    if kernels:
        worst = sorted(rows, key=lambda r: apart.get(r[0].name, r[2]) - r[1])[:kernels]
        lines.append(f"the {len(worst)} layers whose one call takes most above "
                     + ("the ops apart" if apart else "torch's read")
                     + f", kernel by kernel ({'device' if device.type == 'cuda' else 'host'} us per call):")
        for p, _, _ in worst:
            lines += kernel_lines(p, reps)
    return "\n".join(lines)


#: the script's counts: flag -> (default, help[, least value: 1 where not given])
COUNTS = {"reps": (10, "calls between two events"), "rounds": (5, "interleaved rounds per layer"),
          "top": (15, "layers listed per workload"),
          "kernels": (0, "layers then broken down kernel by kernel", 0)}


def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    return script_arguments(__doc__.split("\n\n")[0], COUNTS, argv)


def main(argv: Optional[list[str]] = None) -> int:
    return print_reports(parse(argv), lambda wl, device, a: report(wl, device, a.reps, a.rounds, a.top, a.kernels))


if __name__ == "__main__":
    sys.exit(main())
