"""The toolchain a build needs, found and checked before anything is compiled.

The compiler is ``CUDA_HOME``'s, else a system toolkit (torch's guess, ``/usr/local/cuda``),
else NVIDIA's pip wheels (``pip install "lightning-cafin[cuda-build]"``, see
:mod:`.wheel_toolkit`).  :func:`check` names the first missing piece (CPU-only or ROCm
torch, no toolkit, no nvcc, an incomplete toolkit, nvcc/torch CUDA major mismatch, no
ninja, missing sources) in a :class:`ToolchainUnavailable`, and otherwise describes the
toolchain as a :class:`Toolchain`.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from . import sources, wheel_toolkit
from .build_cache import cache_root

#: The system toolkit tried after ``CUDA_HOME`` and torch's guess (read on each call).
DEFAULT_CUDA_HOME: Optional[str] = None if os.name == "nt" else "/usr/local/cuda"
#: What the kernels are built for when neither ``TORCH_CUDA_ARCH_LIST`` nor a GPU says (Hopper).
DEFAULT_ARCH_LIST = "9.0"


class ToolchainUnavailable(Exception):
    """A precondition of the build is missing; the message names it and the fix."""


@dataclass(frozen=True)
class Toolchain:
    """What a build runs with, and where each piece came from (for the messages)."""

    cuda_home: str
    cuda_home_source: str
    nvcc: str
    nvcc_version: str  # "13.0"
    arch_list: str  # TORCH_CUDA_ARCH_LIST syntax, "8.0;9.0+PTX"
    arch_source: str
    host_compiler: str = ""  # "c++: c++ (GCC) 13.2.0"


def _is_toolkit(home: str) -> bool:
    """A CUDA toolkit root: nvcc plus the runtime headers (a bare ``nvcc`` wrapper is not)."""
    root = Path(home)
    return nvcc_path(home).is_file() and (
        (root / "include" / "cuda_runtime.h").is_file()
        or any(root.glob("targets/*/include/cuda_runtime.h"))
    )


def _torch_cuda_major() -> str:
    return str(torch.version.cuda).split(".")[0]


def _wheel_toolkit() -> Optional[str]:
    """The toolkit root assembled from NVIDIA's pip wheels, or None when they are not installed."""
    try:
        home = wheel_toolkit.find(_torch_cuda_major(), cache_root())
    except (OSError, ValueError):
        return None
    return str(home) if home is not None else None


def find_cuda_home() -> tuple[Optional[str], str]:
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
    if DEFAULT_CUDA_HOME and _is_toolkit(DEFAULT_CUDA_HOME):
        system.append((DEFAULT_CUDA_HOME, DEFAULT_CUDA_HOME))
    wheels = _wheel_toolkit() if torch.version.cuda else None
    for home, source in system:
        if wheels is None or _nvcc_major_or_none(nvcc_path(home)) == _torch_cuda_major():
            return home, source
    if wheels is not None:
        return wheels, f"NVIDIA's pip wheels (lightning-cafin[{wheel_toolkit.EXTRA}])"
    if guess:
        return guess, "torch.utils.cpp_extension.CUDA_HOME"
    return None, "nowhere"


def _nvcc_major_or_none(nvcc: Path) -> Optional[str]:
    try:
        return nvcc_version(nvcc).split(".")[0]
    except ToolchainUnavailable:
        return None


def nvcc_path(cuda_home: str) -> Path:
    """Where a toolkit rooted at ``cuda_home`` keeps nvcc (whether or not it is there)."""
    return Path(cuda_home) / "bin" / ("nvcc.exe" if os.name == "nt" else "nvcc")


