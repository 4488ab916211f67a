"""Whether the capture statistics run on a side CUDA stream, beside the backward pass.

The statistics kernels only read activations and gradients (memory-bound), while the
backward pass is mostly convolution and matrix-multiply kernels (compute-bound), so
running the statistics on their own stream lets the GPU overlap the two instead of
adding the statistics' time to the capture step.

The stream switching itself is done by the extension (``csrc/side_stream.h``), a few
microseconds per layer: a Python stream switch per layer cost more host time than the
launch-bound training step had to spare.  Each statistics op asked for ``side()`` waits
for the current stream's work so far, marks its inputs as read by the side stream and
allocates its outputs there.  Before the optimizer consumes the statistics it calls
:func:`join` (the current stream waits for the side stream); after consuming them,
:func:`release` (the side stream waits for the current one, so the statistics' memory,
freed to the side stream's pool, is not reused while the consumers may still read it).

Partial sums of several micro-batches are added only after :func:`join` (see
``PendingStats``), never on the current stream while the side stream may still write.

``LIGHTNING_CAFIN_CAPTURE_STREAM=0`` (or :func:`set_enabled`) runs everything on the
current stream instead (profiling, comparisons); :func:`suspended` does so for one
block on this thread (statistics read in the forward, which a later in-place write on
the current stream must not race).
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator

from . import kernels as _kernels

_enabled = os.environ.get("LIGHTNING_CAFIN_CAPTURE_STREAM", "1").strip().lower() not in ("0", "false", "no", "off")
_local = threading.local()


def set_enabled(on: bool) -> bool:
    """Use (True) or bypass (False) the side stream; returns the previous setting."""
    global _enabled
    previous, _enabled = _enabled, bool(on)
    return previous


def enabled() -> bool:
    return _enabled


def side() -> bool:
    """Whether a statistics op called now should run on the side stream."""
    return _enabled and not getattr(_local, "off", False)


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Statistics ops in this block (on this thread) run on the current stream."""
    previous = getattr(_local, "off", False)
    _local.off = True
    try:
        yield
    finally:
        _local.off = previous


def join() -> None:
    """Make the current stream of every device with side work wait for it."""
    if _kernels._EXT is not None:
        _kernels._EXT.capture_join()


def release() -> None:
    """After the statistics were consumed: the side streams wait for the current streams."""
    if _kernels._EXT is not None:
        _kernels._EXT.capture_release()
