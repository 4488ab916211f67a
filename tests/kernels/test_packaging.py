"""The CUDA sources ship inside the wheel, where the loader finds them.

A non-editable install has no repository ``csrc/`` next to the package; the extension
can only be built on first use if ``lightning_cafin/csrc`` holds every source and
header the loader compiles and hashes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from lightning_cafin.kernels import loader

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(REPO)],
        check=True,
        capture_output=True,
    )
    (path,) = out.glob("lightning_cafin-*.whl")
    return path


def test_wheel_holds_every_source_the_loader_compiles(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    wanted = {f"lightning_cafin/csrc/{f}" for f in loader._SOURCES + loader._HEADERS}
    assert wanted <= names, sorted(wanted - names)


def test_installed_wheel_loader_uses_packaged_csrc(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    found = subprocess.run(
        [sys.executable, "-c", "from lightning_cafin.kernels import loader; print(loader._CSRC_DIR)"],
        check=True,
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    ).stdout.strip()
    assert Path(found) == target / "lightning_cafin" / "csrc"
