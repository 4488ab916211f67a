"""Find or build the ``lightning_cafin`` CUDA extension, and say clearly why not.

Where the module comes from, in order:

1. a copy built ahead of time into the installed package
   (``LIGHTNING_CAFIN_BUILD=1 pip install .``), when it matches this torch, CUDA and Python;
2. the build cache, under ``$LIGHTNING_CAFIN_BUILD_DIR`` or ``~/.cache/lightning_cafin/``,
   one folder per key: source hash (every ``csrc/*.cpp|*.cu|*.h|*.cuh``), flags, torch,
   CUDA, architecture list, compilers, Python and install location, so that two
   installs (a checkout and a pip-installed copy) never evict each other;
3. a build with ``torch.utils.cpp_extension.load`` (ninja), announced by one line on
   stderr; ``LIGHTNING_CAFIN_VERBOSE_BUILD=1`` (or ``--verbose``) shows ninja's output.

The compiler is ``CUDA_HOME``'s, else a system toolkit (torch's guess, ``/usr/local/cuda``),
else NVIDIA's pip wheels (``pip install "lightning-cafin[cuda-build]"``, see
:mod:`.wheel_toolkit`).  Before building, the toolchain is checked and the missing piece
is named (CPU-only torch, no nvcc, nvcc/torch CUDA major mismatch, no ninja).  A failed
build leaves its output in a log file named in the reason.

Ahead of time::

    python -m lightning_cafin.kernels.loader --build [--verbose]

Compiling and importing need no GPU; only running the kernels does.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Optional

import torch

from . import wheel_toolkit

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
_SOURCE_PATTERNS = ("*.cpp", "*.cu")  # compiled
_HEADER_PATTERNS = ("*.h", "*.cuh")  # hashed into the cache key
#: Files every build needs (a wheel without them cannot build).
_REQUIRED = ("bindings.cpp", "adafisher_step.cu")

#: Where a copy built ahead of time lives inside the installed package.
PREBUILT_DIR = Path(__file__).resolve().parent / "prebuilt"


def source_files(csrc: Optional[Path] = None) -> list[str]:
    """The files compiled into the extension (``csrc/*.cpp`` and ``*.cu``), sorted."""
    root = _CSRC_DIR if csrc is None else csrc
    return sorted({p.name for pattern in _SOURCE_PATTERNS for p in root.glob(pattern)})


def header_files(csrc: Optional[Path] = None) -> list[str]:
    """The headers whose contents key the build cache (``csrc/*.h`` and ``*.cuh``), sorted."""
    root = _CSRC_DIR if csrc is None else csrc
    return sorted({p.name for pattern in _HEADER_PATTERNS for p in root.glob(pattern)})

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


def _torch_cuda_major() -> str:
    return str(torch.version.cuda).split(".")[0]


def _wheel_toolkit() -> Optional[str]:
    """The toolkit root assembled from NVIDIA's pip wheels, or None when they are not installed."""
    try:
        home = wheel_toolkit.find(_torch_cuda_major(), _cache_root())
    except (OSError, ValueError):
        return None
    return str(home) if home is not None else None


def _cuda_home() -> tuple[Optional[str], str]:
    """(toolkit root or None, where it came from).

    An explicit ``CUDA_HOME`` / ``CUDA_PATH`` wins as given (its problems are then
    reported).  torch's own guess is used only when it is a real toolkit: torch
    derives it from ``which nvcc``, and a wrapper script in ``/usr/local/bin`` makes
    that ``/usr/local``.  Then ``/usr/local/cuda``; then NVIDIA's pip wheels, also when
    the system toolkit is of another CUDA major version than torch.
    """
    from torch.utils import cpp_extension

    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            return os.environ[var], var
    system: list[tuple[str, str]] = []
    guess = cpp_extension.CUDA_HOME
    if guess and _is_toolkit(guess):
        system.append((guess, "torch.utils.cpp_extension.CUDA_HOME"))
    if _DEFAULT_CUDA_HOME and _is_toolkit(_DEFAULT_CUDA_HOME):
        system.append((_DEFAULT_CUDA_HOME, _DEFAULT_CUDA_HOME))
    wheels = _wheel_toolkit() if torch.version.cuda else None
    for home, source in system:
        if wheels is None or _nvcc_major_or_none(_nvcc_path(home)) == _torch_cuda_major():
            return home, source
    if wheels is not None:
        return wheels, f"NVIDIA's pip wheels (lightning-cafin[{wheel_toolkit.EXTRA}])"
    if guess:
        return guess, "torch.utils.cpp_extension.CUDA_HOME"
    return None, "nowhere"


def _nvcc_major_or_none(nvcc: Path) -> Optional[str]:
    try:
        return _nvcc_version(nvcc).split(".")[0]
    except _Unavailable:
        return None


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
    torch_major = _torch_cuda_major()
    if not cuda_home:
        raise _Unavailable(
            "no CUDA toolkit found: CUDA_HOME is unset, no nvcc on PATH, none at "
            f"{_DEFAULT_CUDA_HOME or 'the default location'} and no NVIDIA toolkit wheels installed. "
            f"nvcc is needed to build the extension: {wheel_toolkit.install_hint(str(torch.version.cuda))} "
            f"(NVIDIA's nvcc, headers and CCCL as pip wheels, for torch's CUDA {torch.version.cuda}), "
            "or set CUDA_HOME to a toolkit"
        )
    nvcc = _nvcc_path(cuda_home)
    if not nvcc.is_file():
        raise _Unavailable(f"nvcc not found at {nvcc} (CUDA toolkit {cuda_home} from {home_source})")
    if not _is_toolkit(cuda_home):
        raise _Unavailable(
            f"{cuda_home} (from {home_source}) is not a complete CUDA toolkit: include/cuda_runtime.h is "
            "missing; set CUDA_HOME to the toolkit root (e.g. /usr/local/cuda)"
        )
    if home_source.startswith("NVIDIA's pip wheels"):
        missing_wheels = wheel_toolkit.missing_pieces(Path(cuda_home))
        if missing_wheels:
            raise _Unavailable(
                f"NVIDIA's toolkit wheels provide nvcc but not: {', '.join(missing_wheels)}; "
                f"{wheel_toolkit.install_hint(str(torch.version.cuda))}"
            )
    nvcc_version = _nvcc_version(nvcc)
    if nvcc_version.split(".")[0] != torch_major:
        raise _Unavailable(
            f"CUDA version mismatch: nvcc at {nvcc} is CUDA {nvcc_version} but torch "
            f"{torch.__version__} was built with CUDA {torch.version.cuda}; point CUDA_HOME at a "
            f"CUDA {torch_major}.x toolkit, or unset it and {wheel_toolkit.install_hint(str(torch.version.cuda))}"
        )
    if not _ninja_available():
        raise _Unavailable("ninja is not installed or not on PATH (pip install ninja)")
    missing = [name for name in _REQUIRED if not (_CSRC_DIR / name).is_file()]
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
        "host_compiler": _host_compiler(),
    }


def _host_compiler() -> str:
    """The C++ compiler cpp_extension will call (``$CXX`` or ``c++``) and its version line."""
    cxx = os.environ.get("CXX", "c++")
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return cxx
    first = out.strip().splitlines()[0] if out.strip() else ""
    return f"{cxx}: {first}"


# ---------------------------------------------------------------------------
# Build directory
# ---------------------------------------------------------------------------


def _cache_root() -> Path:
    env = os.environ.get("LIGHTNING_CAFIN_BUILD_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "lightning_cafin"


def source_hash(csrc: Optional[Path] = None) -> str:
    """sha256 of every source and header in ``csrc`` (names and contents) and the compiler flags."""
    root = _CSRC_DIR if csrc is None else csrc
    digest = hashlib.sha256()
    for name in source_files(root) + header_files(root):
        digest.update(name.encode() + b"\0")
        digest.update((root / name).read_bytes())
    digest.update(repr((_EXTRA_CFLAGS, _EXTRA_CUDA_CFLAGS)).encode())
    return digest.hexdigest()


def _install_location() -> str:
    """Which copy of the package this is: its folder and the interpreter environment."""
    return f"{Path(__file__).resolve().parent.parent}|{sys.prefix}"


def build_key(tool: dict) -> dict:
    """Everything that makes one build differ from another (the cache folder is its hash)."""
    return {
        "source": source_hash(),
        "torch": torch.__version__,
        "torch_cuda": str(torch.version.cuda),
        "nvcc": f"{tool['nvcc_version']} {tool['cuda_home']}",
        "arch": tool["arch_list"],
        "host_compiler": tool.get("host_compiler", ""),
        "python": f"{sys.implementation.cache_tag} {sys.version.split()[0]}",
        "install": _install_location(),
    }


def _build_dir(tool: dict) -> Path:
    key = build_key(tool)
    torch_tag = re.sub(r"[^A-Za-z0-9_.]", "_", torch.__version__)
    cuda_tag = "cu" + str(torch.version.cuda).replace(".", "")
    nvcc_tag = "nvcc" + tool["nvcc_version"].replace(".", "")
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    name = f"torch{torch_tag}-{cuda_tag}-{nvcc_tag}-{sys.implementation.cache_tag}-{digest}"
    return _cache_root() / name


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
# A copy built ahead of time into the package
# ---------------------------------------------------------------------------


def _runtime_key() -> dict:
    """What a prebuilt copy must match to be loaded here (the toolchain no longer matters)."""
    return {
        "source": source_hash(),
        "torch": torch.__version__,
        "torch_cuda": str(torch.version.cuda),
        "python": sys.implementation.cache_tag,
    }


def _arch_covers(arch_list: str) -> bool:
    """Whether code built for ``arch_list`` runs on every visible GPU (True without a GPU)."""
    try:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        count = 0
    built = [a.strip() for a in arch_list.replace(",", ";").split(";") if a.strip()]
    for i in range(count):
        major, minor = torch.cuda.get_device_capability(i)
        cap = f"{major}.{minor}"
        same = any(a.split("+")[0] == cap for a in built)
        ptx_below = any(a.endswith("+PTX") and float(a.split("+")[0]) <= float(cap) for a in built)
        if not (same or ptx_below):
            return False
    return True


def _import_from(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(EXTENSION_NAME, str(path))
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _prebuilt() -> Optional[tuple[ModuleType, ExtensionInfo]]:
    """The copy ``LIGHTNING_CAFIN_BUILD=1 pip install .`` put into the package, when it fits."""
    meta_path = PREBUILT_DIR / "build.json"
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
        if meta.get("runtime_key") != _runtime_key() or not _arch_covers(meta.get("arch", "")):
            return None
        module = _import_from(PREBUILT_DIR / meta["file"])
    except Exception:  # a stale or broken copy: build as if it were not there
        return None
    reason = (f"loaded the copy built at install time from {PREBUILT_DIR} (torch {torch.__version__}, "
              f"CUDA {torch.version.cuda}, arch {meta.get('arch')})")
    return module, ExtensionInfo(True, reason, str(PREBUILT_DIR), None)


def _write_prebuilt(module: ModuleType, tool: dict, output: Path) -> Path:
    """Copy the built module to ``output`` with the key :func:`_prebuilt` checks."""
    output.mkdir(parents=True, exist_ok=True)
    source = Path(module.__file__ or "")
    shutil.copy2(source, output / source.name)
    meta = {"runtime_key": _runtime_key(), "arch": tool["arch_list"], "file": source.name,
            "built_with": build_key(tool)}
    (output / "build.json").write_text(json.dumps(meta, indent=2) + "\n")
    return output / source.name


# ---------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------

#: Measured: 3.5 min for the six translation units on 2 cores (ninja runs one per core).
_BUILD_CORE_MINUTES = 7.0


def _estimated_minutes() -> int:
    cores = max(1, min(os.cpu_count() or 1, 6))
    return max(1, round(_BUILD_CORE_MINUTES / cores))


def _minutes(n: int) -> str:
    return "1 minute" if n == 1 else f"{n} minutes"


def _verbose_requested() -> bool:
    return os.environ.get("LIGHTNING_CAFIN_VERBOSE_BUILD", "").strip().lower() not in ("", "0", "false", "no")


def _is_built(build_dir: Path) -> bool:
    return any(build_dir.glob(f"{EXTENSION_NAME}*.so")) or any(build_dir.glob(f"{EXTENSION_NAME}*.pyd"))


def _announce_build(build_dir: Path, tool: dict, verbose: bool) -> None:
    how = "" if verbose else "; LIGHTNING_CAFIN_VERBOSE_BUILD=1 shows the compiler's progress"
    print(
        f"building the lightning_cafin CUDA extension, about {_minutes(_estimated_minutes())}, once per "
        f"torch/CUDA version (nvcc {tool['nvcc_version']} from {tool['cuda_home_source']}, arch "
        f"{tool['arch_list']}; into {build_dir}{how})",
        file=sys.stderr,
        flush=True,
    )


def _load(verbose: bool) -> tuple[Optional[ModuleType], ExtensionInfo]:
    verbose = verbose or _verbose_requested()
    prebuilt = _prebuilt()
    if prebuilt is not None:
        return prebuilt
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
    started = time.monotonic()
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        (build_dir / "key.json").write_text(json.dumps(build_key(tool), indent=2) + "\n")
        building = not _is_built(build_dir)
        if building:
            _announce_build(build_dir, tool, verbose)
        from torch.utils import cpp_extension

        with _env(TORCH_CUDA_ARCH_LIST=tool["arch_list"], CUDA_HOME=tool["cuda_home"]), _torch_cuda_home(
            tool["cuda_home"]
        ):
            module = cpp_extension.load(
                name=EXTENSION_NAME,
                sources=[str(_CSRC_DIR / name) for name in source_files()],
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

    seconds = time.monotonic() - started
    if building:
        print(f"built the lightning_cafin CUDA extension in {seconds:.0f} s", file=sys.stderr, flush=True)
    text = (
        f"built/loaded {EXTENSION_NAME} from {getattr(module, '__file__', '?')}\n"
        f"torch {torch.__version__} (CUDA {torch.version.cuda}), nvcc {tool['nvcc']} "
        f"(CUDA {tool['nvcc_version']}, from {tool['cuda_home_source']}), arch list {tool['arch_list']} "
        f"({tool['arch_source']})\n" + (f"built in {seconds:.0f} s\n" if building else "")
    )
    log = _write_log(log_path, text)
    reason = (
        f"loaded from {build_dir} (torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"arch {tool['arch_list']} from {tool['arch_source']}, nvcc from {tool['cuda_home_source']})"
    )
    global _tool
    _tool = tool
    return module, ExtensionInfo(True, reason, str(build_dir), log)


_tool: Optional[dict] = None  # the toolchain of the last build in this process (for --output)


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
                print(f"copied to {_write_prebuilt(_module, _tool, args.output)}")
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
