"""Which implementation the capture statistics and the factor update use.

The CUDA extension's capture kernels (``csrc/capture_stats.cu``) take CUDA tensors in
float32, float16 or bfloat16; everything else (CPU tensors, float64, a missing or
unbuildable extension, non-zero conv padding modes) runs the torch ops in
``layers.py`` / ``factors.py``, which stay the reference the kernels are tested
against.

The optimizer's ``capture=`` option, :func:`set_impl`, or else the environment variable
``LIGHTNING_CAFIN_CAPTURE`` (read when first needed, not at import) picks the
implementation: ``auto`` (default: the kernels where they can run), ``torch`` (always
the torch ops), ``kernels`` (the kernels, raising instead of falling back when the
extension is missing; tests and profiling).  A CPU tensor never touches the extension, so a
machine without a GPU never builds it for capture.
"""

from __future__ import annotations

import contextlib
import os
from types import ModuleType
from typing import Iterator, Optional

import torch
from torch import Tensor

from .tap_gate import settings_changed

IMPLS = ("auto", "torch", "kernels")
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

ENV_VAR = "LIGHTNING_CAFIN_CAPTURE"

_impl: Optional[str] = None  # None: not chosen yet, the environment decides on first use


def check_impl(name: str, what: str = "capture") -> str:
    """``name`` normalised, or a ``ValueError`` naming ``what`` and the accepted values
    (a typo must not silently change the maths path)."""
    value = str(name).strip().lower()
    if value not in IMPLS:
        raise ValueError(f"{what} must be one of {', '.join(map(repr, IMPLS))}, got {name!r}")
    return value


def set_impl(name: str) -> str:
    """Select ``auto``, ``torch`` or ``kernels``; returns the previous choice."""
    global _impl
    value = check_impl(name, "capture implementation")
    previous, _impl = get_impl(), value
    settings_changed()
    return previous


def get_impl() -> str:
    """The implementation in use: the last one set, else ``$LIGHTNING_CAFIN_CAPTURE``, else ``auto``."""
    global _impl
    if _impl is None:
        _impl = check_impl(os.environ.get(ENV_VAR, "auto").strip() or "auto", f"the environment variable {ENV_VAR}")
    return _impl


_EXT: Optional[ModuleType] = None  # the loader's module once it proved to have the capture kernels (hot path)


def loaded_extension() -> Optional[ModuleType]:
    """The extension if a capture already loaded it, else None (never loads or builds)."""
    return _EXT


def _extension() -> Optional[ModuleType]:
    global _EXT
    if _EXT is not None:
        return _EXT
    from ..kernels.loader import extension_info, extension_or_none

    ext = extension_or_none()
    if ext is None:
        if get_impl() == "kernels":
            raise RuntimeError(f"capture kernels requested but unavailable: {extension_info().reason}")
        return None
    if not hasattr(ext, "channel_stats"):  # an extension built before the capture kernels existed
        if get_impl() == "kernels":
            raise RuntimeError("the loaded lightning_cafin extension has no capture kernels; rebuild it")
        return None
    _EXT = ext
    return ext


def ext_for(*tensors: Tensor) -> Optional[ModuleType]:
    """The extension when the kernels should handle these tensors, else ``None``."""
    if get_impl() == "torch":
        return None
    for t in tensors:
        if not t.is_cuda or t.dtype not in KERNEL_DTYPES:
            return None
    return _extension()


@contextlib.contextmanager
def extension_setting(setter: str, value: bool) -> Iterator[None]:
    """Inside: one of the extension's process-wide switches (``setter``: its function that
    takes the new value and returns the one before) at ``value``, the previous value
    restored after it.  Loads the extension (building it if needed)."""
    from ..kernels.loader import load_extension

    set_value = getattr(load_extension(), setter)
    previous = set_value(bool(value))
    try:
        yield
    finally:
        set_value(previous)
