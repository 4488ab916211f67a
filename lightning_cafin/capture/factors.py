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
import operator
from types import ModuleType
from typing import Callable, Iterator, Optional, Protocol, Sequence, overload

import torch
from torch import Tensor

from . import kernels as _kernels
from .layer_capture import LayerCapture, PendingStats, factor_tensors_replaced
from .rules.base import KernelPlan

NORM_EPS = 1e-6


def normalise_(v: Tensor) -> Tensor:
    """In place: ``+inf -> 1``, ``-inf -> 0``, then ``(v - min) / (max - min + 1e-6)``."""
    v.masked_fill_(v == math.inf, 1.0).masked_fill_(v == -math.inf, 0.0)
    lo, hi = v.min(), v.max()
    return v.sub_(lo).div_(hi - lo + NORM_EPS)


def fold_(stored: Tensor, v_hat: Tensor, gamma: float) -> Tensor:
    """In place: ``stored <- (0.1*gamma) * stored + (0.01*gamma) * v_hat``."""
    return stored.mul_(0.1 * gamma).add_(v_hat * (0.01 * gamma))


class _FlagBuffers:
    """Pinned host buffers (each with its event) that device NaN flags are copied into, kept
    for reuse once their flags were read, instead of a new pinned buffer and event per
    capture step.  On the H200's host a report's making (``CaptureReport.on_device``) took
    120 microseconds per capture step with new ones (step-synchronous ResNet-18 in bf16, at
    9d8125e) and 92 with reused ones (at 631553b): most of it is the copy and the event
    record themselves.  A buffer comes back only after its values were read on the host,
    so a copy into it never races a read of an earlier report."""

    #: (device, shape, dtype) -> free (buffer, event) pairs
    free: dict[tuple, list[tuple[Tensor, "torch.cuda.Event"]]] = {}
    #: free pairs kept per key at most (reports read out of order return theirs later)
    KEEP = 4

    @classmethod
    def take(cls, flags: Tensor) -> tuple[tuple, Tensor, "torch.cuda.Event"]:
        key = (flags.device, flags.shape, flags.dtype)
        free = cls.free.get(key)
        if free:
            pinned, event = free.pop()
        else:
            pinned, event = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True), torch.cuda.Event()
        return key, pinned, event

    @classmethod
    def give_back(cls, key: tuple, pinned: Tensor, event: "torch.cuda.Event") -> None:
        free = cls.free.setdefault(key, [])
        if len(free) < cls.KEEP:
            free.append((pinned, event))


class HostFlagsLike(Protocol):
    """The extension's ``HostFlags`` (a kept launch's NaN flags, which its kernel writes into
    pinned host memory): ``values()`` waits for the launch the first time."""

    def values(self) -> list[int]: ...


class _DeviceFlags:
    """NaN flags of the kernel-updated layers, waited for only when first read: a device
    tensor copied to the host without blocking, or a kept launch's ``HostFlags``."""

    def __init__(self, names: list[str], flags: Tensor | HostFlagsLike):
        self.names = names
        self._host: Optional[list[int]] = None
        self._later: Optional[HostFlagsLike] = None
        if not isinstance(flags, Tensor):
            self._later = flags
        elif flags.is_cuda:
            self._key, self._pinned, self._event = _FlagBuffers.take(flags)
            self._pinned.copy_(flags, non_blocking=True)
            self._event.record()
        else:
            self._host = flags.tolist()

    def values(self) -> list[int]:
        if self._host is None and self._later is not None:
            self._host, self._later = list(self._later.values()), None
        elif self._host is None:
            self._event.synchronize()
            self._host = self._pinned.tolist()
            _FlagBuffers.give_back(self._key, self._pinned, self._event)
            del self._pinned, self._event
        return self._host


