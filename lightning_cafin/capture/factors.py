"""Turning a capture step's statistics into the stored factors.

Runs only on capture steps (every ``TCov`` optimizer steps), once per captured layer:
combine the pending partial sums, finalise them into ``H_raw`` / ``S_raw``, map
infinities as the reference does, min-max normalise, and fold into the stored factor
with the reference's (non-convex) averaging.  A statistic holding NaN never reaches
the factors: that layer keeps its previous factors for this capture.

Layers whose statistics and factors are float32 CUDA tensors are updated together by
one launch of the extension's ``factor_update_`` kernel (finalise, inf mapping, min-max
normalisation, NaN guard and fold, decided on the device); the others, and every layer
when the kernels are unavailable, by the torch ops below (the reference for the kernel).
Which layers the kernel found NaN in is read back from the device only when the report
is looked at, or at once when a layer's factors are created by this capture.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor

from . import kernels as _kernels
from .hooks import LayerCapture, PendingStats
from .layers import Conv2dRule, LinearRule, _TwoColumnRule

NORM_EPS = 1e-6


def normalise_(v: Tensor) -> Tensor:
    """In place: ``+inf -> 1``, ``-inf -> 0``, then ``(v - min) / (max - min + 1e-6)``."""
    v.masked_fill_(v == math.inf, 1.0).masked_fill_(v == -math.inf, 0.0)
    lo, hi = v.min(), v.max()
    return v.sub_(lo).div_(hi - lo + NORM_EPS)


def fold_(stored: Tensor, v_hat: Tensor, gamma: float) -> Tensor:
    """In place: ``stored <- (0.1*gamma) * stored + (0.01*gamma) * v_hat``."""
    return stored.mul_(0.1 * gamma).add_(v_hat * (0.01 * gamma))


class _DeviceFlags:
    """NaN flags of the kernel-updated layers, copied to the host without blocking and
    waited for only when first read."""

    def __init__(self, names: list[str], flags: Tensor):
        self.names = names
        self._host: Optional[list[int]] = None
        if flags.is_cuda:
            self._pinned = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
            self._pinned.copy_(flags, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = flags.tolist()

    def values(self) -> list[int]:
        if self._host is None:
            self._event.synchronize()
            self._host = self._pinned.tolist()
        return self._host


class _Names(Sequence):
    """A list of layer names, part of it known only once device flags are read."""

    def __init__(self, resolve: Callable[[], list[str]]):
        self._resolve = resolve
        self._value: Optional[list[str]] = None

    def _list(self) -> list[str]:
        if self._value is None:
            self._value = self._resolve()
        return self._value

    def __getitem__(self, i):
        return self._list()[i]

    def __len__(self) -> int:
        return len(self._list())

    def __iter__(self) -> Iterator[str]:
        return iter(self._list())

    def __eq__(self, other) -> bool:
        return self._list() == list(other) if isinstance(other, (list, tuple, Sequence)) else NotImplemented

    def __repr__(self) -> str:
        return repr(self._list())


class CaptureReport:
    """What one capture step did, for health counters and warnings.

    ``updated`` and ``non_finite`` are sequences of layer names in capture order; where
    the kernel decided them on the device, reading them waits for that launch once.
    """

    def __init__(self, updated: Sequence[str] = (), not_fired: Sequence[str] = (), non_finite: Sequence[str] = ()):
        self._updated = list(updated)
        self.not_fired = list(not_fired)
        self._non_finite = list(non_finite)
        self._order: list[str] = self._updated + self._non_finite  # layers with a decision, in capture order
        self._device: Optional[_DeviceFlags] = None
        self.updated: Sequence[str] = _Names(lambda: self._names(want_nan=False))
        self.non_finite: Sequence[str] = _Names(lambda: self._names(want_nan=True))

    @property
    def settled(self) -> bool:
        """Whether every verdict is known on the host already (reading ``non_finite`` would not wait)."""
        return self._device is None

    def _decided(self, name: str, nan: Optional[bool]) -> None:
        """Record a torch-path decision (nan True/False) or a kernel layer (None)."""
        self._order.append(name)
        if nan is True:
            self._non_finite.append(name)
        elif nan is False:
            self._updated.append(name)

    def _names(self, want_nan: bool) -> list[str]:
        nan = set(self._non_finite)
        if self._device is not None:
            nan |= {n for n, f in zip(self._device.names, self._device.values()) if f}
        return [n for n in self._order if (n in nan) == want_nan]


def _kernel_plan(cap: LayerCapture, pending: PendingStats):
    """(kind, h_div, extra, append) for a layer the kernel can update, else None."""
    rule, module = cap.rule, cap.module
    if isinstance(rule, _TwoColumnRule):
        hn = pending.hn
        return 1, hn**2, pending.h.numel() / hn**2, False
    if isinstance(rule, LinearRule):
        return 0, pending.hn, 1.0, module.bias is not None
    if isinstance(rule, Conv2dRule):
        return 0, pending.hn, module.groups / rule._k(module), module.bias is not None
    return None


def _kernel_ready(cap: LayerCapture, pending: PendingStats) -> bool:
    h, s = pending.h, pending.s  # which devices the kernels take is ext_for's decision
    if not (h.dtype == torch.float32 and s.dtype == torch.float32):
        return False
    if h.dim() != 1 or s.dim() != 1 or h.numel() == 0 or s.numel() == 0:
        return False
    if not (pending.hn > 0 and pending.sn > 0):
        return False
    device = cap.device
    if h.device != device or s.device != device:
        return False
    if cap.H is not None and not (cap.H.dtype == torch.float32 and cap.H.is_contiguous() and cap.S.is_contiguous()
                                  and cap.H.device == device and cap.S.device == device):
        return False
    return True


def update_factors(
    captures: list[LayerCapture],
    gamma: float,
    grad_scale: Optional[float] = None,
) -> CaptureReport:
    """Consume every capture's pending statistics and update its factors.

    ``grad_scale``: the loss scale the output gradients were multiplied by (``None`` when
    they were not scaled); it is divided out so factors come from true gradients.
    """
    report = CaptureReport()
    batch: dict = {k: [] for k in ("name", "cap", "h", "s", "H", "S", "kind", "flags", "h_div", "s_div", "s_scale", "extra", "init")}
    for cap in captures:
        pending = cap.take_pending()
        if pending.calls == 0:
            report.not_fired.append(cap.name)
            continue
        plan = _kernel_plan(cap, pending) if _kernel_ready(cap, pending) else None
        ext = _kernels.ext_for(pending.h) if plan is not None else None
        if ext is not None:
            kind, h_div, extra, append = plan
            nH = 2 if kind == 1 else pending.h.numel() + int(append)
            ns = pending.s.numel()
            init = cap.H is None or cap.H.shape != (nH,) or cap.S.shape != (ns,) or cap.H.dtype != torch.float32
            flags = (1 if append else 0) | (2 if init else 0)
            scale = 1.0
            if grad_scale is not None and grad_scale != 1.0:
                flags |= 4
                scale = grad_scale**cap.rule.s_scale_power
            if init:
                H = torch.empty(nH, device=pending.h.device, dtype=torch.float32)
                S = torch.empty(ns, device=pending.h.device, dtype=torch.float32)
            else:
                H, S = cap.H, cap.S
            for key, value in (("name", cap.name), ("cap", cap), ("h", pending.h.contiguous()), ("s", pending.s.contiguous()),
                               ("H", H), ("S", S), ("kind", kind), ("flags", flags), ("h_div", float(h_div)),
                               ("s_div", float(pending.sn)), ("s_scale", float(scale)), ("extra", float(extra)), ("init", init)):
                batch[key].append(value)
            report._decided(cap.name, None)
            continue
        s = pending.s
        if grad_scale is not None and grad_scale != 1.0:
            s = s / grad_scale**cap.rule.s_scale_power
        H_raw, S_raw = cap.rule.finalize(cap.module, pending.h, pending.hn, s, pending.sn)
        if torch.isnan(H_raw).any() or torch.isnan(S_raw).any():
            report._decided(cap.name, True)
            continue
        device = cap.device
        H_hat = normalise_(H_raw.to(device=device, dtype=torch.float32 if H_raw.dtype != torch.float64 else H_raw.dtype))
        S_hat = normalise_(S_raw.to(device=device, dtype=H_hat.dtype))
        if cap.H is None or cap.H.shape != H_hat.shape or cap.S.shape != S_hat.shape or cap.H.dtype != H_hat.dtype:
            cap.H = torch.ones_like(H_hat)
            cap.S = torch.ones_like(S_hat)
        fold_(cap.H, H_hat, gamma)
        fold_(cap.S, S_hat, gamma)
        report._decided(cap.name, False)
    if batch["name"]:
        _launch(batch, gamma, report)
    return report


def _launch(batch: dict, gamma: float, report: CaptureReport) -> None:
    """One kernel launch per device for the batched layers; new factors are attached once
    their layer is known to be NaN-free (that read waits for the launch)."""
    by_device: dict = {}
    for i, h in enumerate(batch["h"]):
        by_device.setdefault(h.device, []).append(i)
    ext = _kernels.ext_for(batch["h"][0])
    for device, idx in by_device.items():
        pick = lambda key: [batch[key][i] for i in idx]  # noqa: E731
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            flags = ext.factor_update_(pick("h"), pick("s"), pick("H"), pick("S"), pick("kind"), pick("flags"),
                                       pick("h_div"), pick("s_div"), pick("s_scale"), pick("extra"),
                                       0.1 * gamma, 0.01 * gamma)
            names = pick("name")
            device_flags = _DeviceFlags(names, flags)
        if report._device is None:
            report._device = device_flags
        else:  # several devices: merge (rare; each read waits for its own launch)
            prev = report._device
            merged = _DeviceFlags.__new__(_DeviceFlags)
            merged.names = prev.names + names
            merged._host = prev.values() + device_flags.values()
            report._device = merged
        inits = [i for i in idx if batch["init"][i]]
        if inits:
            values = dict(zip(names, device_flags.values()))
            for i in inits:
                if not values[batch["name"][i]]:
                    cap = batch["cap"][i]
                    cap.H, cap.S = batch["H"][i], batch["S"][i]
