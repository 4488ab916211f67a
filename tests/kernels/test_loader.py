"""The extension loader: CPU-runnable, never builds anything for real.

Every test works on a fresh, private load attempt (the process-wide cache is saved
and restored) and replaces the toolchain pieces it is about with fakes, so the
checks are exercised on any machine, with or without CUDA.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

from lightning_cafin import kernels
from lightning_cafin.kernels import loader


@pytest.fixture(autouse=True)
def _private_cache(monkeypatch, tmp_path):
    saved = (loader._module, loader._info)
    loader._module, loader._info = None, None
    monkeypatch.setenv("LIGHTNING_CAFIN_BUILD_DIR", str(tmp_path / "build-cache"))
    yield
    loader._module, loader._info = saved


def _fake_cuda_home(tmp_path: Path, release: str, headers: bool = True) -> Path:
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


@pytest.fixture
def fake_toolchain(monkeypatch, tmp_path):
    """A CUDA 13.0 torch, a matching fake nvcc, ninja present, 9.0 arch list."""
    if sys.platform.startswith("win"):
        pytest.skip("the fake nvcc is a POSIX shell script")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    home = _fake_cuda_home(tmp_path, "13.0")
    monkeypatch.setenv("CUDA_HOME", str(home))
    monkeypatch.setattr(loader, "_ninja_available", lambda: True)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    return home


def _no_real_build(monkeypatch):
    def forbidden(*args, **kwargs):  # pragma: no cover - reached only on a bug
        raise AssertionError("the test reached a real build")

    monkeypatch.setattr(cpp_extension, "load", forbidden)


def test_package_reexports_the_loader_api():
    assert kernels.load_extension is loader.load_extension
    assert kernels.extension_info is loader.extension_info
    assert kernels.ExtensionInfo is loader.ExtensionInfo
    assert kernels.can_run_fused is loader.can_run_fused


def test_extension_info_is_a_frozen_dataclass():
    info = loader.ExtensionInfo(False, "why", None, None)
    with pytest.raises(Exception):
        info.loaded = True  # type: ignore[misc]


def test_cpu_only_torch_is_named(monkeypatch):
    _no_real_build(monkeypatch)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    info = kernels.extension_info()
    assert not info.loaded
    assert "CPU-only" in info.reason
    with pytest.raises(RuntimeError, match="CPU-only"):
        kernels.load_extension()
    ok, why = kernels.can_run_fused()
    assert not ok and "CPU-only" in why


def test_missing_cuda_home_is_named(monkeypatch):
    _no_real_build(monkeypatch)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    monkeypatch.setattr(loader, "_DEFAULT_CUDA_HOME", None)
    info = kernels.extension_info()
    assert not info.loaded
    assert "CUDA_HOME" in info.reason and "nvcc" in info.reason


def test_incomplete_toolkit_is_named(monkeypatch, tmp_path):
    if sys.platform.startswith("win"):
        pytest.skip("the fake nvcc is a POSIX shell script")
    _no_real_build(monkeypatch)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    home = _fake_cuda_home(tmp_path, "13.0", headers=False)
    monkeypatch.setenv("CUDA_HOME", str(home))
    info = kernels.extension_info()
    assert not info.loaded
    assert "not a complete CUDA toolkit" in info.reason and str(home) in info.reason


def test_torch_guess_from_an_nvcc_wrapper_is_not_trusted(monkeypatch, tmp_path):
    """torch guesses /usr/local from a /usr/local/bin/nvcc wrapper; the real toolkit wins."""
    if sys.platform.startswith("win"):
        pytest.skip("the fake nvcc is a POSIX shell script")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    wrapper_home = _fake_cuda_home(tmp_path, "13.0", headers=False)
    real = _fake_cuda_home(tmp_path, "13.0")
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(wrapper_home))
    monkeypatch.setattr(loader, "_DEFAULT_CUDA_HOME", str(real))
    assert loader._cuda_home() == (str(real), str(real))
    # And the build runs against the checked toolkit, torch's global restored after.
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(loader, "_ninja_available", lambda: True)
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
    _no_real_build(monkeypatch)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    empty = tmp_path / "no-toolkit"
    empty.mkdir()
    monkeypatch.setenv("CUDA_HOME", str(empty))
    info = kernels.extension_info()
    assert not info.loaded
    assert "nvcc not found" in info.reason and str(empty) in info.reason


def test_cuda_major_mismatch_is_named(monkeypatch, tmp_path):
    if sys.platform.startswith("win"):
        pytest.skip("the fake nvcc is a POSIX shell script")
    _no_real_build(monkeypatch)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setenv("CUDA_HOME", str(_fake_cuda_home(tmp_path, "12.4")))
    monkeypatch.setattr(loader, "_ninja_available", lambda: True)
    info = kernels.extension_info()
    assert not info.loaded
    assert "mismatch" in info.reason
    assert "12.4" in info.reason and "13.0" in info.reason


def test_missing_ninja_is_named(monkeypatch, fake_toolchain):
    _no_real_build(monkeypatch)
    monkeypatch.setattr(loader, "_ninja_available", lambda: False)
    info = kernels.extension_info()
    assert not info.loaded
    assert "ninja" in info.reason


def test_rocm_torch_is_named(monkeypatch):
    _no_real_build(monkeypatch)
    monkeypatch.setattr(torch.version, "hip", "6.2", raising=False)
    info = kernels.extension_info()
    assert not info.loaded and "ROCm" in info.reason


def test_build_failure_is_logged_and_never_raises(monkeypatch, fake_toolchain, tmp_path):
    calls = []

    def failing_load(**kwargs):
        calls.append(kwargs)
        raise RuntimeError("Error building extension 'lightning_cafin_C': nvcc exploded")

    monkeypatch.setattr(cpp_extension, "load", failing_load)
    info = kernels.extension_info()
    assert not info.loaded
    assert info.log_path is not None and Path(info.log_path).is_file()
    assert info.log_path in info.reason
    assert "nvcc exploded" in Path(info.log_path).read_text()
    assert info.build_dir is not None
    assert Path(info.build_dir).parent == tmp_path / "build-cache"
    # Cached: a second call does not rebuild.
    assert kernels.extension_info() is info
    assert len(calls) == 1
    with pytest.raises(RuntimeError, match="failed to build"):
        kernels.load_extension()

    (kwargs,) = calls
    flags = kwargs["extra_cuda_cflags"] + kwargs["extra_cflags"]
    assert "-O3" in kwargs["extra_cuda_cflags"]
    assert not any("fast_math" in f or "prec-div=false" in f for f in flags)
    assert kwargs["build_directory"] == info.build_dir
    assert all(Path(s).is_file() for s in kwargs["sources"])


def test_unexpected_exception_in_checks_never_raises(monkeypatch):
    _no_real_build(monkeypatch)

    def broken():
        raise ValueError("something odd")

    monkeypatch.setattr(loader, "_check_toolchain", broken)
    info = kernels.extension_info()
    assert not info.loaded and info.reason
    assert "something odd" in info.reason


def test_successful_load_reports_loaded(monkeypatch, fake_toolchain):
    sentinel = type(sys)("fake_ext")
    seen = {}

    def fake_load(**kwargs):
        seen["arch"] = os.environ.get("TORCH_CUDA_ARCH_LIST")
        return sentinel

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    info = kernels.extension_info()
    assert info.loaded, info.reason
    assert kernels.load_extension() is sentinel
    assert seen["arch"] == "9.0"
    assert info.build_dir is not None and info.log_path is not None
    ok, why = kernels.can_run_fused()
    assert ok == torch.cuda.is_available()
    assert why


def test_build_dir_is_keyed_on_versions_and_arch(monkeypatch, fake_toolchain):
    tool = {"nvcc_version": "13.0", "arch_list": "9.0", "cuda_home": str(fake_toolchain)}
    first = loader._build_dir(tool)
    assert torch.__version__.split("+")[0] in first.name
    assert "cu130" in first.name
    assert loader._build_dir({**tool, "arch_list": "8.0;9.0"}) != first
    assert loader._build_dir({**tool, "cuda_home": "/opt/other-cuda"}) != first
    assert loader._build_dir(dict(tool)) == first


def test_arch_list_respects_env(monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")
    assert loader._arch_list() == ("8.0;9.0+PTX", "TORCH_CUDA_ARCH_LIST")


def test_arch_list_defaults_to_hopper_without_gpu(monkeypatch):
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    arch, source = loader._arch_list()
    assert arch == "9.0" and "default" in source


def test_arch_list_from_visible_gpus(monkeypatch):
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    caps = {0: (9, 0), 1: (8, 0), 2: (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: caps[i])
    assert loader._arch_list() == ("8.0;9.0", "visible GPUs")


def test_cli_reports_and_fails_without_toolchain(monkeypatch, capsys):
    _no_real_build(monkeypatch)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    assert loader.main([]) == 1
    assert "CPU-only" in capsys.readouterr().out


def test_sources_are_present():
    for name in loader._SOURCES + loader._HEADERS:
        assert (loader._CSRC_DIR / name).is_file(), name
