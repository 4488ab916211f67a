"""Factor capture: one forward hook per supported module plus a tensor hook on its output.

A forward hook sees the module's input; the gradient of the loss with respect to the
module's *output* is caught by a hook registered on that output tensor.  Unlike a full
backward hook this survives in-place operations that follow the module
(``ReLU(inplace=True)``, ``out += identity``): a tensor hook registered before an
in-place change receives the gradient of the value it was registered on.

On capture steps the input's statistics are computed together with the gradient's,
in the backward pass (the forward pass is launch-bound), by one extension call per layer
where the rule describes both sums as one (``FusedStats``: the kernels, the side-stream
ordering when ``streams.py``'s side stream is on, and the results in one allocation),
else by the rule's two partial methods.  With C++ gradient taps on (the default, ``taps.py``), a layer
whose statistics are that one call gets a tap registered on its output by one extension
call in the forward instead of a Python tensor hook (one computing only the gradient's
sums where the input's were read in the forward, below): the backward then runs no
Python for it, and ``LayerCapture.pending`` takes the tap's results.  A forward that
repeats the layer's last tap runs no Python either: once a tap could be repeated, the
module's hook is the extension's ``ForwardTapHook`` in the Python hook's place,
which makes the same checks and the same tap in C++ and calls the Python hook for any
other forward (:func:`_repeat_next_time`, ``tap_gate.py``).  With a
frozen weight autograd need not keep the input, a layer computing on a cast copy
(autocast) has autograd keep the copy instead, and under a saved-tensor hook (activation
checkpointing, CPU offload: ``saved_tensors.py``) autograd drops or moves it, so then the
input's statistics are read in the forward.

A norm module that applies an activation itself (timm's ``GroupNormAct``; ``layers.py``,
``gradient_tap``) is hooked twice: a forward pre-hook on the submodule that receives the
norm's affine output registers the tensor hook there, before the activation (in place or
not) runs on it, so the gradient is the norm's own; the module's forward hook then adds
the input side to that tap.

Every module holds at most one hook, whatever number of optimizers bind it: the hook
holds its module's slot (a weak reference to the current owner), so binding again, or
binding a second optimizer, replaces the owner instead of stacking hooks.  The hook runs
before the module's other forward hooks (registered with ``prepend``), so it sees the module's
own output whatever another hook returns.

Between capture steps the hooks are *disarmed*: taken out of the module's hook dict, so
that ``nn.Module.__call__`` takes its no-hook fast path (a forward hook costs several
microseconds per call even when it only checks the schedule: 41 calls add a few percent to
a ResNet-18 step whose host work is the bottleneck).  The owner's schedule arms them again
for any step that may capture (``set_armed``).  Armed, a hook is the module's *forward
override* where that is safe: ``module.forward``, set on the instance, runs the class's
forward and then the hook, so torch still takes its no-hook path (on a CPU its general
path was ~2-4 of the ~11-18 microseconds an armed, tapped layer added to a capture step's
forward: a ResNet-18 forward's capture overhead went from ~725 to ~575 us, 40 Linear
layers' from 11.0 to 9.0 us a layer; most of the rest is the tap on the output).  The override is a
``functools.partial`` of the module (``_Override``), which ``copy.deepcopy`` and pickling
rebind to the copy (a copy has no slot and only runs its forward), and keeps the forward's
signature (``__wrapped__``).  Elsewhere the hook goes back first in the module's hook dict: a module
with a ``gradient_tap`` (its pre-hook is in a dict anyway), one whose instance already has
a ``forward`` (a library's wrapper: it is left as it is), and everything once anything
compiled.  A shallow ``copy.copy`` of an armed module shares the override, bound to the
original: it computes with the original's attributes (its parameters are shared anyway)
and feeds the original's statistics; a module is not shallow-copied between a capture step's
forward and its optimizer step in any code we know of.
Once ``torch.compile`` starts compiling anything in the process, every hook is in its dict
and stays there: dynamo does not guard on module hooks, so a graph traced while a hook was out
would never call it; and any C++ forward hook gives way to its Python hook for good
(dynamo cannot inspect it, and the Python hook is never traced, below).  The compile-start
watcher is registered again at every optimizer step (``torch._dynamo.reset()`` drops it);
a compile started between such a reset and the next step, while the hooks are out, goes
unnoticed, and its capture steps then warn that no forward reached the layers.

Under ``torch.compile`` the hook body is never traced: it reads Python state (the owner,
the capture schedule) and mutates the pending statistics, which a traced graph would
freeze or misroute (code traced for one module reused for another of the same shapes).
The hook is ``torch.compiler.disable``-d: one graph break per bound module (two for a norm
module with a ``gradient_tap``, whose pre-hook is disabled too), and the
statistics are those of eager mode (the wrapper costs a few microseconds per module call in
eager mode, paid on capture steps only; a hook checking ``torch.compiler.is_compiling()`` itself instead was compiled
as a frame of its own, recompiled per module type, and then ran its body with dynamo active).
"""

