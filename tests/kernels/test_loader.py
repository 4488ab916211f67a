"""The extension loader: CPU-runnable, never builds anything for real.

Every test works on a fresh, private load attempt (the process-wide cache is saved
and restored) and replaces the toolchain pieces it is about with fakes, so the
checks are exercised on any machine, with or without CUDA.
"""

from __future__ import annotations

import json
import os
import re
import stat
import sys
from dataclasses import FrozenInstanceError, replace
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

from lightning_cafin import kernels
from lightning_cafin.kernels import build_cache, loader, prebuilt_copy, sources, toolchain, wheel_toolkit
from lightning_cafin.kernels.toolchain import Toolchain


@pytest.fixture(autouse=True)
def _private_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("LIGHTNING_CAFIN_BUILD_DIR", str(tmp_path / "build-cache"))
    with loader.fresh_load_attempt():
        yield


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
    monkeypatch.setattr(toolchain, "ninja_available", lambda: True)
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
    with pytest.raises(FrozenInstanceError):
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


def _no_system_toolkit(monkeypatch) -> None:
    """A CUDA 13 torch on a machine with no system toolkit anywhere the loader looks."""
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    monkeypatch.setattr(toolchain, "DEFAULT_CUDA_HOME", None)


def test_missing_cuda_home_is_named(monkeypatch):
    _no_real_build(monkeypatch)
    _no_system_toolkit(monkeypatch)
    monkeypatch.setattr(wheel_toolkit, "nvidia_dirs", lambda: [])  # nor NVIDIA's toolkit wheels
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
    monkeypatch.setattr(toolchain, "DEFAULT_CUDA_HOME", str(real))
    assert toolchain.find_cuda_home() == (str(real), str(real))
    # And the build runs against the checked toolkit, torch's global restored after.
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
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
    monkeypatch.setattr(toolchain, "ninja_available", lambda: True)
    info = kernels.extension_info()
    assert not info.loaded
    assert "mismatch" in info.reason
    assert "12.4" in info.reason and "13.0" in info.reason


def test_missing_ninja_is_named(monkeypatch, fake_toolchain):
    _no_real_build(monkeypatch)
    monkeypatch.setattr(toolchain, "ninja_available", lambda: False)
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

    monkeypatch.setattr(toolchain, "check", broken)
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
    tool = _tool(str(fake_toolchain))
    first = build_cache.build_directory(tool)
    assert torch.__version__.split("+")[0] in first.name
    assert "cu130" in first.name
    assert build_cache.build_directory(replace(tool, arch_list="8.0;9.0")) != first
    assert build_cache.build_directory(replace(tool, cuda_home="/opt/other-cuda")) != first
    assert build_cache.build_directory(replace(tool, host_compiler="c++ 13")) != first
    assert build_cache.build_directory(replace(tool)) == first
    # Where a piece came from names it in messages only: the same build, the same folder.
    assert build_cache.build_directory(replace(tool, cuda_home_source="CUDA_PATH", arch_source="visible GPUs")) == first


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


def test_cli_reports_and_fails_without_toolchain(monkeypatch, capsys):
    _no_real_build(monkeypatch)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    assert loader.main([]) == 1
    assert "CPU-only" in capsys.readouterr().out


def test_sources_are_present():
    names = loader.source_files() + loader.header_files()
    assert {"bindings.cpp", "adafisher_step.cu", "adafisher_step.h", "vector_io.cuh"} <= set(names)
    for name in names:
        assert (sources.sources_dir() / name).is_file(), name
    assert sources.missing_required() == []


# ------------------------------------------------------------------ csrc by glob, cache keys


def test_csrc_is_found_by_glob_and_every_file_keys_the_cache(monkeypatch, tmp_path):
    import shutil

    csrc = tmp_path / "csrc"
    shutil.copytree(sources.sources_dir(), csrc)
    before = sources.source_hash(csrc)
    assert before == sources.source_hash()  # a copy hashes like the original
    (csrc / "new_kernel.cu").write_text("// a new translation unit\n")
    (csrc / "new_helpers.cuh").write_text("// a new header\n")
    assert "new_kernel.cu" in sources.source_files(csrc)
    assert "new_helpers.cuh" in sources.header_files(csrc) and "new_helpers.cuh" not in sources.source_files(csrc)
    after_add = sources.source_hash(csrc)
    assert after_add != before
    (csrc / "new_helpers.cuh").write_text("// edited\n")
    assert sources.source_hash(csrc) != after_add
    (csrc / "bindings.cpp").unlink()
    assert sources.missing_required(csrc) == ["bindings.cpp"]


def _tool(home="/usr/local/cuda") -> Toolchain:
    return Toolchain(cuda_home=home, cuda_home_source="CUDA_HOME", nvcc=f"{home}/bin/nvcc", nvcc_version="13.0",
                     arch_list="9.0", arch_source="TORCH_CUDA_ARCH_LIST", host_compiler="c++ 12")


