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
factor lists, validation) is cached, keyed on ``batch.factors_version`` and the
identities of the tensors; per step only the gradient lists are rebuilt.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

import torch
from torch import Tensor

from .base import StepBackend, StepBatch, StepHyper

SUPPORTED_PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_CACHE_ENTRIES = 8


def unsupported_reason(param: Tensor, grad: Optional[Tensor] = None) -> Optional[str]:
    """``None`` when the fused step can update ``param`` (with ``grad``), else why not."""
    if not param.is_cuda:
        return f"it is on {param.device}, not a CUDA device"
    if param.dtype not in SUPPORTED_PARAM_DTYPES:
        return f"its dtype {param.dtype} is not float32, float16 or bfloat16"
    if not param.is_contiguous():
        return f"it is not contiguous (strides {tuple(param.stride())}, e.g. channels_last)"
    if grad is not None:
        if grad.device != param.device:
            return f"its gradient is on {grad.device}, the parameter on {param.device}"
        if grad.dtype != param.dtype:
            return f"its gradient has dtype {grad.dtype}, the parameter {param.dtype}"
        if grad.is_sparse or not grad.is_contiguous():
            return "its gradient is sparse or not contiguous"
    return None


class _Group:
    """The cached, gradient-independent part of one (device, dtype, momentum dtype) call."""

    __slots__ = ("device", "index", "params", "exp_avgs", "steps", "S", "H", "col_offsets", "ncols")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.index: list[int] = []
        self.params: list[Tensor] = []
        self.exp_avgs: list[Tensor] = []
        self.steps: list[Tensor] = []
        self.S: list[Optional[Tensor]] = []
        self.H: list[Optional[Tensor]] = []
        self.col_offsets: list[int] = []
        self.ncols: list[int] = []