class _Names(Sequence[str]):
    """A list of layer names, part of it known only once device flags are read."""

    def __init__(self, resolve: Callable[[], list[str]]):
        self._resolve = resolve
        self._value: Optional[list[str]] = None

    def _list(self) -> list[str]:
        if self._value is None:
            self._value = self._resolve()
        return self._value

    @overload
    def __getitem__(self, i: int) -> str: ...

    @overload
    def __getitem__(self, i: slice) -> list[str]: ...

    def __getitem__(self, i: int | slice) -> str | list[str]:
        return self._list()[i]

    def __len__(self) -> int:
        return len(self._list())

    def __iter__(self) -> Iterator[str]:
        return iter(self._list())

    def __eq__(self, other: object) -> bool:
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

    def record(self, name: str, nan: Optional[bool]) -> None:
        """Add layer ``name``'s verdict, in capture order: ``nan=False`` its factors were updated,
        ``nan=True`` its statistics held NaN and it kept its factors (both decided on the host,
        by the torch path), ``nan=None`` the kernel decides it on the device (the flags
        ``update_factors`` attaches say which)."""
        self._order.append(name)
        if nan is True:
            self._non_finite.append(name)
        elif nan is False:
            self._updated.append(name)

    @classmethod
    def on_device(cls, names: list[str], flags: Tensor | HostFlagsLike) -> "CaptureReport":
        """The report of a capture step whose every layer the kernel decided (``flags``: its
        NaN flags, a device tensor or a kept launch's ``HostFlags``, read only when the
        report is looked at)."""
        report = cls()
        report._order = list(names)
        report._device = _DeviceFlags(names, flags)
        return report

    def _names(self, want_nan: bool) -> list[str]:
        nan = set(self._non_finite)
        if self._device is not None:
            values = self._device.values()
            if any(values):
                nan |= {n for n, f in zip(self._device.names, values) if f}
        if not nan:  # (the usual report, read at every capture step: no test per name)
            return [] if want_nan else list(self._order)
        return [n for n in self._order if (n in nan) == want_nan]


class KernelSlot:
    """What the factor-update kernel takes of one layer besides its sums: its stored factors
    and the plan's numbers (``KernelPlan``), for the sums' size and counts in ``key``.

    A layer keeps its slot (``LayerCapture.kernel_slot``) while the key stays: no factor
    tensor anywhere was replaced (:func:`factor_tensors_replaced`, so ``H`` and ``S`` are
    the same tensors, in the same dtype and place), the same sums' sizes and counts, loss
    scale and bias.  A capture step then takes each layer's slot as it is, instead of
    checking the factors and building the plan's numbers again (host time per layer, on
    the step the host is the bottleneck of).
    """

    __slots__ = ("key", "device", "H", "S", "kind", "flags", "h_div", "s_div", "s_scale", "extra")

    def __init__(self, key: tuple, device: torch.device, H: Tensor, S: Tensor, kind: int, flags: int, h_div: float,
                 s_div: float, s_scale: float, extra: float) -> None:
        self.key, self.device, self.H, self.S = key, device, H, S
        self.kind, self.flags, self.h_div, self.s_div, self.s_scale, self.extra = kind, flags, h_div, s_div, s_scale, extra


class _KernelBatch:
    """The layers one factor-update launch finalises and folds on one device: their sums and
    slots, turned into the launch's argument lists at launch."""

    __slots__ = ("caps", "h", "s", "slots", "fresh")

    def __init__(self) -> None:
        self.caps: list[LayerCapture] = []
        self.h: list[Tensor] = []
        self.s: list[Tensor] = []
        self.slots: list[KernelSlot] = []
        self.fresh: list[int] = []  # indices of layers whose factors this launch creates

    def add(self, cap: LayerCapture, h: Tensor, s: Tensor, slot: KernelSlot) -> None:
        if slot.flags & _INIT:
            self.fresh.append(len(self.caps))
        self.caps.append(cap)
        self.h.append(h if h.is_contiguous() else h.contiguous())
        self.s.append(s if s.is_contiguous() else s.contiguous())
        self.slots.append(slot)