def nvcc_version(nvcc: Path) -> str:
    """``"13.0"`` from ``nvcc --version``; raises ToolchainUnavailable when it cannot run."""
    try:
        out = subprocess.run(
            [str(nvcc), "--version"], capture_output=True, text=True, timeout=60, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise ToolchainUnavailable(f"cannot run {nvcc} --version: {exc}") from exc
    match = re.search(r"release (\d+)\.(\d+)", out)
    if match is None:
        raise ToolchainUnavailable(f"cannot parse the CUDA version from `{nvcc} --version`: {out.strip()!r}")
    return f"{match.group(1)}.{match.group(2)}"


def ninja_available() -> bool:
    """Whether ``ninja --version`` runs (cpp_extension builds only with ninja)."""
    try:
        subprocess.run(["ninja", "--version"], capture_output=True, timeout=60, check=True)
    except (OSError, subprocess.SubprocessError):
        return False
    return True


def visible_capabilities() -> list[tuple[int, int]]:
    """(major, minor) compute capability of each visible GPU; [] without one."""
    try:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken driver must not stop a CPU-side build
        count = 0
    return [torch.cuda.get_device_capability(i) for i in range(count)]


def arch_list() -> tuple[str, str]:
    """(arch list, where it came from): TORCH_CUDA_ARCH_LIST, the visible GPUs, or 9.0."""
    env = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if env and env != "native":
        return env, "TORCH_CUDA_ARCH_LIST"
    caps = sorted(set(visible_capabilities()))
    if caps:
        return ";".join(f"{major}.{minor}" for major, minor in caps), "visible GPUs"
    return DEFAULT_ARCH_LIST, "default (no GPU visible, TORCH_CUDA_ARCH_LIST unset)"


def host_compiler() -> str:
    """The C++ compiler cpp_extension will call (``$CXX`` or ``c++``) and its version line."""
    cxx = os.environ.get("CXX", "c++")
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return cxx
    first = out.strip().splitlines()[0] if out.strip() else ""
    return f"{cxx}: {first}"


def check() -> Toolchain:
    """Everything the build needs; raises ToolchainUnavailable naming the first missing piece."""
    if getattr(torch.version, "hip", None):
        raise ToolchainUnavailable(
            f"torch {torch.__version__} is a ROCm/HIP build; the extension is CUDA-only"
        )
    if torch.version.cuda is None:
        raise ToolchainUnavailable(
            f"torch {torch.__version__} is a CPU-only build (torch.version.cuda is None); "
            "install a CUDA build of torch to use the fused kernels"
        )
    cuda_home, home_source = find_cuda_home()
    torch_major = _torch_cuda_major()
    if not cuda_home:
        raise ToolchainUnavailable(
            "no CUDA toolkit found: CUDA_HOME is unset, no nvcc on PATH, none at "
            f"{DEFAULT_CUDA_HOME or 'the default location'} and no NVIDIA toolkit wheels installed. "
            f"nvcc is needed to build the extension: {wheel_toolkit.install_hint(str(torch.version.cuda))} "
            f"(NVIDIA's nvcc, headers and CCCL as pip wheels, for torch's CUDA {torch.version.cuda}), "
            "or set CUDA_HOME to a toolkit"
        )
    nvcc = nvcc_path(cuda_home)
    if not nvcc.is_file():
        raise ToolchainUnavailable(f"nvcc not found at {nvcc} (CUDA toolkit {cuda_home} from {home_source})")
    if not _is_toolkit(cuda_home):
        raise ToolchainUnavailable(
            f"{cuda_home} (from {home_source}) is not a complete CUDA toolkit: include/cuda_runtime.h is "
            "missing; set CUDA_HOME to the toolkit root (e.g. /usr/local/cuda)"
        )
    if home_source.startswith("NVIDIA's pip wheels"):
        missing_wheels = wheel_toolkit.missing_pieces(Path(cuda_home))
        if missing_wheels:
            raise ToolchainUnavailable(
                f"NVIDIA's toolkit wheels provide nvcc but not: {', '.join(missing_wheels)}; "
                f"{wheel_toolkit.install_hint(str(torch.version.cuda))}"
            )
    version = nvcc_version(nvcc)
    if version.split(".")[0] != torch_major:
        raise ToolchainUnavailable(
            f"CUDA version mismatch: nvcc at {nvcc} is CUDA {version} but torch "
            f"{torch.__version__} was built with CUDA {torch.version.cuda}; point CUDA_HOME at a "
            f"CUDA {torch_major}.x toolkit, or unset it and {wheel_toolkit.install_hint(str(torch.version.cuda))}"
        )
    if not ninja_available():
        raise ToolchainUnavailable("ninja is not installed or not on PATH (pip install ninja)")
    missing = sources.missing_required()
    if missing:
        raise ToolchainUnavailable(f"extension sources missing from {sources.sources_dir()}: {', '.join(missing)}")
    for flag in sources.EXTRA_CUDA_CFLAGS:
        if flag in sources.FORBIDDEN_CUDA_FLAGS:  # pragma: no cover - a guard against edits
            raise ToolchainUnavailable(f"forbidden nvcc flag {flag}: the step needs IEEE division")
    arch, arch_source = arch_list()
    return Toolchain(
        cuda_home=cuda_home,
        cuda_home_source=home_source,
        nvcc=str(nvcc),
        nvcc_version=version,
        arch_list=arch,
        arch_source=arch_source,
        host_compiler=host_compiler(),
    )
