"""A copy of the extension built ahead of time into the installed package.

``LIGHTNING_CAFIN_BUILD=1 pip install .`` runs ``python -m lightning_cafin.kernels.loader
--build --output <package>/kernels/prebuilt``, which writes the module and a
``build.json`` with its :func:`runtime_key` (:func:`write_prebuilt`).  The loader takes
that copy (:func:`find_prebuilt`) only while it matches this torch, CUDA, Python and
sources and was built for every visible GPU; the toolchain no longer matters then.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Optional

import torch

from .build_cache import build_key
from .info import ExtensionInfo
from .sources import EXTENSION_NAME, source_hash
from .toolchain import Toolchain, visible_capabilities

#: Where a copy built ahead of time lives inside the installed package (read on each call).
PREBUILT_DIR = Path(__file__).resolve().parent / "prebuilt"


def runtime_key() -> dict[str, str]:
    """What a prebuilt copy must match to be loaded here (the toolchain no longer matters)."""
    return {
        "source": source_hash(),
        "torch": torch.__version__,
        "torch_cuda": str(torch.version.cuda),
        "python": sys.implementation.cache_tag,
    }


def _arch_covers(arch_list: str) -> bool:
    """Whether code built for ``arch_list`` runs on every visible GPU (True without a GPU)."""
    built = [a.strip() for a in arch_list.replace(",", ";").split(";") if a.strip()]
    for major, minor in visible_capabilities():
        cap = f"{major}.{minor}"
        same = any(a.split("+")[0] == cap for a in built)
        ptx_below = any(a.endswith("+PTX") and float(a.split("+")[0]) <= float(cap) for a in built)
        if not (same or ptx_below):
            return False
    return True


def import_extension(path: Path) -> ModuleType:
    """Import the compiled module at ``path`` under the extension's name."""
    spec = importlib.util.spec_from_file_location(EXTENSION_NAME, str(path))
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def find_prebuilt() -> Optional[tuple[ModuleType, ExtensionInfo]]:
    """The copy in :data:`PREBUILT_DIR` and how it was found, when it fits; else None.

    Never raises: a stale or broken copy is treated as absent (the loader then builds).
    """
    meta_path = PREBUILT_DIR / "build.json"
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
        if meta.get("runtime_key") != runtime_key() or not _arch_covers(meta.get("arch", "")):
            return None
        module = import_extension(PREBUILT_DIR / meta["file"])
    except Exception:  # a stale or broken copy: build as if it were not there
        return None
    reason = (f"loaded the copy built at install time from {PREBUILT_DIR} (torch {torch.__version__}, "
              f"CUDA {torch.version.cuda}, arch {meta.get('arch')})")
    return module, ExtensionInfo(True, reason, str(PREBUILT_DIR), None)


def write_prebuilt(module: ModuleType, tool: Toolchain, output: Path) -> Path:
    """Copy the built module to ``output`` with the key :func:`find_prebuilt` checks; returns the copy."""
    output.mkdir(parents=True, exist_ok=True)
    source = Path(module.__file__ or "")
    shutil.copy2(source, output / source.name)
    meta = {"runtime_key": runtime_key(), "arch": tool.arch_list, "file": source.name,
            "built_with": build_key(tool)}
    (output / "build.json").write_text(json.dumps(meta, indent=2) + "\n")
    return output / source.name
