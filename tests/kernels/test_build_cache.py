"""The build cache: one folder per toolchain, Python and install."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest
import torch

from lightning_cafin.kernels import build_cache

from .fakes import toolchain_for

pytestmark = pytest.mark.usefixtures("fresh_loader")


def test_build_dir_is_keyed_on_versions_and_arch(monkeypatch, fake_toolchain):
    tool = toolchain_for(str(fake_toolchain))
    first = build_cache.build_directory(tool)
    assert torch.__version__.split("+")[0] in first.name
    assert "cu130" in first.name
    assert build_cache.build_directory(replace(tool, arch_list="8.0;9.0")) != first
    assert build_cache.build_directory(replace(tool, cuda_home="/opt/other-cuda")) != first
    assert build_cache.build_directory(replace(tool, host_compiler="c++ 13")) != first
    assert build_cache.build_directory(replace(tool)) == first
    # Where a piece came from names it in messages only: the same build, the same folder.
    assert build_cache.build_directory(replace(tool, cuda_home_source="CUDA_PATH", arch_source="visible GPUs")) == first


def test_two_environments_get_two_cache_folders(monkeypatch):
    first = build_cache.build_directory(toolchain_for())
    monkeypatch.setattr(sys, "prefix", "/some/other/venv")
    assert build_cache.build_directory(toolchain_for()) != first


def test_python_version_keys_the_cache(monkeypatch):
    first = build_cache.build_key(toolchain_for())
    monkeypatch.setattr(sys, "version", "3.99.0 (fake)")
    assert build_cache.build_key(toolchain_for())["python"] != first["python"]