def test_two_environments_get_two_cache_folders(monkeypatch):
    first = build_cache.build_directory(_tool())
    monkeypatch.setattr(sys, "prefix", "/some/other/venv")
    assert build_cache.build_directory(_tool()) != first


def test_python_version_keys_the_cache(monkeypatch):
    first = loader.build_key(_tool())
    monkeypatch.setattr(sys, "version", "3.99.0 (fake)")
    assert loader.build_key(_tool())["python"] != first["python"]


# ------------------------------------------------------------------ NVIDIA's toolkit wheels


def _fake_wheel_tree(base: Path, release: str = "13.0", cccl: bool = True) -> Path:
    """site-packages/nvidia with the CUDA 13 wheels' one-tree layout (nvidia/cu13)."""
    root = base / "nvidia" / "cu13"
    home = _fake_cuda_home(tmp_path=base, release=release)  # bin/nvcc and include/cuda_runtime.h
    root.parent.mkdir(parents=True)
    home.rename(root)
    if cccl:
        (root / "include" / "cub").mkdir()
    (root / "nvvm" / "bin").mkdir(parents=True)
    (root / "lib").mkdir()
    (root / "lib" / "libcudart.so.13").write_text("")
    return base / "nvidia"


@pytest.fixture
def no_system_toolkit(monkeypatch):
    _no_system_toolkit(monkeypatch)
    monkeypatch.setattr(toolchain, "ninja_available", lambda: True)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    monkeypatch.setattr(wheel_toolkit, "nvidia_dirs", lambda: [])


def test_no_toolkit_names_the_cuda_build_extra(monkeypatch, no_system_toolkit):
    _no_real_build(monkeypatch)
    info = kernels.extension_info()
    assert not info.loaded
    assert 'pip install "lightning-cafin[cuda-build]"' in info.reason
    assert "CUDA_HOME" in info.reason


def test_no_toolkit_for_another_cuda_names_matching_wheels(monkeypatch, no_system_toolkit):
    _no_real_build(monkeypatch)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    info = kernels.extension_info()
    assert '"nvidia-cuda-nvcc-cu12==12.8.*"' in info.reason and "cuda-cccl-cu12" in info.reason


@pytest.mark.skipif(sys.platform.startswith("win"), reason="the fake nvcc is a POSIX shell script")
def test_the_wheels_make_a_toolkit_when_no_nvcc_is_found(monkeypatch, tmp_path, no_system_toolkit):
    nvidia = _fake_wheel_tree(tmp_path / "site")
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
    _no_real_build(monkeypatch)
    nvidia = _fake_wheel_tree(tmp_path / "site", cccl=False)
    monkeypatch.setattr(wheel_toolkit, "nvidia_dirs", lambda: [nvidia])
    info = kernels.extension_info()
    assert not info.loaded and "nvidia-cuda-cccl" in info.reason


@pytest.mark.skipif(sys.platform.startswith("win"), reason="the fake nvcc is a POSIX shell script")
def test_wheels_win_over_a_system_toolkit_of_another_major(monkeypatch, tmp_path, no_system_toolkit):
    old = _fake_cuda_home(tmp_path, "12.4")
    monkeypatch.setattr(toolchain, "DEFAULT_CUDA_HOME", str(old))
    nvidia = _fake_wheel_tree(tmp_path / "site")
    monkeypatch.setattr(wheel_toolkit, "nvidia_dirs", lambda: [nvidia])
    home, source = toolchain.find_cuda_home()
    assert "pip wheels" in source and home != str(old)
    monkeypatch.setattr(wheel_toolkit, "nvidia_dirs", lambda: [])
    assert toolchain.find_cuda_home() == (str(old), str(old))  # without wheels: the mismatch is then reported


# ------------------------------------------------------------------ build notice, verbosity


def test_a_build_is_announced_on_stderr(monkeypatch, fake_toolchain, capsys):
    seen = {}

    def fake_load(**kwargs):
        seen.update(kwargs)
        return type(sys)("fake_ext")

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.delenv("LIGHTNING_CAFIN_VERBOSE_BUILD", raising=False)
    assert kernels.extension_info().loaded
    err = capsys.readouterr().err
    assert re.search(r"building the lightning_cafin CUDA extension, about \d+ minutes?, once per torch/CUDA "
                     r"version", err), err
    assert "LIGHTNING_CAFIN_VERBOSE_BUILD=1" in err
    assert "built the lightning_cafin CUDA extension in" in err
    assert seen["verbose"] is False


def test_no_notice_when_the_cache_holds_the_build(monkeypatch, fake_toolchain, capsys):
    build_dir = build_cache.build_directory(toolchain.check())
    build_dir.mkdir(parents=True)
    (build_dir / f"{loader.EXTENSION_NAME}.so").write_text("")
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: type(sys)("fake_ext"))
    assert kernels.extension_info().loaded
    assert "building" not in capsys.readouterr().err


