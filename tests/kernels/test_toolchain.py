"""The toolchain check: each missing piece is named, with a fake nvcc (a shell script)."""

from __future__ import annotations

import sys

import pytest
import torch
from torch.utils import cpp_extension

from lightning_cafin import kernels
from lightning_cafin.kernels import build_cache, toolchain, wheel_toolkit

from .fakes import fake_cuda_home, hide_system_toolkit, no_real_build, torch_built_for

pytestmark = pytest.mark.usefixtures("fresh_loader")


def test_cpu_only_torch_is_named(monkeypatch):
    no_real_build(monkeypatch)
    torch_built_for(monkeypatch, None)
    info = kernels.extension_info()
    assert not info.loaded
    assert "CPU-only" in info.reason
    with pytest.raises(RuntimeError, match="CPU-only"):
        kernels.load_extension()
    ok, why = kernels.can_run_fused()
    assert not ok and "CPU-only" in why


def test_missing_cuda_home_is_named(monkeypatch):
    no_real_build(monkeypatch)
    hide_system_toolkit(monkeypatch)
    monkeypatch.setattr(wheel_toolkit, "nvidia_dirs", lambda: [])  # nor NVIDIA's toolkit wheels
    info = kernels.extension_info()
    assert not info.loaded
    assert "CUDA_HOME" in info.reason and "nvcc" in info.reason


def why_not_loaded(monkeypatch, cuda_home) -> str:
    """Why the loader turns down a CUDA 13 torch with ``CUDA_HOME=cuda_home`` (no real build is reached)."""
    no_real_build(monkeypatch)
    torch_built_for(monkeypatch, "13.0")
    monkeypatch.setenv("CUDA_HOME", str(cuda_home))
    info = kernels.extension_info()
    assert not info.loaded
    return info.reason


def test_incomplete_toolkit_is_named(monkeypatch, tmp_path):
    if sys.platform.startswith("win"):
        pytest.skip("the fake nvcc is a POSIX shell script")
    home = fake_cuda_home(tmp_path, "13.0", headers=False)
    reason = why_not_loaded(monkeypatch, home)
    assert "not a complete CUDA toolkit" in reason and str(home) in reason


def test_torch_guess_from_an_nvcc_wrapper_is_not_trusted(monkeypatch, tmp_path):
    """torch guesses /usr/local from a /usr/local/bin/nvcc wrapper; the real toolkit wins."""
    if sys.platform.startswith("win"):
        pytest.skip("the fake nvcc is a POSIX shell script")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    wrapper_home = fake_cuda_home(tmp_path, "13.0", headers=False)
    real = fake_cuda_home(tmp_path, "13.0")
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(wrapper_home))
    monkeypatch.setattr(toolchain, "DEFAULT_CUDA_HOME", str(real))
    assert toolchain.find_cuda_home() == (str(real), str(real))
    # And the build runs against the checked toolkit, torch's global restored after.
    torch_built_for(monkeypatch, "13.0")
    monkeypatch.setattr(toolchain, "ninja_available", lambda: True)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    seen = {}

    def fake_load(**kwargs):
        seen["home"] = cpp_extension.CUDA_HOME
        return type(sys)("fake_ext")

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    assert kernels.extension_info().loaded
    assert seen["home"] == str(real)
    assert cpp_extension.CUDA_HOME == str(wrapper_home)


def test_missing_nvcc_is_named(monkeypatch, tmp_path):
    empty = tmp_path / "no-toolkit"
    empty.mkdir()
    reason = why_not_loaded(monkeypatch, empty)
    assert "nvcc not found" in reason and str(empty) in reason


def test_cuda_major_mismatch_is_named(monkeypatch, tmp_path):
    if sys.platform.startswith("win"):
        pytest.skip("the fake nvcc is a POSIX shell script")
    monkeypatch.setattr(toolchain, "ninja_available", lambda: True)
    reason = why_not_loaded(monkeypatch, fake_cuda_home(tmp_path, "12.4"))
    assert "mismatch" in reason
    assert "12.4" in reason and "13.0" in reason


def test_missing_ninja_is_named(monkeypatch, fake_toolchain):
    no_real_build(monkeypatch)
    monkeypatch.setattr(toolchain, "ninja_available", lambda: False)
    info = kernels.extension_info()
    assert not info.loaded
    assert "ninja" in info.reason


def test_rocm_torch_is_named(monkeypatch):
    no_real_build(monkeypatch)
    monkeypatch.setattr(torch.version, "hip", "6.2", raising=False)
    info = kernels.extension_info()
    assert not info.loaded and "ROCm" in info.reason


def test_the_checked_toolchain_is_described(monkeypatch, fake_toolchain):
    tool = toolchain.check()
    assert tool.cuda_home == str(fake_toolchain) and tool.cuda_home_source == "CUDA_HOME"
    assert tool.nvcc == str(fake_toolchain / "bin" / "nvcc") and tool.nvcc_version == "13.0"
    assert (tool.arch_list, tool.arch_source) == ("9.0", "TORCH_CUDA_ARCH_LIST")
    assert build_cache.build_directory(tool).parent == build_cache.cache_root()


def test_arch_list_respects_env(monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")
    assert toolchain.arch_list() == ("8.0;9.0+PTX", "TORCH_CUDA_ARCH_LIST")


def test_arch_list_defaults_to_hopper_without_gpu(monkeypatch):
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    arch, source = toolchain.arch_list()
    assert arch == "9.0" and "default" in source


def test_arch_list_from_visible_gpus(monkeypatch):
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    caps = {0: (9, 0), 1: (8, 0), 2: (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: caps[i])
    assert toolchain.arch_list() == ("8.0;9.0", "visible GPUs")

