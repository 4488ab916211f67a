"""Which implementation the capture statistics and the factor update use.

The CUDA extension's capture kernels (``csrc/capture_stats.cu``) take CUDA tensors in
float32, float16 or bfloat16; everything else (CPU tensors, float64, a missing or
unbuildable extension, non-zero conv padding modes) runs the torch ops in
``layers.py`` / ``factors.py``, which stay the reference the kernels are tested
against.

``LIGHTNING_CAFIN_CAPTURE`` (or :func:`set_impl`) picks the implementation:
``auto`` (default: the kernels where they can run), ``torch`` (always the torch ops),
``kernels`` (the kernels, raising instead of falling back when the extension is
missing; tests and profiling).  A CPU tensor never touches the extension, so a
machine without a GPU never builds it for capture.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Optional

import torch
from torch import Tensor

IMPLS = ("auto", "torch", "kernels")
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_impl = os.environ.get("LIGHTNING_CAFIN_CAPTURE", "auto").strip().lower() or "auto"
if _impl not in IMPLS:  # a typo must not silently change the maths path
    raise ValueError(f"LIGHTNING_CAFIN_CAPTURE must be one of {IMPLS}, got {_impl!r}")


def set_impl(name: str) -> str:
    """Select ``auto``, ``torch`` or ``kernels``; returns the previous choice."""
    global _impl
    name = name.strip().lower()
    if name not in IMPLS:
        raise ValueError(f"capture implementation must be one of {IMPLS}, got {name!r}")
    previous, _impl = _impl, name
    return previous


def get_impl() -> str:
    return _impl


_EXT: Optional[ModuleType] = None  # cached once loaded: the hooks ask on every call


def _extension() -> Optional[ModuleType]:
    global _EXT
    if _EXT is not None:
        return _EXT
    from ..kernels.loader import extension_info, load_extension

    info = extension_info()
    if not info.loaded:
        if _impl == "kernels":
            raise RuntimeError(f"capture kernels requested but unavailable: {info.reason}")
        return None
    ext = load_extension()
    if not hasattr(ext, "channel_stats"):  # an extension built before the capture kernels existed
        if _impl == "kernels":
            raise RuntimeError("the loaded lightning_cafin extension has no capture kernels; rebuild it")
        return None
    _EXT = ext
    return ext


def ext_for(*tensors: Tensor) -> Optional[ModuleType]:
    """The extension when the kernels should handle these tensors, else ``None``."""
    if _impl == "torch":
        return None
    for t in tensors:
        if not t.is_cuda or t.dtype not in KERNEL_DTYPES:
            return None
    return _extension()
