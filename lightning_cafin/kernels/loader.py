"""Find or build the ``lightning_cafin`` CUDA extension, once per process, and say clearly why not.

Where the module comes from, in order:

1. a copy built ahead of time into the installed package
   (``LIGHTNING_CAFIN_BUILD=1 pip install .``), when it matches this torch, CUDA and Python
   (:mod:`.prebuilt_copy`);
2. the build cache, under ``$LIGHTNING_CAFIN_BUILD_DIR`` or ``~/.cache/lightning_cafin/``,
   one folder per key: source hash (every ``csrc/*.cpp|*.cu|*.h|*.cuh``), flags, torch,
   CUDA, architecture list, compilers, Python and install location, so that two
   installs (a checkout and a pip-installed copy) never evict each other
   (:mod:`.build_cache`, :mod:`.sources`);
3. a build with ``torch.utils.cpp_extension.load`` (ninja), announced by one line on
   stderr; ``LIGHTNING_CAFIN_VERBOSE_BUILD=1`` (or ``--verbose``) shows ninja's output
   (:mod:`.build`).

The compiler is ``CUDA_HOME``'s, else a system toolkit (torch's guess, ``/usr/local/cuda``),
else NVIDIA's pip wheels (``pip install "lightning-cafin[cuda-build]"``, see
:mod:`.wheel_toolkit`).  Before building, the toolchain is checked and the missing piece
is named (CPU-only torch, no nvcc, nvcc/torch CUDA major mismatch, no ninja: see
:mod:`.toolchain`).  A failed build leaves its output in a log file named in the reason.

This module keeps the process's one load attempt and is the command line; ahead of time::

    python -m lightning_cafin.kernels.loader --build [--verbose]

Compiling and importing need no GPU; only running the kernels does.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import traceback
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Optional

import torch

from . import build, prebuilt_copy, toolchain
# Also offered here, as before the loader was split; they live (and are patched) in their modules.
from .build_cache import build_directory, build_key, cache_root
from .info import ExtensionInfo
from .prebuilt_copy import PREBUILT_DIR
from .sources import EXTENSION_NAME, header_files, source_files, source_hash
from .toolchain import DEFAULT_ARCH_LIST, Toolchain

__all__ = [
    "DEFAULT_ARCH_LIST", "EXTENSION_NAME", "PREBUILT_DIR", "ExtensionInfo", "build_key", "can_run_fused",
    "extension_if_built", "extension_info", "extension_or_none", "fresh_load_attempt", "header_files",
    "load_attempted", "load_extension", "main", "source_files", "source_hash",
]

_lock = threading.Lock()
_module: Optional[ModuleType] = None
_info: Optional[ExtensionInfo] = None
_tool: Optional[Toolchain] = None  # the toolchain of the last build in this process (for --output)


def _load(verbose: bool) -> tuple[Optional[ModuleType], ExtensionInfo]:
    global _tool
    verbose = verbose or build.verbose_requested()
    prebuilt = prebuilt_copy.find_prebuilt()
    if prebuilt is not None:
        return prebuilt
    try:
        tool = toolchain.check()
    except toolchain.ToolchainUnavailable as exc:
        reason = f"lightning_cafin CUDA extension unavailable: {exc}"
        return None, ExtensionInfo(False, reason, None, None)
    except Exception as exc:  # never raise out of extension_info()
        text = traceback.format_exc()
        log = build.write_log(cache_root() / "last_check_failure.log", text)
        reason = f"lightning_cafin CUDA extension unavailable: toolchain check failed ({exc!r})"
        if log:
            reason += f"; see {log}"
        return None, ExtensionInfo(False, reason, None, log)
    module, info = build.build_and_load(tool, verbose)
    if module is not None:
        _tool = tool
    return module, info


def _ensure(verbose: bool = False) -> ExtensionInfo:
    global _module, _info
    with _lock:
        if _info is None:
            _module, _info = _load(verbose)
        return _info


def extension_info() -> ExtensionInfo:
    """Try to load (building if needed) once per process; never raises."""
    try:
        return _ensure()
    except Exception as exc:  # pragma: no cover - _load already catches everything
        return ExtensionInfo(False, f"lightning_cafin CUDA extension unavailable: {exc!r}")


def load_extension() -> ModuleType:
    """The compiled module, or ``RuntimeError(reason)``."""
    info = extension_info()
    if not info.loaded or _module is None:
        raise RuntimeError(info.reason)
    return _module


def extension_or_none() -> Optional[ModuleType]:
    """The compiled module, or None when it cannot be had (:func:`extension_info` says why).

    The one accessor the rest of the package uses: the first call loads (or builds),
    later calls return the same module without any work.
    """
    info = extension_info()
    return _module if info.loaded else None


def extension_if_built() -> Optional[ModuleType]:
    """The compiled module when it can be had without compiling (a fitting copy built at
    install time, or this build already in the cache), else None; never builds.

    For what runs the extension's CPU paths without a GPU (tests of the C++ gradient taps):
    a process that needs the module anyway uses :func:`extension_or_none`.
    """
    if _info is None and prebuilt_copy.find_prebuilt() is None:
        try:
            tool = toolchain.check()
        except Exception:  # noqa: BLE001 - no toolchain: nothing could have been built with it
            return None
        if not build.is_built(build_directory(tool)):
            return None
    return extension_or_none()


def can_run_fused() -> tuple[bool, str]:
    """(True, reason) when a CUDA device is usable and the extension is loaded.

    The device is checked first, so a machine without a GPU never pays for a build.
    """
    try:
        available = torch.cuda.is_available()
    except Exception as exc:  # pragma: no cover
        return False, f"torch.cuda.is_available() failed: {exc!r}"
    if not available:
        why = "torch is a CPU-only build" if torch.version.cuda is None else "no CUDA device is visible"
        return False, f"{why} (the fused step needs a GPU)"
    info = extension_info()
    if not info.loaded:
        return False, info.reason
    return True, info.reason


def load_attempted() -> bool:
    """Whether this process has tried to load the extension yet (importing never does)."""
    return _info is not None


@contextlib.contextmanager
def fresh_load_attempt() -> Iterator[None]:
    """Inside the block the process has made no load attempt: the next call tries again.

    For tests and tools that vary the toolchain or environment; on exit the earlier
    attempt (and its module) is back.  A compiled module imported inside stays imported.
    """
    global _module, _info, _tool
    with _lock:
        saved = (_module, _info, _tool)
        _module, _info, _tool = None, None, None
    try:
        yield
    finally:
        with _lock:
            _module, _info, _tool = saved


def main(argv: Optional[list[str]] = None) -> int:
    """The command line (``python -m lightning_cafin.kernels.loader``); 0 when the extension loaded."""
    parser = argparse.ArgumentParser(
        prog="python -m lightning_cafin.kernels.loader",
        description="Build (or find) the lightning_cafin CUDA extension and report on it.",
    )
    parser.add_argument("--build", action="store_true",
                        help="build ahead of time (a no-op when the cache already holds this build)")
    parser.add_argument("--verbose", action="store_true",
                        help="show ninja's and the compiler's output (also LIGHTNING_CAFIN_VERBOSE_BUILD=1)")
    parser.add_argument("--output", type=Path, default=None,
                        help="also copy the built module into this folder with its key (setup.py's "
                             "LIGHTNING_CAFIN_BUILD=1 puts it into the package)")
    args = parser.parse_args(argv)
    info = _ensure(verbose=args.verbose)
    print(info)
    if info.loaded and _module is not None:
        print(f"module: {getattr(_module, '__file__', '?')}")
        ok, why = can_run_fused()
        print(f"can_run_fused: {ok} ({why})")
        if args.output is not None:
            if _tool is None:
                print("--output: the module came from a prebuilt copy, nothing to write", file=sys.stderr)
            else:
                print(f"copied to {prebuilt_copy.write_prebuilt(_module, _tool, args.output)}")
    if not info.loaded and info.log_path:
        try:
            sys.stderr.write(Path(info.log_path).read_text()[-20000:])
        except OSError:
            pass
    return 0 if info.loaded else 1


if __name__ == "__main__":
    # Run the package's copy of this module so that the CLI and library share one cache.
    from lightning_cafin.kernels import loader as _loader

    sys.exit(_loader.main())
