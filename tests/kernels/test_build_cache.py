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



def _fake_build(root, name, install, age_s):
    import json
    import os
    import time

    folder = root / name
    folder.mkdir()
    (folder / "key.json").write_text(json.dumps({"install": install, "source": name}))
    (folder / "lightning_cafin_C.so").write_bytes(b"\0" * 16)
    stamp = time.time() - age_s
    os.utime(folder, (stamp, stamp))
    return folder


def test_a_build_prunes_its_installs_older_builds_beyond_the_newest_few(tmp_path, monkeypatch):
    digits = iter(f"{i:016x}" for i in range(1, 100))

    def name():
        return f"torch2.14.1_cu130-cu130-nvcc130-cpython-311-{next(digits)}"

    mine, theirs = "/checkout/lightning_cafin|/venv", "/other/lightning_cafin|/venv"
    current = _fake_build(tmp_path, name(), mine, 0)
    old = [_fake_build(tmp_path, name(), mine, 3600 * (i + 1)) for i in range(5)]  # newest first
    other_install = _fake_build(tmp_path, name(), theirs, 10 * 3600)
    building_now = _fake_build(tmp_path, name(), mine, 60)  # touched a minute ago: maybe another process's build
    not_ours = tmp_path / "cuda-home-from-wheels-0123456789ab"
    not_ours.mkdir()
    unreadable = _fake_build(tmp_path, name(), mine, 20 * 3600)
    (unreadable / "key.json").write_text("{not json")

    monkeypatch.delenv(build_cache.KEEP_ENV, raising=False)
    removed = build_cache.prune_superseded(current)
    assert sorted(removed) == sorted(old[2:])  # the default keeps the two newest older builds
    left = {p for p in tmp_path.iterdir()}
    assert left == {current, *old[:2], other_install, building_now, not_ours, unreadable}
    assert (current / "lightning_cafin_C.so").exists()

    monkeypatch.setenv(build_cache.KEEP_ENV, "0")
    assert sorted(build_cache.prune_superseded(current)) == sorted(old[:2])
    assert other_install.exists() and building_now.exists()


@pytest.mark.parametrize("value", ["-1", "two", "1.5"])
def test_a_bad_keep_setting_is_an_error_naming_it(monkeypatch, value):
    monkeypatch.setenv(build_cache.KEEP_ENV, value)
    with pytest.raises(ValueError, match=f"{build_cache.KEEP_ENV} must be a whole number.*{value!r}"):
        build_cache.builds_to_keep()