from __future__ import annotations

import contextlib
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import partial
from types import ModuleType
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from . import kernels as _kernels
from . import exclusion, saved_tensors, streams, taps
from .layers import LayerRule, gradient_tap
from .rules.base import FusedStats, KernelPlan
from .tap_gate import SettingsEpoch, TapGate

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


class _GradTap:
    """A tensor hook registered on a norm's affine output in the forward; the module's own
    forward hook, which runs later, sets what it calls with the gradient."""

    __slots__ = ("call",)

    def __init__(self) -> None:
        self.call: Optional[Callable[[Tensor], None]] = None

    def __call__(self, grad: Tensor) -> None:
        if self.call is not None:
            self.call(grad)


class _Registered:
    """One hook this package registered: where it lives, so that it can be taken out of its
    dict and put back first (the ``RemovableHandle`` id is its key there)."""

    __slots__ = ("handle", "hook", "hooks", "with_kwargs")

    def __init__(self, handle: RemovableHandle, hook: Callable[..., None], hooks: dict[int, Callable],
                 with_kwargs: Optional[dict]) -> None:
        self.handle, self.hook, self.hooks, self.with_kwargs = handle, hook, hooks, with_kwargs

    def put(self, armed: bool) -> None:
        key = self.handle.id
        if armed:
            hooks = self.hooks
            if isinstance(hooks, OrderedDict):  # what torch keeps them in
                hooks[key] = self.hook
                hooks.move_to_end(key, last=False)
            else:  # the same dict object (torch's handles refer to it), ours first
                others = [(k, v) for k, v in hooks.items() if k != key]
                hooks.clear()
                hooks[key] = self.hook
                hooks.update(others)
            if self.with_kwargs is not None:
                self.with_kwargs[key] = True
        else:
            self.hooks.pop(key, None)
            if self.with_kwargs is not None:
                self.with_kwargs.pop(key, None)

    def remove(self) -> None:
        self.handle.remove()


