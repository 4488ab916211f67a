"""Whether the capture statistics run on a side CUDA stream, beside the backward pass.

The statistics kernels only read activations and gradients (memory-bound), while the
backward pass is mostly convolution and matrix-multiply kernels (compute-bound), so
running the statistics on their own stream lets the GPU overlap the two instead of
adding the statistics' time to the capture step.

Neither stream is the default: the ordering costs the host per layer (an event record
and wait, the allocator told of two tensors), which a host-bound capture step pays in full,
so the overlap pays on some models and costs on others.  The default, ``"auto"``
(``stream_choice.py``), times a few of the model's own capture steps each way and keeps
the faster stream.  Measured so far (capture step's time, side stream against current
stream; ResNet-18 fp32, bf16 + channels_last, ResNet-50, the GPT):

- H100, the bench matrix at 61bcb9f (``bench-matrix-h100-61bcb9f.json``), the first to time
  ``"auto"`` beside both: side 0.961x / 1.009x / 0.973x / 0.990x, auto 0.960x / 0.961x /
  0.971x / 0.993x (it chose the side stream on all but bf16 + channels_last), at or under the
  better fixed stream within the interval on all four; so ``"auto"`` became the default.

- H100, the bench matrix at 1b851b1, the first run whose timed capture steps all took
  the factor update kept from the step before
  (``docs/results/bench-matrix-h100-1b851b1.json``): step-synchronous 0.971x / 0.991x /
  0.972x / 0.989x, pipelined at TCov=1 0.960x / 0.985x / 0.973x / 0.990x (the bf16 +
  channels_last pair and ResNet-18's synchronised one within noise of 1).
- H100 again, on a fresh machine with a slower, noisier host (11.4 against 10.1 us per
  torch op), at e984ef8 (``bench-matrix-h100-e984ef8.json``): step-synchronous 0.995x /
  1.030x / 0.968x / 0.981x, pipelined 1.000x / 1.070x / 0.969x / 0.989x: slower on the
  host-bound bf16 + channels_last ResNet-18 both ways, faster on ResNet-50 and the GPT.
  Peak memory of the side stream's capture step 1.000x a normal step's on all four.
- H200, c34d043 (synchronised steps and blocks of five back-to-back capture steps,
  interleaved, 20 rounds; ms above a normal step, current / side): ResNet-18 fp32 1.67 /
  1.80 synchronised and 1.24 / 1.48 pipelined, bf16 + channels_last 2.34 / 2.58 and
  2.55 / 3.09, ResNet-50 4.92 / 3.45 and 3.67 / 4.65, the GPT 3.17 / 2.58 and 2.03 /
  1.53, peak memory equal.  How these were taken is not recorded beyond that:
  back-to-back blocks of one kind would take the kept launch both ways.
- H200, a run at 37a093b: pipelined ResNet-50 capture steps slower (+10.3 ms above a
  normal step against +6.2), the GPT's faster (+2.1 against +2.8), peak memory equal.
- H200, the bench matrix's synchronised figures at 44a1b7d (4-5% faster on ResNet-18
  fp32, ResNet-50 and the GPT, 3.5% slower on bf16 + channels_last), 3055b31 (1.7%
  faster there, with the forward's repeated taps in C++), 1f7ae31 (on a host twice as
  slow: 2.4% faster on ResNet-18 fp32 and the GPT, 0.7% and 1.2% slower on bf16 +
  channels_last and ResNet-50), 018603b (a slower host still: between 1.3% faster and
  0.1% slower on all four) and fe5ad38 (0.977x / 1.010x / 0.952x / 0.989x).  All of
  these favoured the side stream: its capture steps took the kept factor update, the
  current stream's, timed after a Python-hooks capture step that dropped it (before
  60b20f8), did not.
- H100, the bench matrix at c3c2eea and at 844bd72 (``bench-matrix-h100-c3c2eea.json``,
  ``bench-matrix-h100-844bd72.json``, two machines): step-synchronous 0.962x / 1.039x /
  0.970x / 0.991x and 0.960x / 1.036x / 0.971x / 0.991x.

On the kept launch both ways, the side stream paid where the backward keeps the device
busy (in all five matrix runs above: ResNet-50 by 3-5%, the GPT by 1-2%, ResNet-18 fp32
by 0.5-4%) and cost where the host is the bottleneck (bf16 + channels_last ResNet-18: 1.010x to
1.039x in four of the five), with no memory cost.  At 844bd72, by the medians of its
synchronised steps (side stream, current stream), a capture step took +0.49 / +1.15 ms above a
normal step on ResNet-18 fp32, +1.99 / +1.64 ms on bf16 + channels_last, 1.066x / 1.098x on
ResNet-50 and 1.040x / 1.049x on the GPT: the side stream would have met two more of the
capture step's goals, and missed bf16 + channels_last's by more.
The bench matrix times every setting (``sync``: the current stream, the side stream and
``"auto"`` explicitly; ``pipelined.tcov1_side_stream`` against the default).

Whether the side stream's kernels run beside the backward pass or after it has changed from
process to process on H100s (``side-stream-per-process-h100-e855321.txt``: ResNet-18 +1.02 to
+1.09 ms above a normal step in one process, +0.64 to +0.69 in others), and it follows the
stream, not its priority: of two side streams in one process (one of torch's default-priority
streams, the default, and a high-priority one, :func:`side_priority`), one had the gain and
the other none, the default-priority one in one process and the high-priority one in another,
and in some processes both had it (``side-stream-priority-h100-641e14a.txt``,
``side-stream-priority-h100-e4859e1.txt``).  The bench matrix times both
(``sync.high_vs_default_priority_ratio``).  It is not the driver's hardware work queues that
streams share (8 unless ``CUDA_DEVICE_MAX_CONNECTIONS`` is set): with one queue the side stream
still ran beside the current one (``side-stream-queues-h100-e9a5d2a.txt``), and with 32 neither
side stream gained more consistently than with 8 (``side-connections-h100-385ef91.txt``).  The
matrix at 385ef91 on an H100 (``bench-matrix-h100-385ef91.json``): side over current stream
0.988x / 1.002x / 0.986x / 0.989x, high over default priority 1.017x / 1.005x / 1.020x / 1.019x,
``"auto"`` choosing the side stream on all but bf16 + channels_last.

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

The optimizer's ``capture_stream`` option, else the process setting: :func:`set_enabled`,
else the environment variable ``LIGHTNING_CAFIN_CAPTURE_STREAM`` (``1``, ``0`` or ``auto``;
read when first needed, not at import), else ``"auto"``.  Under ``"auto"`` the optimizer
capturing now says which stream its capture step uses (:func:`use`), the setting staying
``"auto"`` for every other optimizer; :func:`enabled` is the stream in use.
:func:`suspended` keeps one block on this thread on the current stream (statistics read in
the forward, which a later in-place write on the current stream must not race).
"""

