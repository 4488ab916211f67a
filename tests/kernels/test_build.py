"""Building and importing: a failure is logged and never raised, a build is announced, ninja's output on request."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

from lightning_cafin import kernels
from lightning_cafin.kernels import build_cache, loader, toolchain

pytestmark = pytest.mark.usefixtures("fresh_loader")


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


def test_a_build_prunes_the_installs_older_builds(monkeypatch, fake_toolchain, capsys):
    import json

    build_dir = build_cache.build_directory(toolchain.check())
    install = build_cache.build_key(toolchain.check())["install"]
    build_dir.parent.mkdir(parents=True)
    older = []
    for i in range(4):
        folder = build_dir.parent / f"torch0.0-cu0-nvcc0-cpython-0-{i:016x}"
        folder.mkdir()
        (folder / "key.json").write_text(json.dumps({"install": install}))
        os.utime(folder, (1000.0 * (i + 1), 1000.0 * (i + 1)))  # long ago: none is a build in progress
        older.append(folder)
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: type(sys)("fake_ext"))
    monkeypatch.delenv(build_cache.KEEP_ENV, raising=False)
    assert kernels.extension_info().loaded
    assert [f.exists() for f in older] == [False, False, True, True]  # the two newest older builds are kept
    assert "removed 2 older build(s) of this install" in capsys.readouterr().err


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

