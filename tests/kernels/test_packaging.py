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

from lightning_cafin.kernels import sources

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


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """The wheel pip-installed into a folder of its own (a non-editable install, no checkout beside it)."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
    )
    return target


def test_wheel_holds_every_source_the_loader_compiles(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    wanted = {f"lightning_cafin/csrc/{f}" for f in sources.source_files() + sources.header_files()}
    assert wanted <= names, sorted(wanted - names)


def test_installed_wheel_loader_uses_packaged_csrc(installed, tmp_path):
    target = installed
    env = {**os.environ, "PYTHONPATH": str(target)}
    found = subprocess.run(
        [sys.executable, "-c", "from lightning_cafin.kernels import sources; print(sources.sources_dir())"],
        check=True,
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    ).stdout.strip()
    assert Path(found) == target / "lightning_cafin" / "csrc"


def test_installed_copy_and_checkout_never_share_a_cache_folder(installed, tmp_path):
    """The cache key holds the install location: a pip-installed copy cannot evict the checkout's build."""
    target = installed
    code = ("from lightning_cafin.kernels.build_cache import build_directory\n"
            "from lightning_cafin.kernels.toolchain import Toolchain\n"
            "print(build_directory(Toolchain(cuda_home='/usr/local/cuda', cuda_home_source='CUDA_HOME', "
            "nvcc='/usr/local/cuda/bin/nvcc', nvcc_version='13.0', arch_list='9.0', arch_source='TORCH_CUDA_ARCH_LIST', "
            "host_compiler='c++')))")
    folders = []
    for where in (target, REPO):
        out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": str(where), "LIGHTNING_CAFIN_BUILD_DIR": str(tmp_path)},
                             cwd=tmp_path).stdout.strip()
        folders.append(Path(out))
    assert folders[0] != folders[1]
    assert folders[0].parent == folders[1].parent == tmp_path
    # Same sources, same toolchain: only the install location differs.
    assert folders[0].name.rsplit("-", 1)[0] == folders[1].name.rsplit("-", 1)[0]


def test_wheel_without_build_request_is_pure_python(wheel):
    assert wheel.name.endswith("-py3-none-any.whl")
    assert not any(n.startswith("lightning_cafin/kernels/prebuilt/") for n in zipfile.ZipFile(wheel).namelist())