class _Slot:
    """A module's hook and its current owner (weakly: an optimizer dropped unbinds itself).

    ``tap``: the pre-hook on the submodule receiving the affine output, for modules with a
    ``gradient_tap``; ``tapped``: the tap it registered in the current forward; ``armed``:
    whether the hook is called at the module's forwards, ``overriding``: armed as a forward
    override rather than in the hook dicts (see the module docstring).
    """

    __slots__ = ("forward", "owner", "module", "tap", "tapped", "armed", "overriding", "registered", "cpp_hook",
                 "python_hook", "__weakref__")

    def __init__(self, owner: LayerCapture, module: nn.Module):
        self.forward: Optional[_Registered] = None
        self.tap: Optional[_Registered] = None
        self.tapped: Optional[_GradTap] = None
        self.armed = True
        self.overriding = False
        self.owner: "weakref.ref[LayerCapture]" = weakref.ref(owner)
        self.module: "weakref.ref[nn.Module]" = weakref.ref(module)
        #: the hooks this slot registered (``forward``, then ``tap``), once both are set
        self.registered: tuple[_Registered, ...] = ()
        #: the extension's ``ForwardTapHook`` in the forward hook's place, once a tap was
        #: repeatable, and the Python hook it calls otherwise (held here: it holds it weakly)
        self.cpp_hook: Any = None
        self.python_hook: Optional[Callable[..., None]] = None

    def repeat_hook(self, ext: ModuleType, module: nn.Module) -> Any:
        """The C++ forward hook, put in the Python hook's place on first use (it calls the
        Python hook for every forward it does not repeat), or None where there is none: an
        extension without it, a module with a ``gradient_tap``, anything compiled."""
        cls = getattr(ext, "ForwardTapHook", None)
        forward = self.forward
        if cls is None or forward is None or self.tap is not None or _Compiling.seen:
            return None
        if type(self.cpp_hook) is not cls:  # (another extension's: tests' stand-ins)
            self.python_only()
            self.python_hook = forward.hook
            self.cpp_hook = cls(forward.hook, module, SettingsEpoch, saved_tensors.top_reader())
            forward.hook = self.cpp_hook
            if self.armed and not self.overriding:
                forward.put(True)  # (the same key: its place first in the dict is kept)
        return self.cpp_hook

    def forget_repeat(self) -> None:
        if self.cpp_hook is not None:
            self.cpp_hook.forget()

    def python_only(self) -> None:
        """The Python hook back in the C++ hook's place (a compile started: dynamo must meet
        the ``torch.compiler.disable``-d Python hook, not an object it cannot inspect)."""
        hook, self.cpp_hook = self.cpp_hook, None
        if hook is not None and self.forward is not None and self.python_hook is not None:
            self.forward.hook, self.python_hook = self.python_hook, None
            if self.armed and not self.overriding:
                self.forward.put(True)

    def set_armed(self, armed: bool) -> None:
        # never out once anything compiled; the owner's can_disarm() keeps the watcher registered
        armed = armed or _Compiling.seen
        if armed != self.armed:
            self.armed = armed
            self.tapped = None
            if not armed:
                self._take_out()
            elif not self._override():
                self._put(True)

    def in_dicts(self) -> None:
        """Armed in the hook dicts, not as a forward override (a compile started)."""
        if self.overriding:
            self._take_out()
            self._put(True)

    def _override(self) -> bool:
        """Arm as the module's forward override where that is safe (see the module
        docstring): not for a module with a ``gradient_tap`` (its pre-hook is in a dict
        anyway), nor one whose instance has a ``forward`` of its own, nor once anything
        compiled.  Returns whether it did."""
        module = self.module()
        if module is None or self.tap is not None or self.forward is None or _Compiling.seen:
            return False
        own = module.__dict__
        if "forward" in own and not _is_override(own["forward"], module):
            return False
        own["forward"] = _Override(_capturing_forward, module)
        self.overriding = True
        return True

    def _put(self, on: bool) -> None:
        """Every hook this slot registered into its dict (``on``) or out of it."""
        for r in self.registered:
            r.put(on)

    def _take_out(self) -> None:
        """Neither in the hook dicts nor overriding the forward."""
        if not self.overriding:
            self._put(False)
            return
        self.overriding = False  # (nothing of ours in the dicts meanwhile)
        module = self.module()
        if module is not None and _is_override(module.__dict__.get("forward"), module):
            del module.__dict__["forward"]


class _Override(partial):
    """A module's forward override (``_capturing_forward`` bound to the module): a
    ``functools.partial``, which ``copy.deepcopy`` and pickling rebind to the copy, whose
    ``__wrapped__`` (followed by ``inspect.signature``) is the class's forward of its module,
    looked up when asked, not made at every arming."""

    __slots__ = ()

    @property
    def __wrapped__(self) -> Callable[..., Any]:
        module = self.args[0]
        return type(module).forward.__get__(module)


