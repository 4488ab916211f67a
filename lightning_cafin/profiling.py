"""Named ranges for ``torch.profiler``: what an optimizer step spent on the factors and on the update.

torch names the whole ``optimizer.step()`` (``Optimizer.step#AdaFisher.step``); inside it a
trace showed one anonymous block.  These ranges split it into the capture step's factor
update (``AdaFisher.update_factors``) and every step's parameter update
(``AdaFisher.update_parameters``), under the optimizer's class name.

A range is opened only while a profiler records: ``record_function`` costs about 8
microseconds per use on a CPU even when nothing records, and a normal step's host work is
what a step-synchronous loop waits for; asking whether one records costs about 0.1.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch
from torch.autograd.profiler import record_function

_NULL = contextlib.nullcontext()
#: whether a profiler records (the autograd profiler's own flag, which torch.profiler sets)
_recording = getattr(torch.autograd, "_profiler_enabled", None)


def profiled(name: str) -> ContextManager[object]:
    """A range called ``name`` in a profiler trace while one records; else a no-op context."""
    if _recording is not None and _recording():
        return record_function(name)
    return _NULL
