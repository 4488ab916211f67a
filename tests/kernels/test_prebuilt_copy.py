"""The copy built at install time: taken when it fits, ignored when not, written by ``--build --output``."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from torch.utils import cpp_extension

from lightning_cafin.kernels import build_cache, loader, prebuilt_copy, toolchain

from .fakes import no_real_build

pytestmark = pytest.mark.usefixtures("fresh_loader")


def _install_copy(monkeypatch, tmp_path, **overrides):
    """A stand-in copy with this process's runtime key (``overrides`` change it); importing it gives a sentinel."""
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
    no_real_build(monkeypatch)
    sentinel = _install_copy(monkeypatch, tmp_path)
    monkeypatch.setattr(toolchain, "check", lambda: pytest.fail("no toolchain check needed"))
    assert loader.extension_or_none() is sentinel
    assert "built at install time" in loader.extension_info().reason


def test_a_prebuilt_copy_for_another_torch_is_ignored(monkeypatch, tmp_path):
    no_real_build(monkeypatch)
    _install_copy(monkeypatch, tmp_path, torch="0.0.1")
    monkeypatch.setattr(torch.version, "cuda", None)
    assert loader.extension_or_none() is None
    assert "CPU-only" in loader.extension_info().reason


def test_a_prebuilt_copy_for_another_gpu_is_ignored(monkeypatch, tmp_path):
    _install_copy(monkeypatch, tmp_path)
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
    assert meta["built_with"] == build_cache.build_key(toolchain.check())
    assert (output / so.name).read_text() == "not really a module"
    no_real_build(monkeypatch)
    monkeypatch.setattr(prebuilt_copy, "PREBUILT_DIR", output)
    monkeypatch.setattr(prebuilt_copy, "import_extension", lambda path: (path, "imported"))
    found = prebuilt_copy.find_prebuilt()
    assert found is not None and found[0] == (output / so.name, "imported")
    assert found[1].loaded and "built at install time" in found[1].reason

