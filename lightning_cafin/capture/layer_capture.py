"""One supported module bound to one optimizer (``LayerCapture``): its factors, the
statistics gathered since the last optimizer step (``PendingStats``) and the state of its
C++ gradient taps (``taps.py``).  The hooks that fill it are in ``forward_capture.py``;
where they sit on the module, in ``hooks.py``; the capture step that consumes it, in
``factors.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from . import taps
from .layers import LayerRule
from .rules.base import FusedStats, KernelPlan
from .tap_gate import TapGate

#: how many (input, gradient) shape pairs a layer keeps fused descriptions for
_FUSED_SHAPES = 64


class PendingStats:
    """Partial sums gathered since the last optimizer step (all micro-batches together).

    The partials of a second and later micro-batch are kept apart and added when ``h`` /
    ``s`` are first read, at the optimizer step after ``streams.join()``: the partials
    may come from the capture side stream, and adding them on the current stream any
    earlier would race with it.
    """

    __slots__ = ("_h", "_s", "_more", "hn", "sn", "calls")

    def __init__(self, h: Optional[Tensor] = None, hn: float = 0.0, s: Optional[Tensor] = None, sn: float = 0.0,
                 calls: int = 0) -> None:
        self._h, self._s, self.hn, self.sn, self.calls = h, s, hn, sn, calls
        self._more: list[tuple[Tensor, Tensor]] = []

    def _fold(self) -> None:
        if not self._more:
            return
        for h, s in self._more:
            self._h = h if self._h is None else self._h + h
            self._s = s if self._s is None else self._s + s
        self._more.clear()

    # the sums over every micro-batch so far (the kept-apart partials are added on access)
    @property
    def h(self) -> Optional[Tensor]:
        self._fold()
        return self._h

    @h.setter
    def h(self, value: Optional[Tensor]) -> None:
        self._fold()
        self._h = value

    @property
    def s(self) -> Optional[Tensor]:
        self._fold()
        return self._s

    @s.setter
    def s(self, value: Optional[Tensor]) -> None:
        self._fold()
        self._s = value

    def sums(self) -> tuple[Tensor, Tensor]:
        """``(h, s)`` of a pending that holds at least one call (``calls > 0``)."""
        self._fold()
        h, s = self._h, self._s
        if h is None or s is None:
            raise RuntimeError("PendingStats.sums(): no forward/backward pair was added")
        return h, s

    def add(self, h: Tensor, hn: float, s: Tensor, sn: float) -> bool:
        """Add one forward/backward pair; refuse one whose shape differs from the others."""
        if self._h is not None and self._s is not None and (self._h.shape != h.shape or self._s.shape != s.shape):
            return False
        if self._h is None:
            self._h, self._s = h, s
        else:
            self._more.append((h, s))
        self.hn += hn
        self.sn += sn
        self.calls += 1
        return True


class _FactorTensors:
    """How many times any capture's ``S`` or ``H`` was replaced by another tensor (process-wide)."""

    replaced = 0


def factor_tensors_replaced() -> int:
    """A stamp that changes whenever any layer's factor tensor is replaced (not updated in
    place): step plans holding views of the factors stay valid while it stays the same."""
    return _FactorTensors.replaced


