"""Whether the capture statistics run on a side CUDA stream, beside the backward pass.

The statistics kernels only read activations and gradients (memory-bound), while the
backward pass is mostly convolution and matrix-multiply kernels (compute-bound), so
running the statistics on their own stream lets the GPU overlap the two instead of
adding the statistics' time to the capture step.

Off by default: the ordering costs the host per layer (an event record and wait, the
allocator told of two tensors), which a host-bound capture step pays in full.  Measured
on the H200: once the capture's host work had shrunk (the bench matrix at 44a1b7d) the
side stream made the step-synchronous capture step 4-5% faster on ResNet-18 fp32,
ResNet-50 and the GPT, and 3.5% slower on the host-bound bf16 + channels_last ResNet-18
(1.7% faster there at 3055b31, with the forward's repeated taps in C++);
in a run at 37a093b its pipelined ResNet-50 capture steps were slower (+10.3 ms above a
normal step against +6.2) and its GPT ones faster (+2.1 against +2.8), peak memory equal.
At c34d043 (synchronised steps and blocks of five back-to-back capture steps,
interleaved, 20 rounds; ms above a normal step, current stream / side stream): ResNet-18
fp32 1.67 / 1.80 synchronised and 1.24 / 1.48 pipelined, bf16 + channels_last 2.34 / 2.58
and 2.55 / 3.09, ResNet-50 4.92 / 3.45 and 3.67 / 4.65, the GPT 3.17 / 2.58 and 2.03 /
1.53, peak memory equal: only the GPT gained both ways, so the default stays off.  (The
matrix's synchronised figures before 60b20f8, those at 44a1b7d and 3055b31 above
included, favoured the side stream: its capture steps took the factor update the step
before kept, the current stream's, timed after a Python-hooks capture step, did not.
How the c34d043 figures were taken is not recorded beyond the above: back-to-back
blocks of one kind would take the kept launch both ways.)  The bench matrix times both ways (``sync``
and ``pipelined.tcov1_side_stream``).  A model
whose backward leaves the host idle for long GPU kernels may gain from it
(``capture_stream=True``).

The stream switching itself is done by the extension (``csrc/side_stream.h``), a few
microseconds per layer: a Python stream switch per layer cost more host time than the
launch-bound training step had to spare.  A layer's backward hook enters
:func:`beside` once: the side stream waits for the current stream's work so far, the
activation and gradient are marked as read by the side stream, and the statistics ops
inside run (and allocate their outputs) there.  An op called with ``side()`` outside
such a block orders itself the same way.  Before the optimizer consumes the statistics it calls
:func:`join` (the current stream waits for the side stream); after consuming them,
:func:`release` (the side stream waits for the current one, so the statistics' memory,
freed to the side stream's pool, is not reused while the consumers may still read it).

Partial sums of several micro-batches are added only after :func:`join` (see
``PendingStats``), never on the current stream while the side stream may still write.

The optimizer's ``capture_stream=True`` option, :func:`set_enabled`, or else the
environment variable ``LIGHTNING_CAFIN_CAPTURE_STREAM=1`` (read when first needed, not
at import) turns the side stream on; :func:`suspended` keeps one block on this thread on
the current stream (statistics read in the forward, which a later in-place write on the
current stream must not race).
"""

from __future__ import annotations

import contextlib
import os
import threading
from types import ModuleType
from typing import ContextManager, Iterator, Optional

from torch import Tensor

from . import kernels as _kernels
from .tap_gate import settings_changed

ENV_VAR = "LIGHTNING_CAFIN_CAPTURE_STREAM"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")

_local = threading.local()
_NULL = contextlib.nullcontext()


def parse_flag(value: str, what: str) -> bool:
    """``1/true/yes/on`` or ``0/false/no/off`` (any case), else a ``ValueError`` naming ``what``."""
    v = str(value).strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(f"{what} must be one of {', '.join(_TRUE + _FALSE)}, got {value!r}")


class EnvSwitch:
    """A process-wide on/off setting: the last value set, else its environment variable
    (read when first needed, not at import; a bad value is an error naming it), else
    ``default``."""

    __slots__ = ("env_var", "default", "_value")

    def __init__(self, env_var: str, default: bool = False) -> None:
        self.env_var, self.default = env_var, default
        self._value: Optional[bool] = None  # None: not chosen yet, the environment decides on first use

    def get(self) -> bool:
        if self._value is None:
            raw = os.environ.get(self.env_var, "").strip()
            self._value = parse_flag(raw, f"the environment variable {self.env_var}") if raw else self.default
        return self._value

    def set(self, on: bool) -> bool:
        """Set it; returns the previous setting."""
        previous, self._value = self.get(), bool(on)
        settings_changed()
        return previous

    @contextlib.contextmanager
    def using(self, on: bool) -> Iterator[None]:
        """The setting ``on`` inside the block, the previous one restored after it."""
        previous = self.set(on)
        try:
            yield
        finally:
            self.set(previous)


_switch = EnvSwitch(ENV_VAR)


def set_enabled(on: bool) -> bool:
    """Use (True) or bypass (False) the side stream; returns the previous setting."""
    return _switch.set(on)


def enabled() -> bool:
    """The setting in use: the last one set, else ``$LIGHTNING_CAFIN_CAPTURE_STREAM``, else off."""
    return _switch.get()


def side() -> bool:
    """Whether a statistics op called now should run on the side stream."""
    return enabled() and not getattr(_local, "off", False)


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Statistics ops in this block (on this thread) run on the current stream."""
    previous = getattr(_local, "off", False)
    _local.off = True
    try:
        yield
    finally:
        _local.off = previous


class _Beside:
    """The block runs on the side stream, ordered once (see :func:`beside`)."""

    __slots__ = ("_ext", "_reads", "_on", "_off_before")

    def __init__(self, ext: ModuleType, reads: list[Tensor]) -> None:
        self._ext, self._reads, self._on = ext, reads, False

    def __enter__(self) -> None:
        self._on = self._ext.capture_side_enter(self._reads)
        if self._on:  # the ops inside are on the side stream already: no second ordering
            self._off_before = getattr(_local, "off", False)
            _local.off = True

    def __exit__(self, *exc: object) -> None:
        if self._on:
            _local.off = self._off_before
            self._ext.capture_side_exit()


def beside(*reads: Tensor) -> ContextManager[None]:
    """A context running a layer's statistics ops on the side stream with one ordering for
    all of them (instead of one per op), ``reads`` marked as read there.  A no-op (the
    ops then order themselves, or stay on the current stream) when the side stream is
    off or suspended, for CPU tensors, or before the extension is loaded."""
    ext = _kernels.loaded_extension()
    if ext is None or not enabled() or getattr(_local, "off", False) or not reads[0].is_cuda:
        return _NULL
    return _Beside(ext, list(reads))


def join() -> None:
    """Make the current stream of every device with side work wait for it."""
    ext = _kernels.loaded_extension()
    if ext is not None:
        ext.capture_join()


def release() -> None:
    """After the statistics were consumed: the side streams wait for the current streams."""
    ext = _kernels.loaded_extension()
    if ext is not None:
        ext.capture_release()
