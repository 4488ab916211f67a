"""Where builds are kept: one folder per build key under the cache root.

The root is ``$LIGHTNING_CAFIN_BUILD_DIR`` or ``~/.cache/lightning_cafin/``.  The key
holds everything that makes one build differ from another (sources and flags, torch,
CUDA, nvcc, architecture list, host compiler, Python and install location), so that two
installs (a checkout and a pip-installed copy) never evict each other.

Each build is about 8 MB, and every change of the sources or of torch makes a new one, so
after a build :func:`prune_superseded` removes the install's older builds beyond the newest
few (``$LIGHTNING_CAFIN_KEEP_BUILDS``, default 2: switching back to a recent checkout
should not cost a rebuild).  Builds of other installs are never touched: their key names
another folder or environment, which may still load them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional

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


KEEP_ENV = "LIGHTNING_CAFIN_KEEP_BUILDS"
DEFAULT_KEEP = 2
#: a folder touched this recently may be another process's build in progress: never removed
_BUSY_SECONDS = 600
_BUILD_NAME = re.compile(r"^torch.+-cu.+-nvcc.+-[0-9a-f]{16}$")


def builds_to_keep() -> int:
    """``$LIGHTNING_CAFIN_KEEP_BUILDS`` (a whole number of superseded builds kept), else 2."""
    raw = os.environ.get(KEEP_ENV, "").strip()
    if not raw:
        return DEFAULT_KEEP
    try:
        keep = int(raw)
    except ValueError:
        keep = -1
    if keep < 0:
        raise ValueError(f"the environment variable {KEEP_ENV} must be a whole number of builds to keep (0 or more), "
                         f"got {raw!r}")
    return keep


def _install_of(folder: Path) -> Optional[str]:
    try:
        key = json.loads((folder / "key.json").read_text())
    except (OSError, ValueError):
        return None
    return key.get("install") if isinstance(key, dict) else None


def prune_superseded(current: Path, keep: Optional[int] = None) -> list[Path]:
    """Remove the builds that ``current``'s install made before it, beyond the ``keep`` most
    recently changed ones; returns the folders removed.

    Only folders named like a build, whose ``key.json`` names the same install (package
    folder and environment) as ``current``'s, and untouched for ten minutes (another
    process may be building there) are candidates.  Errors leave a folder in place.
    """
    keep = builds_to_keep() if keep is None else keep
    install = _install_of(current)
    if install is None or not current.parent.is_dir():
        return []
    now = time.time()
    superseded = []
    for folder in current.parent.iterdir():
        if folder == current or not folder.is_dir() or not _BUILD_NAME.match(folder.name):
            continue
        if _install_of(folder) != install:
            continue
        try:
            changed = folder.stat().st_mtime
        except OSError:
            continue
        if now - changed >= _BUSY_SECONDS:
            superseded.append((changed, folder))
    superseded.sort(reverse=True)  # newest first
    removed = []
    for _, folder in superseded[keep:]:
        shutil.rmtree(folder, ignore_errors=True)
        if not folder.exists():
            removed.append(folder)
    return removed