@dataclass(eq=False)
class LayerCapture:
    """One supported module bound to one optimizer: its factors and pending statistics.

    ``S`` and ``H`` are updated in place on capture steps; assigning another tensor to
    either changes :func:`factor_tensors_replaced`, so step plans know to look again.
    """

    name: str
    module: nn.Module
    rule: LayerRule
    is_capturing: Callable[[], bool]
    #: the factors (the ``S`` and ``H`` properties; assigning another tensor is counted)
    _S: Optional[Tensor] = field(default=None, repr=False)
    _H: Optional[Tensor] = field(default=None, repr=False)
    _pending: PendingStats = field(default_factory=PendingStats, repr=False)
    refused: int = 0  # forward/backward pairs dropped because their shape changed
    #: the extension's ``TapSink`` the layer's C++ gradient taps fill (``taps.py``), once one was used
    sink: Any = field(default=None, repr=False)
    #: the extension's ``TapPlan`` per (input shape, output shape) seen (None: no tap), for ``tap_ext``
    tap_plans: dict[tuple[torch.Size, torch.Size], Any] = field(default_factory=dict, repr=False)
    tap_ext: Optional[ModuleType] = field(default=None, repr=False)
    #: taps registered on ``sink`` whose results were not taken yet: while 0 (every step
    #: without a capture) nothing asks the sink, a call into the extension per layer
    taps_out: int = field(default=0, repr=False)
    #: forwards of a capture step run inside ``no_capture()`` (``exclusion.py``) since the last capture
    excluded_forwards: int = field(default=0, repr=False)
    #: the rule's ``fused_stats`` per (input shape, gradient shape) seen (None: not fusable)
    fused: dict[tuple[torch.Size, torch.Size], Optional[FusedStats]] = field(default_factory=dict, repr=False)
    #: the rule's last ``kernel_plan`` and the (sum size, count, has a bias) it was made for (``factors.py``)
    kernel_plan: Optional[tuple[tuple[int, float, bool], Optional[KernelPlan]]] = field(default=None, repr=False)
    #: the factor-update kernel's kept arguments for this layer (``factors.KernelSlot``)
    kernel_slot: Any = field(default=None, repr=False)
    #: the module's hook slot while this capture owns it (``attach``; arming skips the
    #: process-wide lookup, a per-layer cost at every arming step)
    hook_slot: Any = field(default=None, repr=False)
    #: the owner's gate (``tap_gate.py``); None: the forward never repeats a tap in C++
    gate: Optional[TapGate] = field(default=None, repr=False)

    # S and H are properties, not a __setattr__ watching every name: the capture forward
    # hook sets a counter per layer (taps_out), which a Python __setattr__ would slow down
    @property
    def S(self) -> Optional[Tensor]:
        return self._S

    @S.setter
    def S(self, value: Optional[Tensor]) -> None:
        if value is not self._S:
            _FactorTensors.replaced += 1
        self._S = value

    @property
    def H(self) -> Optional[Tensor]:
        return self._H

    @H.setter
    def H(self, value: Optional[Tensor]) -> None:
        if value is not self._H:
            _FactorTensors.replaced += 1
        self._H = value

    @property
    def fast_tap(self) -> Any:
        """The C++ forward hook repeating this layer's last tap (the extension's
        ``ForwardTapHook``: :func:`_repeat_next_time`), or None while none is repeated.
        Setting it to None forgets the repeat: the next forward takes the general path."""
        slot = self.hook_slot
        hook = None if slot is None else slot.cpp_hook
        return hook if hook is not None and hook.repeating else None

    @fast_tap.setter
    def fast_tap(self, value: None) -> None:
        if value is not None:
            raise ValueError("LayerCapture.fast_tap can only be set to None (forget the repeated tap)")
        if self.hook_slot is not None:
            self.hook_slot.forget_repeat()

    @property
    def device(self) -> torch.device:
        """Where the module's parameters, hence its factors, live."""
        weight = getattr(self.module, "weight", None)  # every built-in rule's module has one (no generator)
        if isinstance(weight, Tensor):
            return weight.device
        for p in self.module.parameters(recurse=False):
            return p.device
        return torch.device("cpu")

    def fused_stats(self, x: Tensor, grad: Tensor) -> Optional[FusedStats]:
        """The rule's one-call description of this pair's statistics (cached per shapes), or
        ``None`` where it has none.  The caller checked that the kernels take both tensors."""
        key = (x.shape, grad.shape)
        try:
            return self.fused[key]
        except KeyError:
            if len(self.fused) >= _FUSED_SHAPES:  # shapes that keep changing (variable lengths)
                self.fused.clear()
            stats = self.fused[key] = self.rule.fused_stats(self.module, x.shape, grad.shape)
            return stats

    @property
    def pending(self) -> PendingStats:
        """The statistics gathered since the last optimizer step, the C++ taps' included."""
        if self.taps_out:
            for h, hn, s, sn in self._take_tap_results():
                self.commit(h, hn, s, sn)
        return self._pending

    @pending.setter
    def pending(self, value: PendingStats) -> None:
        self._pending = value

    def _take_tap_results(self) -> list[tuple[Tensor, float, Tensor, float]]:
        results = self.sink.take()
        self.taps_out -= len(results)  # (a tap whose graph is dropped unfired stays counted: the sink is then asked)
        return results

    def tap_plan(self, ext: ModuleType, x: Tensor, output: Tensor) -> Any:
        """The layer's ``TapPlan`` (``taps.py``) for these shapes, made on first use and kept
        (the forward of a capture step then makes one call per layer), or ``None`` where the
        rule has no one-call description or ``ext`` no taps.  The caller checked that the
        kernels take the tensors."""
        key = (x.shape, output.shape)
        if ext is self.tap_ext:
            try:
                return self.tap_plans[key]
            except KeyError:
                pass
        else:  # the first tap, or another extension: plans and a sink of its own (the old one's results kept)
            self.pending  # noqa: B018 (reading it moves the old sink's results into the pending sums)
            self.sink, self.tap_ext, self.taps_out = None, ext, 0
            self.tap_plans.clear()
            self.fast_tap = None  # (its plan fills the old sink)
        if len(self.tap_plans) >= _FUSED_SHAPES:  # shapes that keep changing (variable lengths)
            self.tap_plans.clear()
        fused = self.fused_stats(x, output) if taps.available(ext) else None  # (a build from before the taps: none)
        if fused is not None and self.sink is None:
            self.sink = ext.TapSink()
        plan = self.tap_plans[key] = None if fused is None else fused.tap_plan(ext, self.sink)
        return plan

    def has_pending_calls(self) -> bool:
        """Whether statistics were committed in Python since the last step (the C++ taps'
        results still in the sink not counted: reading ``pending`` would move them here)."""
        return self._pending.calls > 0

    def commit(self, h: Tensor, hn: float, s: Tensor, sn: float) -> None:
        if not self._pending.add(h, hn, s, sn):
            self.refused += 1

    def take_pending(self) -> PendingStats:
        """The statistics gathered since the last optimizer step; the layer starts empty again."""
        if self._pending.calls == 0 and self.taps_out:
            results = self._take_tap_results()
            if len(results) == 1:  # one tap fired: the usual capture step
                h, hn, s, sn = results[0]
                return PendingStats(h, hn, s, sn, calls=1)  # (self._pending stays the empty one)
            for h, hn, s, sn in results:
                self.commit(h, hn, s, sn)
        pending, self._pending = self.pending, PendingStats()
        return pending
