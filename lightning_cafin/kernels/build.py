"""Build (or find in the cache) and import the extension with a checked toolchain.

A build is announced by one line on stderr with its estimated time;
``LIGHTNING_CAFIN_VERBOSE_BUILD=1`` (or the loader's ``--verbose``) shows ninja's and the
compiler's output.  Every attempt writes ``build.log`` into its cache folder: the
toolchain and time of a success, the full traceback of a failure (named in the reason).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Optional

import torch

from . import sources
from .build_cache import KEEP_ENV, build_directory, build_key, builds_to_keep, prune_superseded
from .info import ExtensionInfo
from .sources import EXTENSION_NAME
from .toolchain import Toolchain

#: Measured: 3.5 min for the six translation units on 2 cores (ninja runs one per core).
_BUILD_CORE_MINUTES = 7.0


def _estimated_minutes() -> int:
    cores = max(1, min(os.cpu_count() or 1, 6))
    return max(1, round(_BUILD_CORE_MINUTES / cores))


def _minutes(n: int) -> str:
    return "1 minute" if n == 1 else f"{n} minutes"


def verbose_requested() -> bool:
    """Whether ``LIGHTNING_CAFIN_VERBOSE_BUILD`` asks for the compiler's output (any value but 0/false/no)."""
    return os.environ.get("LIGHTNING_CAFIN_VERBOSE_BUILD", "").strip().lower() not in ("", "0", "false", "no")


def is_built(build_dir: Path) -> bool:
    """Whether ``build_dir`` holds a compiled module."""
    return any(build_dir.glob(f"{EXTENSION_NAME}*.so")) or any(build_dir.glob(f"{EXTENSION_NAME}*.pyd"))


def _announce_build(build_dir: Path, tool: Toolchain, verbose: bool) -> None:
    how = "" if verbose else "; LIGHTNING_CAFIN_VERBOSE_BUILD=1 shows the compiler's progress"
    print(
        f"building the lightning_cafin CUDA extension, about {_minutes(_estimated_minutes())}, once per "
        f"torch/CUDA version (nvcc {tool.nvcc_version} from {tool.cuda_home_source}, arch "
        f"{tool.arch_list}; into {build_dir}{how})",
        file=sys.stderr,
        flush=True,
    )


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    old = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _torch_cuda_home(cuda_home: str) -> Iterator[None]:
    """cpp_extension reads its module-level CUDA_HOME (fixed at torch import) for the
    include and library paths: point it at the checked toolkit for the build."""
    from torch.utils import cpp_extension

    old = cpp_extension.CUDA_HOME
    cpp_extension.CUDA_HOME = cuda_home
    try:
        yield
    finally:
        cpp_extension.CUDA_HOME = old


def write_log(path: Path, text: str) -> Optional[str]:
    """Write ``text`` to ``path`` (folders made); the path as a string, or None when it cannot be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return str(path)
    except OSError:
        return None


def _prune_older_builds(build_dir: Path) -> None:
    """After a build: this install's older builds beyond the newest few go (``build_cache``)."""
    try:
        removed = prune_superseded(build_dir)
    except (OSError, ValueError) as exc:  # a bad LIGHTNING_CAFIN_KEEP_BUILDS or an unreadable cache: keep everything
        print(f"lightning_cafin: older builds were kept: {exc}", file=sys.stderr, flush=True)
        return
    if removed:
        print(f"removed {len(removed)} older build(s) of this install from {build_dir.parent} "
              f"({KEEP_ENV}={builds_to_keep()} are kept besides the current one)", file=sys.stderr, flush=True)


def build_and_load(tool: Toolchain, verbose: bool) -> tuple[Optional[ModuleType], ExtensionInfo]:
    """(module, info) from the build cache, building into it first when it does not hold this build.

    Never raises except KeyboardInterrupt: a failed build or import is (None, info naming the log).
    """
    build_dir = build_directory(tool)
    log_path = build_dir / "build.log"
    started = time.monotonic()
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        (build_dir / "key.json").write_text(json.dumps(build_key(tool), indent=2) + "\n")
        building = not is_built(build_dir)
        if building:
            _announce_build(build_dir, tool, verbose)
        from torch.utils import cpp_extension

        csrc = sources.sources_dir()
        with _env(TORCH_CUDA_ARCH_LIST=tool.arch_list, CUDA_HOME=tool.cuda_home), _torch_cuda_home(tool.cuda_home):
            module = cpp_extension.load(
                name=EXTENSION_NAME,
                sources=[str(csrc / name) for name in sources.source_files()],
                extra_include_paths=[str(csrc)],
                extra_cflags=list(sources.EXTRA_CFLAGS),
                extra_cuda_cflags=list(sources.EXTRA_CUDA_CFLAGS),
                build_directory=str(build_dir),
                verbose=verbose,
                with_cuda=True,
            )
    except BaseException as exc:  # noqa: BLE001 - a failed build must not kill the caller
        if isinstance(exc, KeyboardInterrupt):
            raise
        text = (
            f"build of {EXTENSION_NAME} failed\n"
            f"torch {torch.__version__} (CUDA {torch.version.cuda}), nvcc {tool.nvcc} "
            f"(CUDA {tool.nvcc_version}), arch list {tool.arch_list} ({tool.arch_source})\n"
            f"build directory {build_dir}\n\n{traceback.format_exc()}"
        )
        log = write_log(log_path, text)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        reason = f"lightning_cafin CUDA extension failed to build or import ({first})"
        reason += f"; full output in {log}" if log else " (could not write a build log)"
        return None, ExtensionInfo(False, reason, str(build_dir), log)

    seconds = time.monotonic() - started
    if building:
        print(f"built the lightning_cafin CUDA extension in {seconds:.0f} s", file=sys.stderr, flush=True)
        _prune_older_builds(build_dir)
    text = (
        f"built/loaded {EXTENSION_NAME} from {getattr(module, '__file__', '?')}\n"
        f"torch {torch.__version__} (CUDA {torch.version.cuda}), nvcc {tool.nvcc} "
        f"(CUDA {tool.nvcc_version}, from {tool.cuda_home_source}), arch list {tool.arch_list} "
        f"({tool.arch_source})\n" + (f"built in {seconds:.0f} s\n" if building else "")
    )
    log = write_log(log_path, text)
    reason = (
        f"loaded from {build_dir} (torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"arch {tool.arch_list} from {tool.arch_source}, nvcc from {tool.cuda_home_source})"
    )
    return module, ExtensionInfo(True, reason, str(build_dir), log)
