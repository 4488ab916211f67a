"""Whether a captured layer's statistics are taken by a C++ gradient tap instead of a Python
tensor hook.

A capture step is host-bound: per captured layer the Python tensor hook costs its
registration in the forward (11 microseconds a call, measured on the H200 machine's host),
then in the backward a call into the interpreter, the hook's own Python and the
statistics op's argument parsing.  With the tap, the forward hook makes one extension
call (the layer's ``TapPlan.tap``, ``csrc/capture_tap.h``) that registers a C++ hook on
the output; in the backward pass that hook runs ``layer_stats`` and stores its results in
the layer's ``TapSink`` without entering Python, and the optimizer takes them at the step
(``LayerCapture.pending``).  The statistics are the same kernels' (the same one call per
layer the Python hook makes); only where the host spends its time changes.

The tap of a training batch norm, or of a layer norm on an input of 3 or more dims, calls
no statistics op: its plan registers a post hook on the norm's backward node, which takes
the input's sums from the means the norm saved and the gradient's from the bias gradient
the node returns (``csrc/capture_tap.h``); neither the activation nor the gradient is read
again.  In a plain ``backward()`` the hook only notes the call where its bias gradient
goes to the bias's gradient accumulator alone and unhooked, keeping that gradient's memory,
and autograd's final callback computes every such norm's statistics in one launch from
those gradients, whatever became of ``.grad`` meanwhile (``csrc/deferred_norms.h``);
:func:`deferred_norms` turns that off for an A/B.

Taken only where the rule describes the statistics as that one call (a ``FusedStats`` for
the shapes) on tensors the kernels take.  Where the input must be read in the forward (a
frozen weight, a layer computing on an autocast copy, activation checkpointing), the tap
reads it in its own call (``TapPlan.tap_read``: on the GPT under bf16 autocast, where
every Linear after a LayerNorm computes on a cast copy, this took the capture forward
from 147.6 to 136.4 host microseconds per layer against a Python statistics op beside a
gradient-only tap, 30 interleaved steps on the H200 at 10631c3); where only the output
suits the kernels, the tap (``TapPlan.tap_gradient``) computes only the gradient's, the
input's sums read by the Python rule.  Everything else keeps the Python hook.

On by default since the bench measured it on the H200 (at 6ba2567, step-synchronous, a
capture step with taps against one with Python hooks: 0.97x ResNet-18 fp32, 0.93x bf16 +
channels_last, 0.95x ResNet-50, 0.99x the GPT; the backward's host time per captured
layer went from 49-63 to 19-38 microseconds).  :func:`set_enabled`, :func:`using`, or
``LIGHTNING_CAFIN_CAPTURE_TAP=0`` (read when first needed, not at import) turns it off.

Compiled autograd (``torch._dynamo.compiled_autograd``) cannot run C++ hooks: it refuses
them with ``NotImplementedError: compiled_args nyi``, where it runs Python tensor hooks.
So while it is enabled (inside its ``_enable`` context), or configured for compiled
backward calls (``torch._dynamo.config.compiled_autograd``, read at every optimizer step:
the config object is slow to read per layer), the capture hooks register Python hooks
(:func:`blocked`).
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import ContextManager

from .kernels import extension_setting
from .streams import EnvSwitch
from .tap_gate import settings_changed

ENV_VAR = "LIGHTNING_CAFIN_CAPTURE_TAP"

_switch = EnvSwitch(ENV_VAR, default=True)


def set_enabled(on: bool) -> bool:
    """Take statistics with C++ taps (True) or Python hooks (False); returns the previous setting."""
    return _switch.set(on)


def enabled() -> bool:
    """The setting in use: the last one set, else ``$LIGHTNING_CAFIN_CAPTURE_TAP``, else on."""
    return _switch.get()


def using(on: bool) -> ContextManager[None]:
    """Taps on or off inside a ``with`` block; the previous setting is restored after it."""
    return _switch.using(on)


def deferred_norms(on: bool) -> ContextManager[None]:
    """Inside: a norm tap leaves its statistics to the end of its backward where it can (True,
    the extension's default: one launch for all of them) or launches in its hook (False: the
    comparison of ``scripts/capture_variants.py``), the previous setting restored after it.
    The statistics are the same floats either way.  Loads the extension."""
    return extension_setting("capture_defer_norms", on)


def available(ext: ModuleType) -> bool:
    """Whether the loaded extension has the taps (a build from before them has not)."""
    return hasattr(ext, "TapPlan")


class _CompiledAutograd:
    """``torch._dynamo.config.compiled_autograd`` as read at the last optimizer step."""

    configured = False


def note_compiled_autograd_config() -> None:
    """Read whether compiled autograd is configured for compiled backward calls (the
    optimizer calls this at every step; a process that never imported dynamo has not)."""
    config = sys.modules.get("torch._dynamo.config")
    configured = bool(config is not None and getattr(config, "compiled_autograd", False))
    if configured != _CompiledAutograd.configured:
        _CompiledAutograd.configured = configured
        settings_changed()


def usable() -> bool:
    """Taps on and not blocked: what every captured layer's forward asks, in one call."""
    return _switch.get() and not blocked()


def blocked() -> bool:
    """Whether the backward may run under compiled autograd, which cannot call C++ taps:
    it is enabled now, or configured (as of the last optimizer step)."""
    if _CompiledAutograd.configured:
        return True
    module = sys.modules.get("torch._dynamo.compiled_autograd")
    return module is not None and bool(getattr(module, "compiled_autograd_enabled", False))
