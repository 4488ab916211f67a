"""Find or build the ``lightning_cafin`` CUDA extension, and say clearly why not.

The extension is compiled on first use with ``torch.utils.cpp_extension.load``
(ninja) into a build directory cached per torch version, CUDA version, source hash,
compiler flags and architecture list, under ``$LIGHTNING_CAFIN_BUILD_DIR`` or
``~/.cache/lightning_cafin/``.  Before building, the toolchain is checked and the
missing piece is named (CPU-only torch, no nvcc, nvcc/torch CUDA major mismatch,
no ninja).  A failed build leaves its output in a log file named in the reason.

Ahead of time::

    CUDA_HOME=/usr/local/cuda TORCH_CUDA_ARCH_LIST=9.0 \\
        python -m lightning_cafin.kernels.loader --build

Compiling and importing need no GPU; only running the kernels does.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import re
import shutil
import subprocess
import sys
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Optional

import torch

EXTENSION_NAME = "lightning_cafin_C"
_DEFAULT_CUDA_HOME = None if os.name == "nt" else "/usr/local/cuda"
DEFAULT_ARCH_LIST = "9.0"

def _find_csrc() -> Path:
    """``lightning_cafin/csrc`` when shipped as package data, else the repository's ``csrc``."""
    package_dir = Path(__file__).resolve().parent.parent
    for candidate in (package_dir / "csrc", package_dir.parent / "csrc"):
        if (candidate / "adafisher_step.cu").is_file():
            return candidate
    return package_dir.parent / "csrc"


_CSRC_DIR = _find_csrc()
_SOURCES = (
    "bindings.cpp", "adafisher_step_op.cpp", "adafisher_step.cu", "capture_ops.cpp", "capture_stats.cu",
    "side_stream.cpp",
)
_HEADERS = (
    "adafisher_step.h", "step_launch.h", "capture_ops.h", "capture_launch.h", "vector_io.cuh", "side_stream.h",
    "checks.h", "multi_tensor_launch.cuh", "dtype_dispatch.cuh",
)

# Plain -O3: never --use_fast_math (it replaces IEEE division, and the fused step
# must round like the unfused reference).
_EXTRA_CFLAGS = ["-O3"]
_EXTRA_CUDA_CFLAGS = ["-O3", "-lineinfo"]

_FORBIDDEN_CUDA_FLAGS = ("--use_fast_math", "-use_fast_math", "--prec-div=false", "-prec-div=false")


@dataclass(frozen=True)
class ExtensionInfo:
    """Whether the extension is usable in this process, and if not, why."""

    loaded: bool
    reason: str
    build_dir: Optional[str] = None
    log_path: Optional[str] = None


_lock = threading.Lock()
_module: Optional[ModuleType] = None
_info: Optional[ExtensionInfo] = None


class _Unavailable(Exception):
    """A precondition of the build is missing; the message names it."""


# ---------------------------------------------------------------------------
# Toolchain checks
# ---------------------------------------------------------------------------


def _is_toolkit(home: str) -> bool:
    """A CUDA toolkit root: nvcc plus the runtime headers (a bare ``nvcc`` wrapper is not)."""
    root = Path(home)
    return _nvcc_path(home).is_file() and (
        (root / "include" / "cuda_runtime.h").is_file()
        or any(root.glob("targets/*/include/cuda_runtime.h"))
    )


def _cuda_home() -> tuple[Optional[str], str]:
    """(toolkit root or None, where it came from).

    An explicit ``CUDA_HOME`` / ``CUDA_PATH`` wins as given (its problems are then
    reported).  torch's own guess is used only when it is a real toolkit: torch
    derives it from ``which nvcc``, and a wrapper script in ``/usr/local/bin`` makes
    that ``/usr/local``.  ``/usr/local/cuda`` is the last resort.
    """
    from torch.utils import cpp_extension

    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            return os.environ[var], var
    guess = cpp_extension.CUDA_HOME
    if guess and _is_toolkit(guess):
        return guess, "torch.utils.cpp_extension.CUDA_HOME"
    if _DEFAULT_CUDA_HOME and _is_toolkit(_DEFAULT_CUDA_HOME):
        return _DEFAULT_CUDA_HOME, _DEFAULT_CUDA_HOME
    if guess:
        return guess, "torch.utils.cpp_extension.CUDA_HOME"
    return None, "nowhere"


def _nvcc_path(cuda_home: str) -> Path:
    return Path(cuda_home) / "bin" / ("nvcc.exe" if os.name == "nt" else "nvcc")