_APPEND, _INIT, _UNSCALE = 1, 2, 4  # the kernel's flags: append the extra column, new factors, divide out the loss scale


def _has_bias(cap: LayerCapture) -> bool:
    return cap.module._parameters.get("bias") is not None  # (in the slot's key: the built-in plans depend on it)


def _slot_key(stamp: int, cap: LayerCapture, h: Tensor, s: Tensor, pending: PendingStats,
              grad_scale: Optional[float]) -> tuple:
    """What a ``KernelSlot`` is valid for (``stamp``: :func:`factor_tensors_replaced`)."""
    return (stamp, h.numel(), s.numel(), pending.hn, pending.sn, grad_scale, _has_bias(cap))


def _new_slot(cap: LayerCapture, h: Tensor, s: Tensor, pending: PendingStats, plan: KernelPlan,
              grad_scale: Optional[float], key: tuple) -> KernelSlot:
    """The slot of a layer the kernel takes (``_kernel_ready``); fresh factor buffers (flag
    ``_INIT``) where the layer has none of these sizes yet."""
    nH, ns = plan.h_size(h), s.numel()
    H, S = cap.H, cap.S
    init = H is None or S is None or H.shape != (nH,) or S.shape != (ns,) or H.dtype != torch.float32
    flags = (_APPEND if plan.append else 0) | (_INIT if init else 0)
    scale = 1.0
    if grad_scale is not None and grad_scale != 1.0:
        flags |= _UNSCALE
        scale = grad_scale**cap.rule.s_scale_power
    if H is None or S is None or init:
        H = torch.empty(nH, device=h.device, dtype=torch.float32)
        S = torch.empty(ns, device=h.device, dtype=torch.float32)
    return KernelSlot(key, h.device, H, S, plan.kind, flags, float(plan.h_div), float(pending.sn), float(scale),
                      float(plan.extra))


def _kernel_ready(cap: LayerCapture, h: Tensor, s: Tensor, pending: PendingStats) -> bool:
    """Whether the batched factor kernel can take this layer's sums ``h``, ``s`` (which
    devices the kernels take is ``ext_for``'s decision): float32 vectors on the device of
    the layer's factors, or of its parameters before it has factors."""
    if not (h.dtype == torch.float32 and s.dtype == torch.float32):
        return False
    if h.dim() != 1 or s.dim() != 1 or h.numel() == 0 or s.numel() == 0:
        return False
    if not (pending.hn > 0 and pending.sn > 0):
        return False
    device = h.device
    if s.device != device:
        return False
    H, S = cap.H, cap.S
    if H is None or S is None:
        return cap.device == device
    return (H.dtype == torch.float32 and H.device == device and S.device == device and H.is_contiguous()
            and S.is_contiguous())


def _kernel_plan(cap: LayerCapture, h: Tensor, hn: float) -> Optional[KernelPlan]:
    """The rule's plan for these sums, kept per layer while the sums' size and count and
    whether the module has a bias stay (the built-in plans depend on nothing else)."""
    key = (h.numel(), hn, _has_bias(cap))
    cached = cap.kernel_plan
    if cached is not None and cached[0] == key:
        return cached[1]
    plan = cap.rule.kernel_plan(cap.module, h, hn)
    cap.kernel_plan = (key, plan)
    return plan


def _kept_slot(cap: LayerCapture, h: Tensor, s: Tensor, key: tuple) -> Optional[KernelSlot]:
    """The layer's slot when it still fits these sums (see ``KernelSlot``), else None."""
    slot = cap.kernel_slot
    if (slot is None or slot.key != key or h.dtype != torch.float32 or s.dtype != torch.float32 or h.dim() != 1
            or s.dim() != 1 or h.device != slot.device or s.device != slot.device):
        return None
    return slot