def _capturing_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The forward of a module whose capture hook is armed as an override: the class's
    forward, then the hook, as first of the module's forward hooks (``_Slot._override``).
    Bound to its module by a ``functools.partial``, which ``copy.deepcopy`` and pickling
    rebind to the copy; a copy has no slot, so it only runs its forward."""
    output = type(module).forward(module, *args, **kwargs)
    slot = _SLOTS.get(module)
    if slot is not None and slot.overriding and slot.forward is not None:
        slot.forward.hook(module, args, kwargs, output)
    return output


def _is_override(forward: object, module: nn.Module) -> bool:
    """Whether ``forward`` (from ``module.__dict__``) is this package's override for ``module``."""
    return type(forward) is _Override and forward.args[0] is module


_SLOTS: "weakref.WeakKeyDictionary[nn.Module, _Slot]" = weakref.WeakKeyDictionary()


class _Compiling:
    """Whether dynamo has started compiling in this process (then no hook is disarmed again)."""

    seen = False


def _on_compile_start(*_: object) -> None:
    if not _Compiling.seen:
        keep_hooks_in_place(True)


def keep_hooks_in_place(on: bool = True) -> bool:
    """Keep every capture hook in its dict from now on (``on``, what a compile does), or let
    hooks be taken out between capture steps again; returns the previous setting.  Turning
    it off after a compile is for tests: a graph traced while a hook is out never calls it."""
    previous = _Compiling.seen
    _Compiling.seen = bool(on)
    if on:
        for slot in list(_SLOTS.values()):
            slot.python_only()
            slot.set_armed(True)
            slot.in_dicts()
    return previous


def can_disarm() -> bool:
    """Whether hooks may be taken out now: nothing compiled yet, and a compile starting
    later would be noticed.  ``torch._dynamo.reset()`` drops compile-start callbacks, so the
    watcher is put back on every call (the owner asks at every step)."""
    if _Compiling.seen:
        return False
    try:
        from torch._dynamo.callback import callback_handler

        starts = callback_handler.start_callbacks
        if _on_compile_start not in starts:
            callback_handler.register_start_callback(_on_compile_start)
    except (ImportError, AttributeError):  # no way to learn of a compile: never disarm
        _Compiling.seen = True
        return False
    return True


_NULL_CONTEXT = contextlib.nullcontext()


def _no_grad_in_backward() -> contextlib.AbstractContextManager[object]:
    """no_grad only where the backward builds a graph (create_graph=True): a backward hook
    normally runs with grad mode off already, and the context costs host time per layer."""
    return torch.no_grad() if torch.is_grad_enabled() else _NULL_CONTEXT


def _wants_capture(capture: LayerCapture, module: nn.Module, output: Tensor, where: str) -> bool:
    """Whether this call's statistics are to be captured (training, grad, a capture step, not
    inside ``no_capture()``, and not checkpointing's recomputation in the backward: ``where``
    is ``saved_tensors.state()``)."""
    if not module.training or not torch.is_grad_enabled() or not output.requires_grad:
        return False
    if where == saved_tensors.RECOMPUTING or not capture.is_capturing():
        return False
    if exclusion.excluded():
        capture.excluded_forwards += 1  # reached, on purpose without statistics: not a layer the step missed
        return False
    return True


def _tap_forward(slot: "_Slot", submodule: nn.Module, args: tuple) -> None:
    """Pre-hook of the submodule receiving a norm's affine output: hook the gradient there."""
    slot.tapped = None
    capture = slot.owner()
    if capture is None or slot.tap is None or submodule._forward_pre_hooks is not slot.tap.hooks:
        return  # unbound, or a deep copy's submodule (copy.deepcopy copied the hook dict), as in _capture_forward
    z = args[0] if args else None
    if isinstance(z, Tensor) and _wants_capture(capture, capture.module, z, saved_tensors.state()):
        slot.tapped = _GradTap()
        z.register_hook(_backward_hook(slot.tapped))