from __future__ import annotations

import contextlib
import os
import threading
from types import ModuleType
from typing import ContextManager, Iterator, Literal, Optional, Union

from torch import Tensor

from . import kernels as _kernels
from .tap_gate import settings_changed

ENV_VAR = "LIGHTNING_CAFIN_CAPTURE_STREAM"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")

_local = threading.local()
_NULL = contextlib.nullcontext()


def parse_flag(value: str, what: str, also: tuple[str, ...] = ()) -> Union[bool, str]:
    """``1/true/yes/on`` or ``0/false/no/off`` (any case), or one of ``also`` (returned in lower
    case), else a ``ValueError`` naming ``what``."""
    v = str(value).strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    if v in also:
        return v
    raise ValueError(f"{what} must be one of {', '.join(_TRUE + _FALSE + also)}, got {value!r}")


def env_setting(env_var: str, default: Union[bool, str], also: tuple[str, ...] = ()) -> Union[bool, str]:
    """``env_var``'s value as :func:`parse_flag` reads it (``also``: the named choices it takes
    besides on and off), ``default`` where it is unset or blank."""
    raw = os.environ.get(env_var, "").strip()
    return parse_flag(raw, f"the environment variable {env_var}", also) if raw else default


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
            self._value = bool(env_setting(self.env_var, self.default))
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


#: the process setting: the side stream (True), the current one (False), or ``"auto"``
#: (each optimizer's capture steps choose, ``stream_choice.py``)
Setting = Union[bool, Literal["auto"]]
AUTO: Literal["auto"] = "auto"


class _StreamSetting:
    """The process setting (the last one set, else ``$LIGHTNING_CAFIN_CAPTURE_STREAM``, read
    when first needed, else ``"auto"``) and, under ``"auto"``, the stream in use: the one the
    optimizer capturing now chose (:func:`use`), the current stream until one has."""

    __slots__ = ("_setting", "_chosen")

    def __init__(self) -> None:
        self._setting: Optional[Setting] = None  # None: the environment decides on first use
        self._chosen = False

    def get(self) -> Setting:
        if self._setting is None:
            self._setting = env_setting(ENV_VAR, AUTO, (AUTO,))  # type: ignore[assignment]
        return self._setting  # type: ignore[return-value]

    def set(self, setting: Setting) -> Setting:
        if not isinstance(setting, bool) and setting != AUTO:
            raise TypeError(f"the capture stream setting must be True, False or 'auto', got {setting!r}")
        previous, self._setting, self._chosen = self.get(), setting, False
        settings_changed()
        return previous

    def in_use(self) -> bool:
        setting = self.get()
        return setting if isinstance(setting, bool) else self._chosen

    def use(self, side: bool) -> None:
        if bool(side) != self._chosen:
            self._chosen = bool(side)
            settings_changed()


_setting = _StreamSetting()


def set_enabled(setting: Setting) -> Setting:
    """The side stream (True), the current stream (False), or each optimizer's choice by
    timing (``"auto"``), for every optimizer whose ``capture_stream`` is ``None``; returns
    the previous setting."""
    return _setting.set(setting)


def setting() -> Setting:
    """The process setting: the last one set, else ``$LIGHTNING_CAFIN_CAPTURE_STREAM`` (``1``,
    ``0`` or ``auto``), else ``"auto"``."""
    return _setting.get()


def enabled() -> bool:
    """Whether the side stream is in use: the setting where it is True or False; under
    ``"auto"``, the stream the capturing optimizer chose (:func:`use`), else off."""
    return _setting.in_use()


def use(side: bool) -> None:
    """Under ``"auto"``: the stream of the capture step under way, as its optimizer chose it
    (the setting itself stays ``"auto"``; under True or False this has no effect)."""
    _setting.use(side)


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


def side_priority(high: bool) -> ContextManager[None]:
    """Inside: the side stream is one of torch's high-priority streams (True: the bench's
    comparison; the block scheduler starts its kernels' blocks before pending ones of the
    default-priority current stream) or a default-priority one (False: the extension's
    default), the previous priority restored after it.  Loads the extension."""
    return _kernels.extension_setting("capture_side_high_priority", high)


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
