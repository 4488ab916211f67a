"""What a capture hook does: at a forward, decide whether this call is captured and arrange
for its statistics; at the output's gradient, compute them.

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
input's statistics are read in the forward.  Except where a Linear-like layer computed on
an autocast copy that autograd saved for its weight's gradient and the graph shows to be
the input cast (the extension's ``autocast_copy``): that copy is held in the input's
place and read with the gradient in the backward.  Nothing can change it before then, it
has half the bytes of a float32 input, it is what the layer multiplied (its statistics
differ from the input's by the cast's rounding), and the forward, host-bound under bf16
autocast, makes no launch for it: a transformer's Linears after its float32 LayerNorms.

A norm module that applies an activation itself (timm's ``GroupNormAct``; ``layers.py``,
``gradient_tap``) is hooked twice: a forward pre-hook on the submodule that receives the
norm's affine output registers the tensor hook there, before the activation (in place or
not) runs on it, so the gradient is the norm's own; the module's forward hook then adds
the input side to that tap.

Under ``torch.compile`` the hook body is never traced: it reads Python state (the owner,
the capture schedule) and mutates the pending statistics, which a traced graph would
freeze or misroute (code traced for one module reused for another of the same shapes).
The hook is ``torch.compiler.disable``-d: one graph break per bound module (two for a norm
module with a ``gradient_tap``, whose pre-hook is disabled too), and the
statistics are those of eager mode (the wrapper costs a few microseconds per module call in
eager mode, paid on capture steps only; a hook checking ``torch.compiler.is_compiling()`` itself instead was compiled
as a frame of its own, recompiled per module type, and then ran its body with dynamo active).

Where the hooks sit on their modules (one per module, armed only for steps that may
capture) is ``hooks.py``; what they fill, ``layer_capture.py``.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import Tensor, nn

from . import kernels as _kernels
from . import exclusion, saved_tensors, streams, taps
from .layer_capture import LayerCapture

if TYPE_CHECKING:
    from .hooks import _Slot


class GradTap:
    """A tensor hook registered on a norm's affine output in the forward; the module's own
    forward hook, which runs later, sets what it calls with the gradient."""

    __slots__ = ("call",)

    def __init__(self) -> None:
        self.call: Optional[Callable[[Tensor], None]] = None

    def __call__(self, grad: Tensor) -> None:
        if self.call is not None:
            self.call(grad)


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
        slot.tapped = GradTap()
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
    saved = where == saved_tensors.NONE and _input_saved_for_backward(module)
    if saved and not _computed_on_a_cast(x, output):
        if tap is None and isinstance(output, Tensor) and _tapped(capture, x, output):
            return  # (the tap holds x)
        held = [x.detach()]
    else:
        # Frozen weight (or autograd computing on a cast copy, or a saved-tensor hook such
        # as activation checkpointing deciding where saved tensors go): x may be modified in
        # place before the backward, or be gone by then.  The tap reads it now, or for a
        # Linear-like layer on an autocast copy that autograd saved, holds that copy instead
        # (``TapPlan.tap_read``; the copy cannot change, and is what the layer multiplied).
        if tap is None and isinstance(output, Tensor) and _tapped(capture, x, output, read_now=True):
            return  # (TapPlan.tap_read holds nothing of x, at most the copy)
        # (saved: then the layer computed on a cast, so output is a tensor)
        copy = _autocast_copy(capture, x, output) if saved and isinstance(output, Tensor) else None
        held = [] if copy is None else [copy.detach()]
    if held:
        # The input's statistics are computed with the gradient's, in the backward pass,
        # where the host has time to spare (the forward is launch-bound).  Holding x (or its
        # autocast copy) costs nothing: autograd holds it for the weight's gradient, which
        # is also why it cannot have been changed in place by then.  The hook lets go of it
        # once it has read it: autograd keeps the hook (its node lives until the loss is
        # dropped), and a hook holding it would keep every activation to the end of the
        # backward, where autograd frees each one as soon as its layer's gradient is computed.

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
        # read now, on the current stream (on the side stream, a later in-place write on the
        # current stream would race with the read)
        x = x.detach()
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


def capture_hook(slot: "_Slot") -> Callable[..., None]:
    """The forward hook of one module, never traced by dynamo (a compiled graph breaks to it,
    and no frame it calls is compiled: its Python state stays out of every graph)."""

    def hook(module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        return _capture_forward(slot, module, args, kwargs, output)

    return _never_traced(hook)


def tap_pre_hook(slot: "_Slot") -> Callable[..., None]:
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


def _autocast_copy(capture: LayerCapture, x: Tensor, output: Tensor) -> Optional[Tensor]:
    """The copy of ``x`` a Linear-like layer computed on under autocast (the caller checked
    that it computed on a cast), as autograd saved it for the weight's gradient (the
    extension's ``autocast_copy``), where the kernels take it (it has the output's dtype and
    device) and the rule sums ``x`` per feature over its leading dims; else ``None``.  The
    Python hooks then take the statistics the C++ taps take (``TapPlan.tap_read``), from the
    same values: those the layer multiplied."""
    find = getattr(_kernels.ext_for(x, output), "autocast_copy", None)  # (a build from before it: none)
    if find is None:
        return None
    fused = capture.fused_stats(x, output)
    if fused is None or tuple(fused.input_op[:2]) != (0, -1):
        return None
    return find(x, output)


def _input_saved_for_backward(module: nn.Module) -> bool:
    """Whether autograd keeps the module's input until its backward (the weight needs it).
    A registered parameter is read from the module's dict (``nn.Module.__getattr__`` is a
    Python call per captured layer); a weight that is a property (a parametrization) by
    ``getattr``."""
    params = module._parameters
    weight = params["weight"] if "weight" in params else getattr(module, "weight", None)
    return isinstance(weight, Tensor) and weight.requires_grad
