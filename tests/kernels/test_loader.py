"""The loader: one load attempt per process, its accessors and its command line.

Every test works on a fresh, private load attempt (``fresh_loader``) and replaces the
toolchain pieces it is about with fakes (``fakes.py``): CPU-runnable, never builds anything.
"""

from __future__ import annotations

import sys
from dataclasses import FrozenInstanceError

import pytest
import torch
from torch.utils import cpp_extension

from lightning_cafin import kernels
from lightning_cafin.kernels import loader, toolchain

from .fakes import no_real_build, torch_built_for

pytestmark = pytest.mark.usefixtures("fresh_loader")


def test_package_reexports_the_loader_api():
    assert kernels.load_extension is loader.load_extension
    assert kernels.extension_info is loader.extension_info
    assert kernels.ExtensionInfo is loader.ExtensionInfo
    assert kernels.can_run_fused is loader.can_run_fused


def test_extension_info_is_a_frozen_dataclass():
    info = loader.ExtensionInfo(False, "why", None, None)
    with pytest.raises(FrozenInstanceError):
        info.loaded = True  # type: ignore[misc]


def test_unexpected_exception_in_checks_never_raises(monkeypatch):
    no_real_build(monkeypatch)

    def broken():
        raise ValueError("something odd")

    monkeypatch.setattr(toolchain, "check", broken)
    info = kernels.extension_info()
    assert not info.loaded and info.reason
    assert "something odd" in info.reason


def test_cli_reports_and_fails_without_toolchain(monkeypatch, capsys):
    no_real_build(monkeypatch)
    torch_built_for(monkeypatch, None)
    assert loader.main([]) == 1
    assert "CPU-only" in capsys.readouterr().out


def test_extension_or_none(monkeypatch, fake_toolchain):
    sentinel = type(sys)("fake_ext")
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: sentinel)
    assert loader.extension_or_none() is sentinel


def test_extension_or_none_without_toolchain(monkeypatch):
    no_real_build(monkeypatch)
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

