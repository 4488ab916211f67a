"""Where builds are kept: one folder per build key under the cache root.

The root is ``$LIGHTNING_CAFIN_BUILD_DIR`` or ``~/.cache/lightning_cafin/``.  The key
holds everything that makes one build differ from another (sources and flags, torch,
CUDA, nvcc, architecture list, host compiler, Python and install location), so that two
installs (a checkout and a pip-installed copy) never evict each other.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .sources import source_hash

if TYPE_CHECKING:  # pragma: no cover
    from .toolchain import Toolchain


def cache_root() -> Path:
    """``$LIGHTNING_CAFIN_BUILD_DIR`` (read on each call), else ``~/.cache/lightning_cafin``."""
    env = os.environ.get("LIGHTNING_CAFIN_BUILD_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "lightning_cafin"


def _install_location() -> str:
    """Which copy of the package this is: its folder and the interpreter environment."""
    return f"{Path(__file__).resolve().parent.parent}|{sys.prefix}"


def build_key(tool: Toolchain) -> dict[str, str]:
    """Everything that makes one build differ from another (the cache folder is its hash)."""
    return {
        "source": source_hash(),
        "torch": torch.__version__,
        "torch_cuda": str(torch.version.cuda),
        "nvcc": f"{tool.nvcc_version} {tool.cuda_home}",
        "arch": tool.arch_list,
        "host_compiler": tool.host_compiler,
        "python": f"{sys.implementation.cache_tag} {sys.version.split()[0]}",
        "install": _install_location(),
    }


def build_directory(tool: Toolchain) -> Path:
    """The cache folder of a build with ``tool``: readable versions, then the key's hash.

    ``torch<version>-cu<torch's CUDA>-nvcc<version>-<python tag>-<16 hex digits>``.
    """
    key = build_key(tool)
    torch_tag = re.sub(r"[^A-Za-z0-9_.]", "_", torch.__version__)
    cuda_tag = "cu" + str(torch.version.cuda).replace(".", "")
    nvcc_tag = "nvcc" + tool.nvcc_version.replace(".", "")
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    name = f"torch{torch_tag}-{cuda_tag}-{nvcc_tag}-{sys.implementation.cache_tag}-{digest}"
    return cache_root() / name