@pytest.mark.parametrize("how", ["env", "flag"])
def test_ninja_output_on_request(monkeypatch, fake_toolchain, capsys, how):
    seen = {}

    def fake_load(**kwargs):
        seen.update(kwargs)
        return type(sys)("fake_ext")

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    if how == "env":
        monkeypatch.setenv("LIGHTNING_CAFIN_VERBOSE_BUILD", "1")
        assert kernels.extension_info().loaded
    else:
        monkeypatch.delenv("LIGHTNING_CAFIN_VERBOSE_BUILD", raising=False)
        assert loader.main(["--build", "--verbose"]) == 0
    assert seen["verbose"] is True


def test_extension_or_none(monkeypatch, fake_toolchain):
    sentinel = type(sys)("fake_ext")
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: sentinel)
    assert loader.extension_or_none() is sentinel


def test_extension_or_none_without_toolchain(monkeypatch):
    _no_real_build(monkeypatch)
    monkeypatch.setattr(torch.version, "cuda", None)
    assert loader.extension_or_none() is None
    assert "CPU-only" in loader.extension_info().reason


def test_a_fresh_load_attempt_tries_again_and_restores_the_earlier_one(monkeypatch, fake_toolchain):
    sentinel = type(sys)("fake_ext")
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: sentinel)
    outer = kernels.extension_info()
    assert outer.loaded
    with loader.fresh_load_attempt():
        assert not loader.load_attempted()
        monkeypatch.setattr(toolchain, "ninja_available", lambda: False)
        inner = kernels.extension_info()
        assert not inner.loaded and "ninja" in inner.reason
        assert loader.extension_or_none() is None
    assert loader.load_attempted() and kernels.extension_info() is outer
    assert kernels.load_extension() is sentinel


def test_top_level_extension_info_is_the_loaders():
    import lightning_cafin

    assert lightning_cafin.extension_info is loader.extension_info


# ------------------------------------------------------------------ a copy built at install time


def _prebuilt(monkeypatch, tmp_path, **overrides):
    prebuilt = tmp_path / "prebuilt"
    prebuilt.mkdir()
    (prebuilt / "lightning_cafin_C.so").write_text("")
    key = {**prebuilt_copy.runtime_key(), **overrides}
    (prebuilt / "build.json").write_text(json.dumps({"runtime_key": key, "arch": "9.0",
                                                     "file": "lightning_cafin_C.so"}))
    monkeypatch.setattr(prebuilt_copy, "PREBUILT_DIR", prebuilt)
    sentinel = type(sys)("prebuilt_ext")
    monkeypatch.setattr(prebuilt_copy, "import_extension", lambda path: sentinel)
    return sentinel


def test_a_prebuilt_copy_that_fits_is_loaded_without_a_toolchain(monkeypatch, tmp_path):
    _no_real_build(monkeypatch)
    sentinel = _prebuilt(monkeypatch, tmp_path)
    monkeypatch.setattr(toolchain, "check", lambda: pytest.fail("no toolchain check needed"))
    assert loader.extension_or_none() is sentinel
    assert "built at install time" in loader.extension_info().reason


def test_a_prebuilt_copy_for_another_torch_is_ignored(monkeypatch, tmp_path):
    _no_real_build(monkeypatch)
    _prebuilt(monkeypatch, tmp_path, torch="0.0.1")
    monkeypatch.setattr(torch.version, "cuda", None)
    assert loader.extension_or_none() is None
    assert "CPU-only" in loader.extension_info().reason


def test_a_prebuilt_copy_for_another_gpu_is_ignored(monkeypatch, tmp_path):
    _prebuilt(monkeypatch, tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (8, 0))
    assert prebuilt_copy.find_prebuilt() is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (9, 0))
    assert prebuilt_copy.find_prebuilt() is not None


def test_the_cli_writes_a_copy_that_the_loader_takes(monkeypatch, fake_toolchain, tmp_path, capsys):
    """``--build --output`` (setup.py's LIGHTNING_CAFIN_BUILD=1) writes the module with the key it is found by."""
    so = tmp_path / "built" / "lightning_cafin_C.so"
    so.parent.mkdir()
    so.write_text("not really a module")
    built = type(sys)("fake_ext")
    built.__file__ = str(so)
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: built)
    output = tmp_path / "prebuilt"
    assert loader.main(["--build", "--output", str(output)]) == 0
    assert f"copied to {output / so.name}" in capsys.readouterr().out
    meta = json.loads((output / "build.json").read_text())
    assert meta["runtime_key"] == prebuilt_copy.runtime_key() and meta["arch"] == "9.0"
    assert meta["built_with"] == loader.build_key(toolchain.check())
    assert (output / so.name).read_text() == "not really a module"
    _no_real_build(monkeypatch)
    monkeypatch.setattr(prebuilt_copy, "PREBUILT_DIR", output)
    monkeypatch.setattr(prebuilt_copy, "import_extension", lambda path: (path, "imported"))
    found = prebuilt_copy.find_prebuilt()
    assert found is not None and found[0] == (output / so.name, "imported")
    assert found[1].loaded and "built at install time" in found[1].reason
