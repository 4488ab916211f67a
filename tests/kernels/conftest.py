"""Fixtures for the extension loader's tests (requested by name: GPU tests here use the real cache)."""

from __future__ import annotations

import sys

import pytest

from lightning_cafin.kernels import loader, toolchain, wheel_toolkit

from .fakes import fake_cuda_home, hide_system_toolkit, torch_built_for


@pytest.fixture(scope="module")
def ext(fused_ok):
    """The loaded extension, for the GPU tests (skipped, saying why, where the fused step cannot run)."""
    from lightning_cafin.kernels import load_extension

    return load_extension()


@pytest.fixture
def fresh_loader(monkeypatch, tmp_path):
    """A private build cache and a fresh load attempt; the process's own attempt is back afterwards."""
    monkeypatch.setenv("LIGHTNING_CAFIN_BUILD_DIR", str(tmp_path / "build-cache"))
    with loader.fresh_load_attempt():
        yield


@pytest.fixture
def fake_toolchain(monkeypatch, tmp_path):
    """A CUDA 13.0 torch, a matching fake nvcc, ninja present, 9.0 arch list."""
    if sys.platform.startswith("win"):
        pytest.skip("the fake nvcc is a POSIX shell script")
    torch_built_for(monkeypatch, "13.0")
    home = fake_cuda_home(tmp_path, "13.0")
    monkeypatch.setenv("CUDA_HOME", str(home))
    monkeypatch.setattr(toolchain, "ninja_available", lambda: True)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    return home


@pytest.fixture
def no_system_toolkit(monkeypatch):
    hide_system_toolkit(monkeypatch)
    monkeypatch.setattr(toolchain, "ninja_available", lambda: True)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    monkeypatch.setattr(wheel_toolkit, "nvidia_dirs", lambda: [])