class FusedBackend(StepBackend):
    """AdaFisher / AdaFisherW through the CUDA extension.

    ``momentum_dtype``: ``None`` keeps ``exp_avg`` in the parameter's dtype (as the
    other backends do); ``torch.float32`` keeps it in fp32 for fp16/bf16 parameters.
    """

    name = "fused"

    def __init__(self, momentum_dtype: Optional[torch.dtype] = None) -> None:
        if momentum_dtype not in (None, torch.float32):
            raise ValueError(f"momentum_dtype must be None (the parameter's dtype) or torch.float32, got {momentum_dtype}")
        from ..kernels import load_extension

        self._ext = load_extension()  # RuntimeError naming the reason when unavailable
        self.momentum_dtype = momentum_dtype
        # key -> (list of groups, the tensors the key's ids refer to, kept alive so the
        # ids cannot be reused while the entry exists)
        self._cache: OrderedDict[tuple, tuple[list[_Group], tuple]] = OrderedDict()

    # ------------------------------------------------------------------ state
    def init_state(self, param: Tensor, state: dict) -> None:
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
            dtype = self.momentum_dtype if self.momentum_dtype is not None else param.dtype
            state["exp_avg"] = torch.zeros_like(param, dtype=dtype, memory_format=torch.contiguous_format)
            return
        # State made by another backend (or loaded from a checkpoint): the step count
        # must live on the parameter's device, as float32.
        step = state["step"]
        if not isinstance(step, Tensor):
            state["step"] = torch.tensor(float(step), dtype=torch.float32, device=param.device)
        elif step.device != param.device or step.dtype != torch.float32:
            state["step"] = step.to(device=param.device, dtype=torch.float32).reshape(())
        exp_avg = state.get("exp_avg")
        if isinstance(exp_avg, Tensor) and exp_avg.device != param.device:
            state["exp_avg"] = exp_avg.to(param.device)

    def clear_cache(self) -> None:
        self._cache.clear()

    # ------------------------------------------------------------------- step
    def _groups(self, batch: StepBatch) -> list[_Group]:
        key = ("plan", batch.plan_key) if batch.plan_key is not None else (
            batch.factors_version,
            tuple(map(id, batch.params)),
            tuple(map(id, batch.exp_avgs)),
            tuple(map(id, batch.steps)),
            # FactorView objects may be rebuilt every step: key on what they hold.
            tuple(None if v is None else (id(v.S), id(v.H), v.col_offset, v.ncols) for v in batch.views),
        )
        entry = self._cache.get(key)
        if entry is not None:
            self._cache.move_to_end(key)
            return entry[0]
        groups = self._build_groups(batch)
        keep_alive = (
            tuple(batch.params),
            tuple(batch.exp_avgs),
            tuple(batch.steps),
            tuple(None if v is None else (v.S, v.H) for v in batch.views),
        )
        self._cache[key] = (groups, keep_alive)
        while len(self._cache) > _CACHE_ENTRIES:
            self._cache.popitem(last=False)
        return groups

    def _build_groups(self, batch: StepBatch) -> list[_Group]:
        n = len(batch.params)
        for name, lst in (("grads", batch.grads), ("exp_avgs", batch.exp_avgs), ("steps", batch.steps), ("views", batch.views)):
            if len(lst) != n:
                raise ValueError(f"FusedBackend: batch.{name} has {len(lst)} entries, batch.params has {n}")
        groups: dict[tuple, _Group] = {}
        for i, (p, m, k, view) in enumerate(zip(batch.params, batch.exp_avgs, batch.steps, batch.views)):
            why = unsupported_reason(p)
            if why is not None:
                raise RuntimeError(
                    f"FusedBackend cannot step parameter {i} (shape {tuple(p.shape)}): {why}; use the 'foreach' backend for it"
                )
            if m.device != p.device or m.dtype not in (p.dtype, torch.float32) or not m.is_contiguous():
                raise RuntimeError(
                    f"FusedBackend: exp_avg of parameter {i} must be a contiguous tensor on {p.device} in {p.dtype} or "
                    f"float32, got {m.dtype} on {m.device}"
                )
            if k.device != p.device or k.dtype != torch.float32 or k.numel() != 1:
                raise RuntimeError(
                    f"FusedBackend: step of parameter {i} must be a float32 scalar on {p.device}, got {k.dtype} on "
                    f"{k.device}; call FusedBackend.init_state(param, state) first (it moves the count to the device)"
                )
            gkey = (p.device, p.dtype, m.dtype)
            group = groups.get(gkey)
            if group is None:
                group = groups[gkey] = _Group(p.device)
            group.index.append(i)
            group.params.append(p)
            group.exp_avgs.append(m)
            group.steps.append(k)
            if view is None:
                group.S.append(None)
                group.H.append(None)
                group.col_offsets.append(0)
                group.ncols.append(1)
            else:
                for fname, f in (("S", view.S), ("H", view.H)):
                    if f.device != p.device or f.dtype != torch.float32 or f.dim() != 1 or not f.is_contiguous():
                        raise RuntimeError(
                            f"FusedBackend: factor {fname} of parameter {i} must be a contiguous float32 vector on "
                            f"{p.device}, got {f.dtype} shape {tuple(f.shape)} on {f.device}"
                        )
                group.S.append(view.S)
                group.H.append(view.H)
                group.col_offsets.append(int(view.col_offset))
                group.ncols.append(int(view.ncols))
        return list(groups.values())

    @torch.no_grad()
    def step(
        self,
        batch: StepBatch,
        hyper: StepHyper,
        grad_scale: Optional[Tensor] = None,
        found_inf: Optional[Tensor] = None,
    ) -> None:
        if not batch.params:
            return
        groups = self._groups(batch)
        grads = batch.grads
        op = self._ext.adafisher_step_
        lr_tensor = hyper.lr if isinstance(hyper.lr, Tensor) else None
        lr = 0.0 if lr_tensor is not None else float(hyper.lr)  # a tensor lr is never read on the host
        beta, Lambda, wd = float(hyper.beta), float(hyper.Lambda), float(hyper.weight_decay)
        for group in groups:
            gs = grad_scale
            fi = found_inf
            # The scaler's tensors live on one device; a group on another device gets a
            # copy (a small transfer, only with parameters spread over several GPUs).
            if gs is not None and gs.device != group.device:
                gs = gs.to(group.device, non_blocking=True)
            if fi is not None and fi.device != group.device:
                fi = fi.to(group.device, non_blocking=True)
            if gs is not None and gs.dtype != torch.float32:
                gs = gs.float()
            if fi is not None and fi.dtype != torch.float32:
                fi = fi.float()
            lr_t = lr_tensor
            if lr_t is not None and (lr_t.device != group.device or lr_t.dtype != torch.float32):
                # a small copy every step (and none allowed in a CUDA graph from the CPU):
                # keep a tensor lr in fp32 on the parameters' device to avoid it
                lr_t = lr_t.to(group.device, torch.float32, non_blocking=True)
            try:
                self._call(op, group, grads, lr, beta, Lambda, wd, bool(hyper.decoupled), gs, fi, lr_t)
            except RuntimeError as exc:
                dtype = group.params[0].dtype
                raise RuntimeError(
                    f"FusedBackend ({dtype} group on {group.device}; entry j of the op is batch parameter "
                    f"{group.index if len(group.index) <= 16 else 'group.index[j]'}[j]): {exc}"
                ) from exc

    @staticmethod
    def _call(op, group: _Group, grads, lr, beta, Lambda, wd, decoupled, gs, fi, lr_t) -> None:
        op(
            group.params,
            [grads[i] for i in group.index],
            group.exp_avgs,
            group.steps,
            group.S,
            group.H,
            group.col_offsets,
            group.ncols,
            lr,
            beta,
            Lambda,
            wd,
            decoupled,
            gs,
            fi,
            lr_t,
        )