class KeptLaunch:
    """A capture step's whole factor update, kept for the next capture step that looks the
    same: every layer's kept ``KernelSlot`` in one launch, and the sizes and counts of the
    one tap result each layer gave.

    The usual capture step (taps on, one forward and backward, nothing replaced, one
    device) repeats the previous one's decisions for every layer; checking each layer's
    sums and slot in Python again cost the step ~20 microseconds of host per layer on the
    H200's host, where a capture step is host-bound.  With a kept launch the step checks
    only what can differ per layer in Python (the same capture and slot, one tap out, no
    Python-hook statistics, the same bias), and the extension's ``SinkSet.take``
    (``take_single`` with the sinks and expected sizes converted once) takes every sink's
    one result in one call, checking its sizes, counts, dtype and device, or takes nothing
    (then the general path runs, and may keep a new launch); the sums it took stay in C++
    (``TakenSums``) for ``FactorLaunch.run``: ``factor_update_`` with the layers' launch
    items built and checked once, whose kernel writes its NaN flags straight into pinned
    host memory (``HostFlags``: no device tensor, copy or Python event record per step).

    A step unlike the kept one leaves the launch kept while it can still serve a later step
    (``usable``): after statistics from the Python hooks or a layer that did not run, the
    next step that looks like the kept one takes it again, instead of paying the general
    path once more to keep the same launch anew.  Other sums' sizes or counts (two
    micro-batches, another batch size, a new loss scale) give the layers new slots, and the
    launch is dropped.
    """

    __slots__ = ("caps", "state", "biases", "sinks", "factor_launch", "stamp", "grad_scale", "names")

    def __init__(self, batch: _KernelBatch, ext: ModuleType, stamp: int, grad_scale: Optional[float],
                 counts: list[tuple[float, float]]) -> None:
        self.caps = tuple(batch.caps)
        # per layer, what a repeat finds: its kept slot, one tap out, nothing committed in Python
        self.state = [(slot, 1, 0) for slot in batch.slots]
        self.biases = list(map(_BIAS, map(_PARAMETERS, batch.caps)))  # (each layer's bias, or None)
        like = [slot.H for slot in batch.slots]  # (the device each layer's sums must be on)
        # both converted to C++ once: a list of a hundred entries through pybind per step
        # cost the step about 2 microseconds per layer (``SinkSet``, ``FactorLaunch``)
        self.sinks = ext.SinkSet([cap.sink for cap in batch.caps], like, [h.numel() for h in batch.h],
                                 [hn for hn, _ in counts], [s.numel() for s in batch.s], [sn for _, sn in counts])
        self.factor_launch = ext.FactorLaunch(*_launch_args(batch.slots))
        self.stamp, self.grad_scale = stamp, grad_scale
        self.names = [cap.name for cap in batch.caps]

    def run(self, captures: list[LayerCapture], stamp: int, grad_scale: Optional[float],
            gamma: float) -> Optional[CaptureReport]:
        """This step's update through the kept launch, or ``None`` (nothing taken, nothing
        changed) where the step does not look like the one it was kept from."""
        if stamp != self.stamp or grad_scale != self.grad_scale or len(captures) != len(self.caps):
            return None
        # (hot: ~40-110 layers, read by map in C; a Python loop calling methods per layer cost
        # ~4 microseconds a layer on the H200's host, and a comprehension of each layer's
        # bias presence ~1: the same bias objects are asked for instead, all in C)
        if (not all(map(operator.is_, captures, self.caps)) or list(map(_KEPT_STATE, captures)) != self.state
                or not all(map(operator.is_, map(_BIAS, map(_PARAMETERS, captures)), self.biases))):
            return None
        taken = self.sinks.take()
        if taken is None:
            return None
        for cap in captures:
            cap.taps_out = 0
        # (on the factors' device, which the launch guards itself; its NaN flags reach the
        # host without a copy: a HostFlags)
        return CaptureReport.on_device(self.names, self.factor_launch.run(taken, 0.1 * gamma, 0.01 * gamma))

    def usable(self, stamp: int) -> bool:
        """Whether a later step could still take this launch: no factor tensor was replaced
        (``stamp``) and every layer still holds the slot it was kept with.  A new slot is a
        new object (a slot is never restored), so once a layer has one this launch can never
        serve again, and it would only hold the old factors' tensors."""
        return stamp == self.stamp and all(map(operator.is_, map(_SLOT, self.caps), map(_FIRST, self.state)))


