"""Fakes for the extension loader's tests: a toolkit that is only a shell script, NVIDIA's
wheel layout, and a cpp_extension that must not be reached.  Nothing here builds anything.
"""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Optional

import torch
from torch.utils import cpp_extension

from lightning_cafin.kernels import toolchain
from lightning_cafin.kernels.toolchain import Toolchain


def fake_cuda_home(tmp_path: Path, release: str, headers: bool = True) -> Path:
    """A toolkit root whose nvcc is a script printing ``release``; without ``headers`` it is incomplete."""
    home = tmp_path / f"cuda-{release}{'' if headers else '-noheaders'}"
    (home / "bin").mkdir(parents=True)
    if headers:
        (home / "include").mkdir()
        (home / "include" / "cuda_runtime.h").write_text("/* fake */\n")
    nvcc = home / "bin" / "nvcc"
    nvcc.write_text(
        "#!/bin/sh\n"
        "echo 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
        f"echo 'Cuda compilation tools, release {release}, V{release}.0'\n"
    )
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return home


def no_real_build(monkeypatch):
    """Any call of ``cpp_extension.load`` fails the test."""

    def forbidden(*args, **kwargs):  # pragma: no cover - reached only on a bug
        raise AssertionError("the test reached a real build")

    monkeypatch.setattr(cpp_extension, "load", forbidden)


def torch_built_for(monkeypatch, cuda: Optional[str]) -> None:
    """torch as a build for CUDA ``cuda`` (``None``: CPU-only), never a ROCm one."""
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)


def hide_system_toolkit(monkeypatch) -> None:
    """A CUDA 13 torch on a machine with no system toolkit anywhere the loader looks."""
    torch_built_for(monkeypatch, "13.0")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    monkeypatch.setattr(toolchain, "DEFAULT_CUDA_HOME", None)


def fake_wheel_tree(base: Path, release: str = "13.0", cccl: bool = True) -> Path:
    """site-packages/nvidia with the CUDA 13 wheels' one-tree layout (nvidia/cu13)."""
    root = base / "nvidia" / "cu13"
    home = fake_cuda_home(tmp_path=base, release=release)  # bin/nvcc and include/cuda_runtime.h
    root.parent.mkdir(parents=True)
    home.rename(root)
    if cccl:
        (root / "include" / "cub").mkdir()
    (root / "nvvm" / "bin").mkdir(parents=True)
    (root / "lib").mkdir()
    (root / "lib" / "libcudart.so.13").write_text("")
    return base / "nvidia"


def toolchain_for(home="/usr/local/cuda") -> Toolchain:
    """A described toolchain rooted at ``home`` (nothing is run or checked)."""
    return Toolchain(cuda_home=home, cuda_home_source="CUDA_HOME", nvcc=f"{home}/bin/nvcc", nvcc_version="13.0",
                     arch_list="9.0", arch_source="TORCH_CUDA_ARCH_LIST", host_compiler="c++ 12")