def _capture_forward(slot: "_Slot", module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
    tap, slot.tapped = slot.tapped, None
    capture = slot.owner()
    if capture is None or capture.module is not module:
        return  # unbound, or a copy (copy.deepcopy of a model, e.g. an EMA, copies the hook dicts)
    where = saved_tensors.state()
    if slot.tap is not None:
        if tap is None:
            return  # the tap saw no capture (or did not run): nothing to add
    elif not isinstance(output, Tensor) or not _wants_capture(capture, module, output, where):
        return
    x = args[0] if args else kwargs.get("input")
    if not isinstance(x, Tensor):
        return
    rule = capture.rule
    if where == saved_tensors.NONE and _input_saved_for_backward(module) and not _computed_on_a_cast(x, output):
        if tap is None and isinstance(output, Tensor) and _tapped(capture, x, output):
            return  # (the tap holds x detached)
        x = x.detach()
        # The input's statistics are computed with the gradient's, in the backward pass,
        # where the host has time to spare (the forward is launch-bound).  Holding x
        # costs nothing: autograd holds it for the weight's gradient, which is also why
        # it cannot have been changed in place by then.  The hook lets go of x once it has
        # read it: autograd keeps the hook (its node lives until the loss is dropped), and a
        # hook holding x would keep every activation to the end of the backward, where
        # autograd frees each one as soon as its layer's gradient is computed.
        held = [x]

        def on_output_grad(grad: Tensor) -> None:
            if not held:
                return  # a second backward through a retained graph: its input is gone
            x = held.pop()
            ext = _kernels.ext_for(x, grad)
            fused = None if ext is None else capture.fused_stats(x, grad)
            if ext is not None and fused is not None:  # one C++ call: side-stream ordering and both sums
                h, s = fused.run(ext, x, grad, streams.side())
                capture.commit(h, fused.hn, s, fused.sn)
                return
            with _no_grad_in_backward(), streams.beside(x, grad):
                h, hn = rule.input_partial(module, x)
                s, sn = rule.output_partial(module, grad)
                capture.commit(h, hn, s, sn)
    else:
        # Frozen weight (or autograd computing on a cast copy, or a saved-tensor hook such
        # as activation checkpointing deciding where saved tensors go): x may be modified in
        # place before the backward, or be gone by then, so read it now, on the current
        # stream (on the side stream, a later in-place write on the current stream would
        # race with the read).
        x = x.detach()
        if tap is None and isinstance(output, Tensor) and _tapped(capture, x, output, read_now=True):
            return
        with torch.no_grad(), streams.suspended():
            h, hn = rule.input_partial(module, x)
        if tap is None and isinstance(output, Tensor) and _tapped_gradient(capture, x, output, h, hn):
            return
        read = [h]  # one pair per forward, as above: a second backward adds nothing

        def on_output_grad(grad: Tensor) -> None:
            if not read:
                return
            h = read.pop()
            with _no_grad_in_backward(), streams.beside(grad, h):
                s, sn = rule.output_partial(module, grad)
                capture.commit(h, hn, s, sn)

    if tap is not None:
        tap.call = on_output_grad
    elif isinstance(output, Tensor):
        output.register_hook(_backward_hook(on_output_grad))


def _backward_hook(hook: Callable[[Tensor], None]) -> Callable[[Tensor], None]:
    """A Python tensor hook as registered: under compiled autograd (``taps.blocked``) dynamo
    would trace it, freezing its Python state, so it is ``torch.compiler.disable``-d there."""
    return torch.compiler.disable(hook) if taps.blocked() else hook


def _tap_plan(capture: LayerCapture, x: Tensor, output: Tensor, read: tuple[Tensor, ...]) -> Any:
    """The layer's ``TapPlan`` where a C++ gradient tap (``taps.py``) can take this pair: taps
    on, the kernels take the tensors ``read`` and the rule describes the pair as one call;
    else ``None``.  The gradient has the output's shape, dtype and device, so the output
    decides as the gradient would."""
    if not taps.usable():
        return None
    ext = _kernels.ext_for(*read)
    return None if ext is None else capture.tap_plan(ext, x, output)


def _repeat_next_time(capture: LayerCapture, x: Tensor, output: Tensor, plan: Any, read_now: bool) -> None:
    """Open the owner's gate (``tap_gate.py``: every step-level condition was just checked),
    and have the module's C++ forward hook (the extension's ``ForwardTapHook``) repeat this
    tap at the next forwards like this one while it stays open.  The hook checks the rest
    per call, as the general path does (measured on a CPU: about 10 of the ~17 microseconds
    an armed, tapped forward adds are the general path's Python), and calls the Python hook
    for any forward that differs, which decides as before.

    Repeated: the plain tap (the input held to the backward), and the tap reading the input
    in the forward because the layer computed on an autocast copy (input and output dtypes
    differ); not a read for a frozen weight or under a saved-tensor hook, which the hook's
    checks would not settle."""
    slot, gate, module = capture.hook_slot, capture.gate, capture.module
    if slot is None or gate is None or slot.owner() is not capture:
        return
    if not exclusion.any_open():  # (a block open on another thread: this step's forwards ask Python)
        gate.open(streams.side())
    weight = module._parameters.get("weight")  # (a weight that is a property: no repeat)
    hook = None
    if weight is not None and read_now == _computed_on_a_cast(x, output) and capture.tap_ext is not None:
        hook = slot.repeat_hook(capture.tap_ext, module)
    if hook is not None:
        hook.repeat(capture, gate, x, output, weight, plan, read_now)
    else:
        slot.forget_repeat()  # (the last tap is the one to repeat, or none)


def _tapped(capture: LayerCapture, x: Tensor, output: Tensor, read_now: bool = False) -> bool:
    """Register the layer's C++ gradient tap where the Python hook would make one extension
    call in the backward; False (nothing registered) elsewhere.  ``read_now``: ``x`` may
    change, or be gone, before the backward, so the tap's call reads it at once, on the
    current stream (``TapPlan.tap_read``), and the backward sums the gradient only."""
    plan = _tap_plan(capture, x, output, (x, output))
    if plan is None:
        return False
    (plan.tap_read if read_now else plan.tap)(x, output, streams.side())
    capture.taps_out += 1
    _repeat_next_time(capture, x, output, plan, read_now)
    return True


def _tapped_gradient(capture: LayerCapture, x: Tensor, output: Tensor, h: Tensor, hn: float) -> bool:
    """As :func:`_tapped` where the input's statistics ``h``, ``hn`` were read in the forward:
    the tap computes only the gradient's."""
    plan = _tap_plan(capture, x, output, (output,))
    if plan is None:
        return False
    plan.tap_gradient(output, h, hn, streams.side())
    capture.taps_out += 1
    return True


def _hook_for(slot: "_Slot") -> Callable[..., None]:
    """The forward hook of one module, never traced by dynamo (a compiled graph breaks to it,
    and no frame it calls is compiled: its Python state stays out of every graph)."""

    def hook(module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        return _capture_forward(slot, module, args, kwargs, output)

    return _never_traced(hook)


def _tap_hook_for(slot: "_Slot") -> Callable[..., None]:
    """The forward pre-hook of a module's ``gradient_tap`` submodule (never traced either)."""

    def hook(submodule: nn.Module, args: tuple) -> None:
        return _tap_forward(slot, submodule, args)

    return _never_traced(hook)


def _never_traced(hook: Callable[..., None]) -> Callable[..., None]:
    disabled = torch.compiler.disable(hook, recursive=True)
    disabled._lightning_cafin_capture = True
    return disabled


def _computed_on_a_cast(x: Tensor, output: object) -> bool:
    """Whether the layer computed on a cast copy of ``x`` (autocast: a Linear or convolution
    given float32 under bf16 autocast, a LayerNorm given bf16): autograd then keeps the
    copy, not ``x``, so holding ``x`` to the backward would keep a second activation
    alive, and nothing would stop ``x`` from being changed in place meanwhile."""
    return isinstance(output, Tensor) and output.dtype != x.dtype


def _input_saved_for_backward(module: nn.Module) -> bool:
    """Whether autograd keeps the module's input until its backward (the weight needs it).
    A registered parameter is read from the module's dict (``nn.Module.__getattr__`` is a
    Python call per captured layer); a weight that is a property (a parametrization) by
    ``getattr``."""
    params = module._parameters
    weight = params["weight"] if "weight" in params else getattr(module, "weight", None)
    return isinstance(weight, Tensor) and weight.requires_grad


def attach(capture: LayerCapture, armed: bool = True) -> Optional[LayerCapture]:
    """Make ``capture`` the owner of its module's hook, armed or not; return the previous
    live owner."""
    module = capture.module
    slot = _SLOTS.get(module)
    if slot is None:
        slot = _Slot(capture, module)
        hook = _hook_for(slot)
        handle = module.register_forward_hook(hook, with_kwargs=True, prepend=True)
        slot.forward = _Registered(handle, hook, module._forward_hooks, module._forward_hooks_with_kwargs)
        tap = gradient_tap(module)
        if tap is not None:
            tap_hook = _tap_hook_for(slot)
            handle = tap.register_forward_pre_hook(tap_hook, prepend=True)
            slot.tap = _Registered(handle, tap_hook, tap._forward_pre_hooks, None)
        slot.registered = tuple(r for r in (slot.forward, slot.tap) if r is not None)
        _SLOTS[module] = slot
        capture.hook_slot = slot
        slot.armed = False  # (registered in the dicts: armed again below, the way set_armed arms)
        slot._take_out()
        slot.set_armed(armed)
        return None
    previous = slot.owner()
    if previous is not capture:
        slot.forget_repeat()  # (it fills the previous owner's sink)
    slot.owner = weakref.ref(capture)
    capture.hook_slot = slot
    if previous is not None and previous is not capture:
        previous.hook_slot = None
    slot.set_armed(armed)
    return previous if previous is not capture else None


def set_armed(capture: LayerCapture, armed: bool) -> None:
    """Put the module's hooks in their dicts (``armed``) or take them out, if ``capture``
    owns them; they stay in once anything has been compiled.  Callers disarming ask
    :func:`can_disarm` first (it registers the compile watcher)."""
    slot = capture.hook_slot
    if slot is not None and slot.owner() is capture:
        slot.set_armed(armed)


def detach(capture: LayerCapture) -> None:
    """Remove the module's hook if ``capture`` still owns it."""
    slot = _SLOTS.get(capture.module)
    if slot is not None and slot.owner() is capture:
        slot._take_out()  # (no override left behind)
        for r in slot.registered:
            r.remove()
        del _SLOTS[capture.module]
    if capture.hook_slot is slot:
        capture.hook_slot = None


def hook_count(module: nn.Module) -> int:
    """How many capture hooks this package holds on ``module`` (0 or 1), armed or not (in its
    hook dict or as its forward override); for tests and health."""
    armed = sum(1 for hook in module._forward_hooks.values() if getattr(hook, "_lightning_cafin_capture", False))
    slot = _SLOTS.get(module)
    return armed + (1 if slot is not None and (not slot.armed or slot.overriding) else 0)


def forward_hook(module: nn.Module) -> Optional[Callable[..., Any]]:
    """What ``module``'s capture calls at its forwards, armed or not: the extension's
    ``ForwardTapHook`` once a tap was repeatable, else the Python hook; None when it has none."""
    slot = _SLOTS.get(module)
    return None if slot is None or slot.forward is None else slot.forward.hook


def is_armed(module: nn.Module) -> bool:
    """Whether ``module``'s capture hook is called at its forwards (in its hook dict or as its
    forward override; False when it has none)."""
    slot = _SLOTS.get(module)
    return slot is not None and slot.armed