#: a kept launch's per-layer checks (``KeptLaunch.run``): ``(kernel_slot, taps_out, calls
#: committed in Python)`` (``KernelSlot`` compares by identity), and each layer's bias
_KEPT_STATE = operator.attrgetter("kernel_slot", "taps_out", "_pending.calls")
_SLOT = operator.attrgetter("kernel_slot")
_FIRST = operator.itemgetter(0)  # (a layer's kept slot, in its ``state``)
_PARAMETERS = operator.attrgetter("module._parameters")
_BIAS = operator.methodcaller("get", "bias")


def _launch_args(slots: list[KernelSlot]) -> tuple[list, ...]:
    """The factor-update kernel's per-layer arguments after the sums (``factor_update_``)."""
    return ([x.H for x in slots], [x.S for x in slots], [x.kind for x in slots], [x.flags for x in slots],
            [x.h_div for x in slots], [x.s_div for x in slots], [x.s_scale for x in slots], [x.extra for x in slots])


class LaunchKeeper:
    """Where an optimizer keeps its last ``KeptLaunch`` between capture steps (``update_factors``'s
    ``keep``), and how many capture steps it served (``taken``: what a benchmark checks its
    timed capture steps against)."""

    __slots__ = ("launch", "taken")

    def __init__(self) -> None:
        self.launch: Optional[KeptLaunch] = None
        self.taken = 0


def update_factors(
    captures: list[LayerCapture],
    gamma: float,
    grad_scale: Optional[float] = None,
    keep: Optional[LaunchKeeper] = None,
) -> CaptureReport:
    """Consume every capture's pending statistics and update its factors.

    ``grad_scale``: the loss scale the output gradients were multiplied by (``None`` when
    they were not scaled); it is divided out so factors come from true gradients.
    ``keep``: where the step's launch is kept for the next capture step when every layer
    took its kept slot and one tap's sums (``KeptLaunch``), and taken from when that
    step looks the same; a step that does not keep one leaves the launch kept before it
    there while that one can still serve (``KeptLaunch.usable``).
    """
    stamp = factor_tensors_replaced()  # (a factor created below changes it only for the next capture)
    kept = keep.launch if keep is not None else None
    if keep is not None and kept is not None:
        fast = kept.run(captures, stamp, grad_scale, gamma)
        if fast is not None:
            keep.taken += 1
            return fast
    report = CaptureReport()
    batches: dict[torch.device, _KernelBatch] = {}
    kernels_on: dict[torch.device, bool] = {}  # whether the kernels take float32 sums there (ext_for)
    keepable = keep is not None  # every layer took a kept slot and one tap's sums (a KeptLaunch can repeat it)
    counts: list[tuple[float, float]] = []  # each batched layer's (hn, sn), for a KeptLaunch
    for cap in captures:
        one_tap = keepable and cap.taps_out == 1 and not cap.has_pending_calls()
        pending = cap.take_pending()
        if pending.calls == 0:
            report.not_fired.append(cap.name)
            continue
        h, s = pending.sums()
        key = _slot_key(stamp, cap, h, s, pending, grad_scale)
        slot = _kept_slot(cap, h, s, key)
        if slot is not None or _kernel_ready(cap, h, s, pending):
            on = kernels_on.get(h.device)
            if on is None:
                on = kernels_on[h.device] = _kernels.ext_for(h) is not None
            if on and slot is None:
                plan = _kernel_plan(cap, h, pending.hn)
                if plan is not None:
                    slot = _new_slot(cap, h, s, pending, plan, grad_scale, key)
                    cap.kernel_slot = None if slot.flags & _INIT else slot  # new factors change the key
            if on and slot is not None:
                batch = batches.get(h.device)
                if batch is None:
                    batch = batches[h.device] = _KernelBatch()
                batch.add(cap, h, s, slot)
                counts.append((pending.hn, pending.sn))
                # kept for the next step: one tap's sums, and a slot the layer keeps (not new factors)
                keepable = keepable and one_tap and pending.calls == 1 and cap.kernel_slot is slot
                report.record(cap.name, None)
                continue
        keepable = False
        if grad_scale is not None and grad_scale != 1.0:
            s = s / grad_scale**cap.rule.s_scale_power
        H_raw, S_raw = cap.rule.finalize(cap.module, h, pending.hn, s, pending.sn)
        if torch.isnan(H_raw).any() or torch.isnan(S_raw).any():
            report.record(cap.name, True)
            continue
        device = cap.device
        H_hat = normalise_(H_raw.to(device=device, dtype=torch.float32 if H_raw.dtype != torch.float64 else H_raw.dtype))
        S_hat = normalise_(S_raw.to(device=device, dtype=H_hat.dtype))
        if (cap.H is None or cap.S is None or cap.H.shape != H_hat.shape or cap.S.shape != S_hat.shape
                or cap.H.dtype != H_hat.dtype):
            cap.H = torch.ones_like(H_hat)
            cap.S = torch.ones_like(S_hat)
        fold_(cap.H, H_hat, gamma)
        fold_(cap.S, S_hat, gamma)
        report.record(cap.name, False)
    if batches:
        _launch(batches, gamma, report)
    if keep is not None:
        new = _launch_to_keep(batches, report, keepable, stamp, grad_scale, counts) if captures else None
        if new is not None:
            keep.launch = new
        elif kept is not None and not kept.usable(factor_tensors_replaced()):
            keep.launch = None
    return report


