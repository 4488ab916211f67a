"""The extension builds from NVIDIA's pip wheels with the system CUDA toolkit really hidden.

``scripts/hide_system_cuda.sh`` runs the build in a private mount namespace where every
``/usr/local/cuda*`` is an empty tmpfs and every ``nvcc`` on PATH is ``/dev/null``.  Needs
root (or passwordless sudo) and ``lightning-cafin[cuda-build]`` installed; ``.ci/run`` has
both and builds first, so here the build is found in the cache (a few seconds; about 3.5
minutes on a 2-core CPU when it is not).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
HIDE = REPO / "scripts" / "hide_system_cuda.sh"


def _can_hide() -> bool:
    if sys.platform != "linux":
        return False
    return subprocess.run([str(HIDE), "true"], capture_output=True).returncode == 0


def _has_wheels() -> bool:
    spec = importlib.util.find_spec("nvidia")
    return spec is not None and any(
        (Path(p) / f"cu{str(torch.version.cuda).split('.')[0]}" / "bin" / "nvcc").is_file()
        for p in spec.submodule_search_locations or []
    )


@pytest.mark.slow
@pytest.mark.skipif(torch.version.cuda is None, reason="a CPU-only torch has no extension to build")
@pytest.mark.skipif(not _has_wheels(), reason='needs pip install "lightning-cafin[cuda-build]" (.ci/run does it)')
@pytest.mark.skipif(not _can_hide(), reason="needs root or passwordless sudo for unshare -m")
def test_build_without_a_system_toolkit_gives_a_loadable_extension():
    probe = (
        "import shutil, sys; from lightning_cafin.kernels import loader; "
        "assert shutil.which('nvcc') is None, shutil.which('nvcc'); "
        "ext = loader.extension_or_none(); info = loader.extension_info(); print(info.reason); "
        "sys.exit(0 if ext is not None and hasattr(ext, 'adafisher_step_') else 1)"
    )
    env = {**os.environ, "TORCH_CUDA_ARCH_LIST": os.environ.get("TORCH_CUDA_ARCH_LIST", "9.0")}
    env.pop("CUDA_HOME", None)
    env.pop("CUDA_PATH", None)
    done = subprocess.run([str(HIDE), sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "nvcc from NVIDIA's pip wheels" in done.stdout
    assert "hidden: /usr/local/cuda" in done.stderr or "hidden:" in done.stderr
