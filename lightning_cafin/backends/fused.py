"""The ``fused`` backend: one CUDA multi-tensor launch per (device, dtype) group.

Python only groups the tensors and calls the extension's ``adafisher_step_`` op;
the kernel rebuilds ``F = S[row] * H[col] + Lambda`` in registers, applies momentum,
weight decay and the parameter write in one pass, honours a loss scaler's
``grad_scale`` / ``found_inf`` on the device and increments the device-resident step
counts.  A param group's ``lr`` may be a one-element device tensor, read by the
kernel, so a scheduler's in-place update reaches a captured CUDA graph.  The step
allocates nothing and never synchronises with the host, so it can be captured in a
CUDA graph.

What depends only on the parameters, their state and the factor views (grouping,
factor lists, validation) is derived once by :meth:`FusedBackend.prepare` and kept by
the dispatcher while the batch stays the same; per step only the gradient lists are
rebuilt.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor

from .base import StepBackend, StepBatch, StepHyper
from .layout import MemoryOrderCopies, channels_innermost, layout_reason, memory_columns
from .state import ensure_state

SUPPORTED_PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def unsupported_reason(param: Tensor, grad: Optional[Tensor] = None) -> Optional[str]:
    """``None`` when the fused step can update ``param`` (with ``grad``), else why not."""
    if not param.is_cuda:
        return f"it is on {param.device}, not a CUDA device"
    if param.dtype not in SUPPORTED_PARAM_DTYPES:
        return f"its dtype {param.dtype} is not float32, float16 or bfloat16"
    if grad is not None:
        if grad.device != param.device:
            return f"its gradient is on {grad.device}, the parameter on {param.device}"
        if grad.dtype != param.dtype:
            return f"its gradient has dtype {grad.dtype}, the parameter {param.dtype}"
    return layout_reason(param, grad)  # any dense layout with dim 0 outermost (layout.py)


@dataclass
class KernelGroup:
    """The gradient-independent arguments of one launch: one (device, dtype, momentum dtype)."""

    device: torch.device
    index: list[int] = field(default_factory=list)  # positions in the batch
    params: list[Tensor] = field(default_factory=list)
    exp_avgs: list[Tensor] = field(default_factory=list)
    steps: list[Tensor] = field(default_factory=list)
    S: list[Optional[Tensor]] = field(default_factory=list)
    H: list[Optional[Tensor]] = field(default_factory=list)
    col_offsets: list[int] = field(default_factory=list)
    ncols: list[int] = field(default_factory=list)
    #: per entry, ``C`` where the kernel reads ``H`` through a channels-innermost layout, else 1
    inners: list[int] = field(default_factory=list)
    #: memory-ordered copies of ``H`` for the entries walked in memory order (layout.py)
    permuted: MemoryOrderCopies = field(default_factory=MemoryOrderCopies)
    #: the factors version the copies in ``permuted`` were made from
    factors_version: int = -1

    def refresh(self, factors_version: int) -> None:
        """Rewrite the memory-ordered ``H`` copies in place once the factors changed."""
        if len(self.permuted) and factors_version != self.factors_version:
            self.permuted.refresh()
        self.factors_version = factors_version


@dataclass(frozen=True)
class KernelScalars:
    """The update's scalars as the kernel takes them, on the group's device where tensors."""

    lr: float
    beta: float
    Lambda: float
    weight_decay: float
    decoupled: bool
    grad_scale: Optional[Tensor]
    found_inf: Optional[Tensor]
    lr_tensor: Optional[Tensor]


def on_device_f32(t: Optional[Tensor], device: torch.device) -> Optional[Tensor]:
    """``t`` as a float32 tensor on ``device`` (itself when it already is)."""
    if t is None or (t.device == device and t.dtype == torch.float32):
        return t
    return t.to(device, torch.float32, non_blocking=True)


class FusedBackend(StepBackend):
    """AdaFisher / AdaFisherW through the CUDA extension.

    ``momentum_dtype``: ``None`` keeps ``exp_avg`` in the parameter's dtype (as the
    other backends do); ``torch.float32`` keeps it in fp32 for fp16/bf16 parameters.
    """

    name = "fused"
    device_step = True
    skips_on_device = True

    def __init__(self, momentum_dtype: Optional[torch.dtype] = None) -> None:
        if momentum_dtype not in (None, torch.float32):
            raise ValueError(f"momentum_dtype must be None (the parameter's dtype) or torch.float32, got {momentum_dtype}")
        from ..kernels import load_extension

        self._ext = load_extension()  # RuntimeError naming the reason when unavailable
        self.momentum_dtype = momentum_dtype

    def unsupported_reason(self, param: Tensor, grad: Optional[Tensor] = None) -> Optional[str]:
        return unsupported_reason(param, grad)

    def init_state(self, param: Tensor, state: dict) -> None:
        """The state this backend needs for ``param`` (what the optimizer creates for it)."""
        ensure_state(param, state, device_step=True, momentum_dtype=self.momentum_dtype)

    # ------------------------------------------------------------------- plan
    def prepare(self, batch: StepBatch, previous: Any = None) -> list[KernelGroup]:
        """Validate the batch and group it into launches (checks name the bad tensor)."""
        n = len(batch.params)
        for name, lst in (("grads", batch.grads), ("exp_avgs", batch.exp_avgs), ("steps", batch.steps), ("views", batch.views)):
            if len(lst) != n:
                raise ValueError(f"FusedBackend: batch.{name} has {len(lst)} entries, batch.params has {n}")
        groups: dict[tuple, KernelGroup] = {}
        in_memory: list[tuple[KernelGroup, int]] = []  # (group, entry) of each memory-ordered copy, in order
        for i, (p, m, k, view) in enumerate(zip(batch.params, batch.exp_avgs, batch.steps, batch.views)):
            _check_entry(i, p, m, k, self.unsupported_reason(p))
            gkey = (p.device, p.dtype, m.dtype)
            group = groups.get(gkey)
            if group is None:
                group = groups[gkey] = KernelGroup(p.device, factors_version=batch.factors_version)
            group.index.append(i)
            group.params.append(p)
            group.exp_avgs.append(m)
            group.steps.append(k)
            if view is None:
                group.S.append(None)
                group.H.append(None)
                group.col_offsets.append(0)
                group.ncols.append(1)
                group.inners.append(1)
            else:
                for fname, f in (("S", view.S), ("H", view.H)):
                    if f.device != p.device or f.dtype != torch.float32 or f.dim() != 1 or not f.is_contiguous():
                        raise RuntimeError(
                            f"FusedBackend: factor {fname} of parameter {i} must be a contiguous float32 vector on "
                            f"{p.device}, got {f.dtype} shape {tuple(f.shape)} on {f.device}"
                        )
                group.S.append(view.S)
                # channels_last conv weights (a row per output channel): the kernel maps the columns itself
                inner = channels_innermost(p) if view.S.numel() == p.shape[0] else 1
                if inner == 1 and not p.is_contiguous():  # another dense layout: a copy, refreshed by step()
                    group.permuted.add(view.H, int(view.col_offset), memory_columns(p))
                    group.H.append(None)  # (the copy, once every entry is planned: below)
                    group.col_offsets.append(0)  # the copy holds the parameter's segment alone
                    in_memory.append((group, len(group.H) - 1))
                else:
                    group.H.append(view.H)
                    group.col_offsets.append(int(view.col_offset))
                group.ncols.append(int(view.ncols))
                group.inners.append(inner)
        copies = {id(g): iter(g.permuted.copies()) for g in groups.values() if len(g.permuted)}
        for group, j in in_memory:
            group.H[j] = next(copies[id(group)])
        return list(groups.values())

    # ------------------------------------------------------------------- step
    @torch.no_grad()
    def step(
        self,
        batch: StepBatch,
        hyper: StepHyper,
        grad_scale: Optional[Tensor] = None,
        found_inf: Optional[Tensor] = None,
        prepared: Any = None,
    ) -> None:
        if not batch.params:
            return
        groups: list[KernelGroup] = prepared if prepared is not None else self.prepare(batch)
        lr_tensor = hyper.lr if isinstance(hyper.lr, Tensor) else None
        lr = 0.0 if lr_tensor is not None else float(hyper.lr)  # a tensor lr is never read on the host
        for group in groups:
            group.refresh(batch.factors_version)
            # The dispatcher hands each device its own copies of the scaler's tensors and
            # of a tensor lr; a batch given directly may need them copied here.
            scalars = KernelScalars(
                lr, float(hyper.beta), float(hyper.Lambda), float(hyper.weight_decay), bool(hyper.decoupled),
                on_device_f32(grad_scale, group.device), on_device_f32(found_inf, group.device),
                on_device_f32(lr_tensor, group.device),
            )
            try:
                self._launch(group, batch.grads, scalars)
            except RuntimeError as exc:
                dtype = group.params[0].dtype
                raise RuntimeError(
                    f"FusedBackend ({dtype} group on {group.device}; entry j of the op is batch parameter "
                    f"{group.index if len(group.index) <= 16 else 'group.index[j]'}[j]): {exc}"
                ) from exc

    def _launch(self, group: KernelGroup, grads: list[Tensor], s: KernelScalars) -> None:
        self._ext.adafisher_step_(
            group.params,
            [grads[i] for i in group.index],
            group.exp_avgs,
            group.steps,
            group.S,
            group.H,
            group.col_offsets,
            group.ncols,
            group.inners,
            s.lr,
            s.beta,
            s.Lambda,
            s.weight_decay,
            s.decoupled,
            s.grad_scale,
            s.found_inf,
            s.lr_tensor,
        )


def _check_entry(i: int, p: Tensor, m: Tensor, k: Tensor, why: Optional[str]) -> None:
    if why is not None:
        raise RuntimeError(
            f"FusedBackend cannot step parameter {i} (shape {tuple(p.shape)}): {why}; use the 'foreach' backend for it"
        )
    same_layout = m.is_contiguous() if p.is_contiguous() else tuple(m.stride()) == tuple(p.stride())
    if m.device != p.device or m.dtype not in (p.dtype, torch.float32) or m.shape != p.shape or not same_layout:
        raise RuntimeError(
            f"FusedBackend: exp_avg of parameter {i} must be a tensor of the parameter's shape and strides (contiguous "
            f"when it is) on {p.device} in {p.dtype} or float32, got {m.dtype} strides {tuple(m.stride())} on {m.device}"
        )
    if k.device != p.device or k.dtype != torch.float32 or k.numel() != 1:
        raise RuntimeError(
            f"FusedBackend: step of parameter {i} must be a float32 scalar on {p.device}, got {k.dtype} on "
            f"{k.device}; call FusedBackend.init_state(param, state) first (it moves the count to the device)"
        )