def _launch_to_keep(batches: dict[torch.device, _KernelBatch], report: CaptureReport, keepable: bool, stamp: int,
                    grad_scale: Optional[float], counts: list[tuple[float, float]]) -> Optional[KeptLaunch]:
    """This step's launch, to be kept, where a later step can repeat it: every layer took a
    kept slot and one tap's sums (``keepable``), on one device, every layer fired and none
    had its factors created by it."""
    if not keepable or len(batches) != 1 or report.not_fired:
        return None
    batch = next(iter(batches.values()))
    ext = _kernels.ext_for(batch.h[0])
    if ext is None or not hasattr(ext, "FactorLaunch") or batch.fresh:
        return None
    return KeptLaunch(batch, ext, stamp, grad_scale, counts)


def _launch(batches: dict[torch.device, _KernelBatch], gamma: float, report: CaptureReport) -> None:
    """One kernel launch per device for the batched layers; new factors are attached once
    their layer is known to be NaN-free (that read waits for the launch)."""
    ext = _kernels.ext_for(next(iter(batches.values())).h[0])
    if ext is None:  # the batches were made only where ext_for gave the extension
        raise RuntimeError("capture kernels became unavailable between planning and launch")
    for device, b in batches.items():
        sl = b.slots
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            flags = ext.factor_update_(b.h, b.s, *_launch_args(sl), 0.1 * gamma, 0.01 * gamma)
            names = [cap.name for cap in b.caps]
            device_flags = _DeviceFlags(names, flags)
        if report._device is None:
            report._device = device_flags
        else:  # several devices: merge (rare; each read waits for its own launch)
            prev = report._device
            merged = _DeviceFlags.__new__(_DeviceFlags)
            merged.names = prev.names + names
            merged._host, merged._later = prev.values() + device_flags.values(), None
            report._device = merged
        if b.fresh:
            nan = device_flags.values()
            for i in b.fresh:
                if not nan[i]:
                    b.caps[i].H, b.caps[i].S = sl[i].H, sl[i].S