def _nvcc_version(nvcc: Path) -> str:
    """``"13.0"`` from ``nvcc --version``; raises _Unavailable when it cannot run."""
    try:
        out = subprocess.run(
            [str(nvcc), "--version"], capture_output=True, text=True, timeout=60, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise _Unavailable(f"cannot run {nvcc} --version: {exc}") from exc
    match = re.search(r"release (\d+)\.(\d+)", out)
    if match is None:
        raise _Unavailable(f"cannot parse the CUDA version from `{nvcc} --version`: {out.strip()!r}")
    return f"{match.group(1)}.{match.group(2)}"


def _ninja_available() -> bool:
    try:
        subprocess.run(["ninja", "--version"], capture_output=True, timeout=60, check=True)
    except (OSError, subprocess.SubprocessError):
        return False
    return True


def _arch_list() -> tuple[str, str]:
    """(arch list, where it came from): TORCH_CUDA_ARCH_LIST, the visible GPUs, or 9.0."""
    env = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if env and env != "native":
        return env, "TORCH_CUDA_ARCH_LIST"
    try:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken driver must not stop a CPU-side build
        count = 0
    if count > 0:
        caps = sorted({torch.cuda.get_device_capability(i) for i in range(count)})
        return ";".join(f"{major}.{minor}" for major, minor in caps), "visible GPUs"
    return DEFAULT_ARCH_LIST, "default (no GPU visible, TORCH_CUDA_ARCH_LIST unset)"


def _check_toolchain() -> dict:
    """Everything the build needs; raises _Unavailable naming the first missing piece."""
    if getattr(torch.version, "hip", None):
        raise _Unavailable(
            f"torch {torch.__version__} is a ROCm/HIP build; the extension is CUDA-only"
        )
    if torch.version.cuda is None:
        raise _Unavailable(
            f"torch {torch.__version__} is a CPU-only build (torch.version.cuda is None); "
            "install a CUDA build of torch to use the fused kernels"
        )
    cuda_home, home_source = _cuda_home()
    if not cuda_home:
        raise _Unavailable(
            "no CUDA toolkit found: CUDA_HOME is unset and torch.utils.cpp_extension.CUDA_HOME "
            "is None (nvcc is needed to build the extension; set CUDA_HOME)"
        )
    nvcc = _nvcc_path(cuda_home)
    if not nvcc.is_file():
        raise _Unavailable(f"nvcc not found at {nvcc} (CUDA toolkit {cuda_home} from {home_source})")
    if not _is_toolkit(cuda_home):
        raise _Unavailable(
            f"{cuda_home} (from {home_source}) is not a complete CUDA toolkit: include/cuda_runtime.h is "
            "missing; set CUDA_HOME to the toolkit root (e.g. /usr/local/cuda)"
        )
    nvcc_version = _nvcc_version(nvcc)
    torch_major = torch.version.cuda.split(".")[0]
    if nvcc_version.split(".")[0] != torch_major:
        raise _Unavailable(
            f"CUDA version mismatch: nvcc at {nvcc} is CUDA {nvcc_version} but torch "
            f"{torch.__version__} was built with CUDA {torch.version.cuda}; point CUDA_HOME at a "
            f"CUDA {torch_major}.x toolkit"
        )
    if not _ninja_available():
        raise _Unavailable("ninja is not installed or not on PATH (pip install ninja)")
    missing = [name for name in _SOURCES + _HEADERS if not (_CSRC_DIR / name).is_file()]
    if missing:
        raise _Unavailable(f"extension sources missing from {_CSRC_DIR}: {', '.join(missing)}")
    for flag in _EXTRA_CUDA_CFLAGS:
        if flag in _FORBIDDEN_CUDA_FLAGS:  # pragma: no cover - a guard against edits
            raise _Unavailable(f"forbidden nvcc flag {flag}: the step needs IEEE division")
    arch_list, arch_source = _arch_list()
    return {
        "cuda_home": cuda_home,
        "cuda_home_source": home_source,
        "nvcc": str(nvcc),
        "nvcc_version": nvcc_version,
        "arch_list": arch_list,
        "arch_source": arch_source,
    }


# ---------------------------------------------------------------------------
# Build directory
# ---------------------------------------------------------------------------


def _cache_root() -> Path:
    env = os.environ.get("LIGHTNING_CAFIN_BUILD_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "lightning_cafin"


def _source_hash(arch_list: str, cuda_home: str) -> str:
    digest = hashlib.sha256()
    for name in _SOURCES + _HEADERS:
        digest.update(name.encode())
        digest.update((_CSRC_DIR / name).read_bytes())
    digest.update(repr((_EXTRA_CFLAGS, _EXTRA_CUDA_CFLAGS, arch_list, cuda_home)).encode())
    return digest.hexdigest()[:16]


def _build_dir(tool: dict) -> Path:
    torch_tag = re.sub(r"[^A-Za-z0-9_.]", "_", torch.__version__)
    cuda_tag = "cu" + str(torch.version.cuda).replace(".", "")
    nvcc_tag = "nvcc" + tool["nvcc_version"].replace(".", "")
    return _cache_root() / f"torch{torch_tag}-{cuda_tag}-{nvcc_tag}-{_source_hash(tool['arch_list'], tool['cuda_home'])}"


@contextlib.contextmanager
def _env(**values: str):
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
def _torch_cuda_home(cuda_home: str):
    """cpp_extension reads its module-level CUDA_HOME (fixed at torch import) for the
    include and library paths: point it at the checked toolkit for the build."""
    from torch.utils import cpp_extension

    old = cpp_extension.CUDA_HOME
    cpp_extension.CUDA_HOME = cuda_home
    try:
        yield
    finally:
        cpp_extension.CUDA_HOME = old


def _write_log(path: Path, text: str) -> Optional[str]:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return str(path)
    except OSError:
        return None


# ---------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------


def _load(verbose: bool) -> tuple[Optional[ModuleType], ExtensionInfo]:
    try:
        tool = _check_toolchain()
    except _Unavailable as exc:
        reason = f"lightning_cafin CUDA extension unavailable: {exc}"
        return None, ExtensionInfo(False, reason, None, None)
    except Exception as exc:  # never raise out of extension_info()
        text = traceback.format_exc()
        log = _write_log(_cache_root() / "last_check_failure.log", text)
        reason = f"lightning_cafin CUDA extension unavailable: toolchain check failed ({exc!r})"
        if log:
            reason += f"; see {log}"
        return None, ExtensionInfo(False, reason, None, log)

    build_dir = _build_dir(tool)
    log_path = build_dir / "build.log"
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        from torch.utils import cpp_extension

        with _env(TORCH_CUDA_ARCH_LIST=tool["arch_list"], CUDA_HOME=tool["cuda_home"]), _torch_cuda_home(
            tool["cuda_home"]
        ):
            module = cpp_extension.load(
                name=EXTENSION_NAME,
                sources=[str(_CSRC_DIR / name) for name in _SOURCES],
                extra_include_paths=[str(_CSRC_DIR)],
                extra_cflags=list(_EXTRA_CFLAGS),
                extra_cuda_cflags=list(_EXTRA_CUDA_CFLAGS),
                build_directory=str(build_dir),
                verbose=verbose,
                with_cuda=True,
            )
    except BaseException as exc:  # noqa: BLE001 - a failed build must not kill the caller
        if isinstance(exc, KeyboardInterrupt):
            raise
        text = (
            f"build of {EXTENSION_NAME} failed\n"
            f"torch {torch.__version__} (CUDA {torch.version.cuda}), nvcc {tool['nvcc']} "
            f"(CUDA {tool['nvcc_version']}), arch list {tool['arch_list']} ({tool['arch_source']})\n"
            f"build directory {build_dir}\n\n{traceback.format_exc()}"
        )
        log = _write_log(log_path, text)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        reason = f"lightning_cafin CUDA extension failed to build or import ({first})"
        reason += f"; full output in {log}" if log else " (could not write a build log)"
        return None, ExtensionInfo(False, reason, str(build_dir), log)

    text = (
        f"built/loaded {EXTENSION_NAME} from {getattr(module, '__file__', '?')}\n"
        f"torch {torch.__version__} (CUDA {torch.version.cuda}), nvcc {tool['nvcc']} "
        f"(CUDA {tool['nvcc_version']}), arch list {tool['arch_list']} ({tool['arch_source']})\n"
    )
    log = _write_log(log_path, text)
    reason = (
        f"loaded from {build_dir} (torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"arch {tool['arch_list']} from {tool['arch_source']})"
    )
    return module, ExtensionInfo(True, reason, str(build_dir), log)


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


def _reset_for_tests() -> None:
    """Forget the cached load attempt (tests only; a loaded .so stays loaded)."""
    global _module, _info
    with _lock:
        _module, _info = None, None


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_cafin.kernels.loader",
        description="Build (or find) the lightning_cafin CUDA extension and report on it.",
    )
    parser.add_argument("--build", action="store_true", help="build ahead of time (verbose)")
    args = parser.parse_args(argv)
    info = _ensure(verbose=args.build)
    print(info)
    if info.loaded and _module is not None:
        print(f"module: {_module.__file__}")
        ok, why = can_run_fused()
        print(f"can_run_fused: {ok} ({why})")
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
