"""NVIDIA's toolkit wheels: named when nothing else is found, assembled into a CUDA_HOME when installed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

from lightning_cafin import kernels
from lightning_cafin.kernels import toolchain, wheel_toolkit

from .fakes import fake_cuda_home, fake_wheel_tree, no_real_build

pytestmark = pytest.mark.usefixtures("fresh_loader")


def test_no_toolkit_names_the_cuda_build_extra(monkeypatch, no_system_toolkit):
    no_real_build(monkeypatch)
    info = kernels.extension_info()
    assert not info.loaded
    assert 'pip install "lightning-cafin[cuda-build]"' in info.reason
    assert "CUDA_HOME" in info.reason


def test_no_toolkit_for_another_cuda_names_matching_wheels(monkeypatch, no_system_toolkit):
    no_real_build(monkeypatch)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    info = kernels.extension_info()
    assert '"nvidia-cuda-nvcc-cu12==12.8.*"' in info.reason and "cuda-cccl-cu12" in info.reason


@pytest.mark.skipif(sys.platform.startswith("win"), reason="the fake nvcc is a POSIX shell script")
def test_the_wheels_make_a_toolkit_when_no_nvcc_is_found(monkeypatch, tmp_path, no_system_toolkit):
    nvidia = fake_wheel_tree(tmp_path / "site")
    monkeypatch.setattr(wheel_toolkit, "nvidia_dirs", lambda: [nvidia])
    seen = {}

    def fake_load(**kwargs):
        seen["home"] = cpp_extension.CUDA_HOME
        return type(sys)("fake_ext")

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    info = kernels.extension_info()
    assert info.loaded, info.reason
    assert "NVIDIA's pip wheels" in info.reason
    home = Path(seen["home"])
    assert home.parent == tmp_path / "build-cache"
    assert (home / "bin" / "nvcc").resolve() == (nvidia / "cu13" / "bin" / "nvcc").resolve()
    assert (home / "include" / "cuda_runtime.h").is_file()
    # torch links `-lcudart`: the wheels ship only libcudart.so.13
    assert (home / "lib64" / "libcudart.so").resolve() == (nvidia / "cu13" / "lib" / "libcudart.so.13").resolve()


@pytest.mark.skipif(sys.platform.startswith("win"), reason="the fake nvcc is a POSIX shell script")
def test_wheels_without_cccl_are_named(monkeypatch, tmp_path, no_system_toolkit):
    no_real_build(monkeypatch)
    nvidia = fake_wheel_tree(tmp_path / "site", cccl=False)
    monkeypatch.setattr(wheel_toolkit, "nvidia_dirs", lambda: [nvidia])
    info = kernels.extension_info()
    assert not info.loaded and "nvidia-cuda-cccl" in info.reason


@pytest.mark.skipif(sys.platform.startswith("win"), reason="the fake nvcc is a POSIX shell script")
def test_wheels_win_over_a_system_toolkit_of_another_major(monkeypatch, tmp_path, no_system_toolkit):
    old = fake_cuda_home(tmp_path, "12.4")
    monkeypatch.setattr(toolchain, "DEFAULT_CUDA_HOME", str(old))
    nvidia = fake_wheel_tree(tmp_path / "site")
    monkeypatch.setattr(wheel_toolkit, "nvidia_dirs", lambda: [nvidia])
    home, source = toolchain.find_cuda_home()
    assert "pip wheels" in source and home != str(old)
    monkeypatch.setattr(wheel_toolkit, "nvidia_dirs", lambda: [])
    assert toolchain.find_cuda_home() == (str(old), str(old))  # without wheels: the mismatch is then reported

