"""A counting stand-in for host synchronisation, usable on the CPU (the callback's bench and its tests).

Every call that would make the host wait for a device value (``Tensor.item``, ``bool``,
``float``, ``int``, ``tolist``, ``numpy``, ``cpu``, ``torch.cuda.synchronize``, CUDA event
and stream waits) is counted when the Python stack at that moment runs through the
monitoring code (``lightning_cafin/callback.py`` or ``lightning_cafin/monitor/``): what the
dashboard itself costs, not what Lightning or the optimizer do.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from types import FrameType
from typing import Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode

_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WATCHED = (os.path.join(_PKG, "callback.py"), os.path.join(_PKG, "monitor") + os.sep)
_READS = {"item", "__bool__", "__float__", "__int__", "__index__", "tolist", "numpy", "cpu"}


def from_monitoring() -> bool:
    frame: Optional[FrameType] = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(WATCHED[1]) or name == WATCHED[0]:
            return True
        frame = frame.f_back
    return False


class SyncCounter(TorchFunctionMode):
    """The host reads and device waits seen inside a :func:`counting_syncs` block, on this
    thread (a torch function mode is per thread), and where each came from."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.where: list[str] = []

    def hit(self, what: str) -> None:
        if from_monitoring():
            self.count += 1
            self.where.append(what)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _READS:
            self.hit(name)
        return func(*args, **(kwargs or {}))


@contextmanager
def counting_syncs() -> Iterator[SyncCounter]:
    """Count the monitoring code's host reads and device waits inside the block."""
    counter = SyncCounter()
    patched = []

    def wrap(owner, attr):
        original = getattr(owner, attr)

        def counted(*args, **kwargs):
            counter.hit(f"{getattr(owner, '__name__', owner)}.{attr}")
            return original(*args, **kwargs)

        setattr(owner, attr, counted)
        patched.append((owner, attr, original))

    wrap(torch.cuda, "synchronize")
    wrap(torch.cuda.Event, "synchronize")
    wrap(torch.cuda.Event, "elapsed_time")
    wrap(torch.cuda.Stream, "synchronize")
    try:
        with counter:
            yield counter
    finally:
        for owner, attr, original in patched:
            setattr(owner, attr, original)
