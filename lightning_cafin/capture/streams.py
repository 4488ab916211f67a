"""A side CUDA stream for the capture statistics, beside the backward pass.

The statistics kernels only read activations and gradients (memory-bound), while the
backward pass is mostly convolution and matrix-multiply kernels (compute-bound), so
running the statistics on their own stream lets the GPU overlap the two instead of
adding the statistics' time to the capture step.

Ordering: each hook's work waits for what the current stream has enqueued so far (the
tensors it reads are ready), and the tensors it reads are marked as used by the side
stream (the caching allocator then cannot hand their memory out before the side stream
is done).  Before the optimizer consumes the statistics it calls :func:`join` (the
current stream waits for the side stream); after consuming them, :func:`release` (the
side stream waits for the current one, so the statistics' memory, freed to the side
stream's pool, is not reused while the consumers may still read it).

``LIGHTNING_CAFIN_CAPTURE_STREAM=0`` (or :func:`set_enabled`) runs everything on the
current stream instead (profiling, or a CUDA-graph capture of the whole step).
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch
from torch import Tensor

_enabled = os.environ.get("LIGHTNING_CAFIN_CAPTURE_STREAM", "1").strip() not in ("0", "false", "no", "off")
_side: dict[int, torch.cuda.Stream] = {}
_used: set[int] = set()  # devices whose side stream has work the current stream has not joined


def set_enabled(on: bool) -> bool:
    """Use (True) or bypass (False) the side stream; returns the previous setting."""
    global _enabled
    previous, _enabled = _enabled, bool(on)
    return previous


def enabled() -> bool:
    return _enabled


@contextlib.contextmanager
def beside(*tensors: Tensor) -> Iterator[None]:
    """Run the block on the device's side stream after the current stream's work so far,
    with ``tensors`` marked as read there.  A no-op context for CPU tensors or when off."""
    device = tensors[0].device
    if not _enabled or device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        yield
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    side = _side.get(index)
    if side is None:
        side = _side[index] = torch.cuda.Stream(device=index)
    side.wait_stream(torch.cuda.current_stream(index))
    for t in tensors:
        t.record_stream(side)
    _used.add(index)
    with torch.cuda.stream(side):
        yield


def join() -> None:
    """Make the current stream of every device used wait for its side stream's work."""
    for index in _used:
        torch.cuda.current_stream(index).wait_stream(_side[index])


def release() -> None:
    """After the statistics were consumed: the side streams wait for the current streams."""
    for index in list(_used):
        _side[index].wait_stream(torch.cuda.current_stream(index))
    _used.clear()
