"""The extension's sources: where ``csrc/`` is, which files it compiles and hashes, and the flags.

``csrc/`` is found by glob, so a new ``.cu`` or header needs no edit here: every
``*.cpp`` / ``*.cu`` is compiled and every ``*.cpp|*.cu|*.h|*.cuh`` keys the build cache
(:func:`source_hash`), together with the compiler flags.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Optional

#: The module name of the compiled extension (``lightning_cafin_C*.so``).
EXTENSION_NAME = "lightning_cafin_C"

_SOURCE_PATTERNS = ("*.cpp", "*.cu")  # compiled
_HEADER_PATTERNS = ("*.h", "*.cuh")  # hashed into the cache key
#: Files every build needs (a wheel without them cannot build).
REQUIRED = ("bindings.cpp", "adafisher_step.cu")

# Plain -O3: never --use_fast_math (it replaces IEEE division, and the fused step
# must round like the unfused reference).
EXTRA_CFLAGS = ("-O3",)
EXTRA_CUDA_CFLAGS = ("-O3", "-lineinfo")
FORBIDDEN_CUDA_FLAGS = ("--use_fast_math", "-use_fast_math", "--prec-div=false", "-prec-div=false")


def _find_csrc() -> Path:
    """``lightning_cafin/csrc`` when shipped as package data, else the repository's ``csrc``."""
    package_dir = Path(__file__).resolve().parent.parent
    for candidate in (package_dir / "csrc", package_dir.parent / "csrc"):
        if (candidate / "adafisher_step.cu").is_file():
            return candidate
    return package_dir.parent / "csrc"


_CSRC_DIR = _find_csrc()


def sources_dir() -> Path:
    """The ``csrc`` folder this copy of the package builds from (found once, at import).

    Inside an installed wheel it is ``lightning_cafin/csrc`` (package data); in a
    checkout, the repository's ``csrc/``.
    """
    return _CSRC_DIR


def source_files(csrc: Optional[Path] = None) -> list[str]:
    """The files compiled into the extension (``csrc/*.cpp`` and ``*.cu``), sorted."""
    root = _CSRC_DIR if csrc is None else csrc
    return sorted({p.name for pattern in _SOURCE_PATTERNS for p in root.glob(pattern)})


def header_files(csrc: Optional[Path] = None) -> list[str]:
    """The headers whose contents key the build cache (``csrc/*.h`` and ``*.cuh``), sorted."""
    root = _CSRC_DIR if csrc is None else csrc
    return sorted({p.name for pattern in _HEADER_PATTERNS for p in root.glob(pattern)})


def source_hash(csrc: Optional[Path] = None) -> str:
    """sha256 of every source and header in ``csrc`` (names and contents) and the compiler flags."""
    root = _CSRC_DIR if csrc is None else csrc
    digest = hashlib.sha256()
    for name in source_files(root) + header_files(root):
        digest.update(name.encode() + b"\0")
        digest.update((root / name).read_bytes())
    # Lists, as the flags were first written: the repr keys every existing cache folder.
    digest.update(repr((list(EXTRA_CFLAGS), list(EXTRA_CUDA_CFLAGS))).encode())
    return digest.hexdigest()


def missing_required(csrc: Optional[Path] = None) -> list[str]:
    """The files of :data:`REQUIRED` that ``csrc`` lacks ([] when it can build)."""
    root = _CSRC_DIR if csrc is None else csrc
    return [name for name in REQUIRED if not (root / name).is_file()]
