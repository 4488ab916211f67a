"""Step backends, chosen by name: ``reference`` (the oracle), ``foreach``, ``fused``, or ``auto``.

Each backend applies the update to a typed batch (``StepBatch``); which backend takes
which tensor, the plans and the per-device scalars are the dispatcher's
(``dispatch.py``); the optimizer creates the state (``state.py``)."""

from __future__ import annotations

import warnings

from .base import FactorView, StepBackend, StepBatch, StepHyper
from .foreach import ForeachBackend
from .reference import ReferenceBackend

BACKEND_NAMES = ("auto", "reference", "foreach", "fused")

_auto_warned = False


def fused_unavailable_reason() -> str | None:
    """``None`` when the fused backend can run here, else why it cannot."""
    try:
        from ..kernels import can_run_fused
    except ImportError as exc:  # the kernels package is absent from this build
        return f"the CUDA kernels are not part of this installation ({exc})"
    ok, reason = can_run_fused()
    return None if ok else reason


def make_backend(name: str) -> StepBackend:
    """A new backend instance for ``name`` (one per optimizer: backends hold caches).

    ``auto`` is ``fused`` where the CUDA extension loads and a GPU is present, else
    ``foreach``, with one warning per process naming the reason.  Asking for ``fused``
    where it cannot run is an error that says why.
    """
    global _auto_warned
    if name not in BACKEND_NAMES:
        raise ValueError(f"backend={name!r} is not one of {', '.join(map(repr, BACKEND_NAMES))}")
    if name == "reference":
        return ReferenceBackend()
    if name == "foreach":
        return ForeachBackend()
    reason = fused_unavailable_reason()
    if reason is None:
        from .fused import FusedBackend

        return FusedBackend()
    if name == "fused":
        raise RuntimeError(f"backend='fused' cannot run here: {reason}. Use backend='auto' or 'foreach'.")
    if not _auto_warned:
        _auto_warned = True
        warnings.warn(f"lightning_cafin: backend='auto' uses 'foreach' because {reason}", stacklevel=3)
    return ForeachBackend()


__all__ = [
    "BACKEND_NAMES",
    "FactorView",
    "StepBackend",
    "StepBatch",
    "StepHyper",
    "ForeachBackend",
    "ReferenceBackend",
    "make_backend",
    "fused_unavailable_reason",
]
