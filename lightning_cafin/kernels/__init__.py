"""The CUDA extension: sources in ``csrc/``, built or found by :mod:`.loader`.

Importing this package is cheap and never builds anything; the first call to
:func:`load_extension` / :func:`extension_info` does.

The modules, one job each:

* :mod:`.loader` keeps the process's one load attempt and is the command line;
* :mod:`.sources`: where ``csrc/`` is, what is compiled and hashed, with which flags;
* :mod:`.toolchain` finds and checks nvcc, ``CUDA_HOME``, ninja and the arch list
  (:mod:`.wheel_toolkit`: a toolkit from NVIDIA's pip wheels);
* :mod:`.build_cache`: the cache root and the folder of one build key;
* :mod:`.prebuilt_copy`: the copy built into the package at install time;
* :mod:`.build` builds and imports with a checked toolchain;
* :mod:`.info`: :class:`ExtensionInfo`, what a load attempt came to.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["ExtensionInfo", "can_run_fused", "extension_info", "load_extension"]

if TYPE_CHECKING:  # pragma: no cover
    from .loader import ExtensionInfo, can_run_fused, extension_info, load_extension


def __getattr__(name: str) -> Any:
    # Lazy, so that ``python -m lightning_cafin.kernels.loader`` does not import the
    # loader twice (runpy warns about that).
    if name in __all__:
        from . import loader

        return getattr(loader, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
