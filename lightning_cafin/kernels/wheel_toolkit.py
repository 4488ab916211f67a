"""A CUDA toolkit root assembled from NVIDIA's pip wheels, for machines without a system toolkit.

torch's CUDA wheels bring the runtime libraries but no compiler.  NVIDIA publishes the
rest as wheels too (``pip install "lightning-cafin[cuda-build]"`` installs them):

* CUDA 13: ``nvidia-cuda-nvcc``, ``nvidia-cuda-crt``, ``nvidia-nvvm``, ``nvidia-cuda-runtime``
  and ``nvidia-cuda-cccl`` all unpack into one tree, ``site-packages/nvidia/cu13``;
* CUDA 12: ``nvidia-cuda-nvcc-cu12`` & co. unpack into one folder each
  (``nvidia/cuda_nvcc``, ``nvidia/cuda_runtime``, ``nvidia/cuda_cccl``).

Neither layout is quite what ``torch.utils.cpp_extension`` expects from ``CUDA_HOME``
(``bin/nvcc``, ``include/``, ``lib64/libcudart.so``: the wheels ship only the versioned
``libcudart.so.13``), so :func:`assemble` builds a small tree of symbolic links that is.
Nothing is copied; the tree is rebuilt when the wheels move.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

#: The pip extra that installs the wheels, and what it holds, per CUDA major version of torch.
EXTRA = "cuda-build"
WHEELS = {
    "13": ("nvidia-cuda-nvcc", "nvidia-cuda-crt", "nvidia-nvvm", "nvidia-cuda-runtime", "nvidia-cuda-cccl"),
    "12": ("nvidia-cuda-nvcc-cu12", "nvidia-cuda-runtime-cu12", "nvidia-cuda-cccl-cu12"),
}

# Per-component folders of the CUDA 12 wheels (CUDA 13 puts everything in cu13/).
_CU12_PARTS = ("cuda_nvcc", "cuda_runtime", "cuda_cccl", "cuda_crt", "nvvm")


#: The CUDA version the extra's pins match (torch 2.14's CUDA 13 wheels are built with 13.0).
EXTRA_CUDA = "13.0"


def install_hint(torch_cuda: str) -> str:
    """The command that installs the toolkit wheels matching torch's CUDA version (``"13.0"``)."""
    if torch_cuda == EXTRA_CUDA:
        return f'pip install "lightning-cafin[{EXTRA}]"'
    major = torch_cuda.split(".")[0]
    names = WHEELS.get(major)
    if names is None:
        return f"install NVIDIA's CUDA {torch_cuda} toolkit (no pip wheels are known for it)"
    # Same minor version as torch: the wheels share one include folder with torch's runtime wheel.
    return "pip install " + " ".join(f'"{n}=={torch_cuda}.*"' for n in names)


def nvidia_dirs() -> list[Path]:
    """Every ``site-packages/nvidia`` folder on ``sys.path`` (a namespace package: never imported).

    Looked up on each call through this module, so a test can stand in a fake wheel tree.
    """
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    return [Path(p) for p in spec.submodule_search_locations if Path(p).is_dir()]


def wheel_roots(cuda_major: str) -> list[Path]:
    """The wheel folders that make up a CUDA ``cuda_major`` toolkit, nvcc's first; [] if nvcc is absent."""
    roots: list[Path] = []
    for base in nvidia_dirs():
        names = (f"cu{cuda_major}",) if int(cuda_major) >= 13 else _CU12_PARTS
        roots += [base / name for name in names if (base / name).is_dir()]
    with_nvcc = [r for r in roots if (r / "bin" / "nvcc").is_file()]
    if not with_nvcc:
        return []
    return with_nvcc[:1] + [r for r in roots if r != with_nvcc[0]]


def _merge_links(target: Path, sources: list[Path]) -> None:
    """``target/<name>`` -> the first ``source/<name>`` for every name in the sources."""
    target.mkdir(parents=True, exist_ok=True)
    for source in sources:
        if not source.is_dir():
            continue
        for entry in sorted(source.iterdir()):
            link = target / entry.name
            if not link.exists() and not link.is_symlink():
                link.symlink_to(entry)


def assemble(roots: list[Path], cache_root: Path) -> Path:
    """A ``CUDA_HOME`` under ``cache_root`` made of links into ``roots``; reused while they stay put."""
    key = hashlib.sha256("\n".join(str(r.resolve()) for r in roots).encode()).hexdigest()[:12]
    home = cache_root / f"cuda-home-from-wheels-{key}"
    if (home / "bin" / "nvcc").exists() and (home / "include").is_dir():
        return home
    cache_root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".cuda-home-", dir=cache_root))
    try:
        # bin/ and nvvm/ as whole folders: nvcc finds cicc, ptxas and nvcc.profile beside itself.
        (staging / "bin").symlink_to(roots[0] / "bin")
        nvvm = next((r / "nvvm" for r in roots if (r / "nvvm").is_dir()), None)
        if nvvm is not None:
            (staging / "nvvm").symlink_to(nvvm)
        _merge_links(staging / "include", [r / "include" for r in roots])
        lib64 = staging / "lib64"
        _merge_links(lib64, [r / "lib" for r in roots] + [r / "lib64" for r in roots])
        # The wheels ship libcudart.so.N only; `-lcudart` (cpp_extension's link line) needs the bare name.
        if not (lib64 / "libcudart.so").exists():
            versioned = sorted(lib64.glob("libcudart.so.*"))
            if versioned:
                (lib64 / "libcudart.so").symlink_to(versioned[0].resolve())
        try:
            os.replace(staging, home)
        except OSError:  # another process assembled it first, or a stale tree is in the way
            if not (home / "bin" / "nvcc").exists():
                shutil.rmtree(home, ignore_errors=True)
                os.replace(staging, home)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return home


def missing_pieces(home: Path) -> list[str]:
    """What a build needs that ``home`` lacks, as the wheel names that provide it."""
    missing = []
    if not (home / "include" / "cuda_runtime.h").is_file():
        missing.append("nvidia-cuda-runtime (cuda_runtime.h)")
    if not (home / "include" / "cub").exists() and not (home / "include" / "cccl" / "cub").exists():
        missing.append("nvidia-cuda-cccl (CUB/Thrust/libcu++ headers)")
    if not (home / "nvvm").exists():
        missing.append("nvidia-nvvm (cicc)")
    return missing


def find(cuda_major: str, cache_root: Path) -> Optional[Path]:
    """The assembled toolkit root for ``cuda_major`` or None when no nvcc wheel is installed."""
    roots = wheel_roots(cuda_major)
    if not roots:
        return None
    return assemble(roots, cache_root)
