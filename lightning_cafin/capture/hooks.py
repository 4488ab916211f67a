"""Where the capture hooks sit on their modules: one per module, armed only for steps that
may capture, and what ``torch.compile`` changes about that.  What a hook does is in
``forward_capture.py``.

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
layers' from 11.0 to 9.0 us a layer; most of the rest is the tap on the output).  Once the
module's hook is the extension's ``ForwardTapHook``, the override calls its
``forward_then_hook`` (the class's forward and the hook in one C call) instead of
``_capturing_forward``, a Python frame, a slot lookup and a call of the hook (on a CPU, 40
Linear layers with the taps of ``csrc/capture_tap.cpp``: 1.1-1.2 us a layer above a
disarmed forward instead of 2.1-2.3; on an H100 at c3c2eea a ResNet-18's capture forward
added 3.0 us a layer, 14.5 at 1b851b1).  The override is a
``functools.partial`` of the module (``_Override``), which ``copy.deepcopy`` and pickling
make ``_capturing_forward`` bound to the copy (a copy has no slot and only runs its forward), and keeps the forward's
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
(dynamo cannot inspect it, and the Python hook is never traced: ``forward_capture.py``).  The compile-start
watcher is registered again at every optimizer step (``torch._dynamo.reset()`` drops it);
a compile started between such a reset and the next step, while the hooks are out, goes
unnoticed, and its capture steps then warn that no forward reached the layers.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from functools import partial
from types import ModuleType
from typing import Any, Callable, Optional

from torch import nn
from torch.utils.hooks import RemovableHandle

from . import saved_tensors
from .forward_capture import GradTap, capture_hook, tap_pre_hook
from .layer_capture import LayerCapture
from .layers import gradient_tap
from .tap_gate import SettingsEpoch


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
        self.tapped: Optional[GradTap] = None
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
            self._hook_replaced(module)  # (overriding: the C++ hook's own override from the next forward)
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
            self._hook_replaced(self.module())

    def _hook_replaced(self, module: Optional[nn.Module]) -> None:
        """After ``forward.hook`` changed: the override made anew where the hook overrides the
        forward (of a module still alive), else, armed, the new hook put in the dict (the same
        key: its place first is kept)."""
        if self.overriding:
            if module is not None:
                self._set_override(module)
        elif self.armed and self.forward is not None:
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
        self._set_override(module)
        self.overriding = True
        return True

    def _set_override(self, module: nn.Module) -> None:
        """Set the module's forward override: the C++ hook's ``forward_then_hook`` once there
        is one (the class's forward and the hook in one C call), else ``_capturing_forward``."""
        function = getattr(self.cpp_hook, "forward_then_hook", None)
        module.__dict__["forward"] = _Override(function if function is not None else _capturing_forward, module)

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
    """A module's forward override (``_capturing_forward``, or the C++ hook's
    ``forward_then_hook``, bound to the module): a ``functools.partial``, whose
    ``__wrapped__`` (followed by ``inspect.signature``) is the class's forward of its module,
    looked up when asked, not made at every arming.  ``copy.deepcopy`` and pickling make it
    ``_capturing_forward`` bound to the copy (``__reduce__``): a C++ hook can be neither
    pickled nor copied, and a copy has no slot, so it only runs its forward."""

    __slots__ = ()

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (_capturing_forward, self.args[0])

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


def attach(capture: LayerCapture, armed: bool = True) -> Optional[LayerCapture]:
    """Make ``capture`` the owner of its module's hook, armed or not; return the previous
    live owner."""
    module = capture.module
    slot = _SLOTS.get(module)
    if slot is None:
        slot = _Slot(capture, module)
        hook = capture_hook(slot)
        handle = module.register_forward_hook(hook, with_kwargs=True, prepend=True)
        slot.forward = _Registered(handle, hook, module._forward_hooks, module._forward_hooks_with_kwargs)
        tap = gradient_tap(module)
        if tap is not None:
            tap_hook = tap_pre_hook(slot)
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
