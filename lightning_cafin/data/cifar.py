"""CIFAR-10 / CIFAR-100 in the "python version" format, read from local files.

Accepted layouts, looked for in this order under each place: the extracted folder
(``cifar-10-batches-py/`` or ``cifar-100-python/``, torchvision's layout too), the
batch files directly in the place itself, or the unextracted ``.tar.gz`` archive
(read in memory, never unpacked to disk).  Places: the given root, then
``$CAFIN_DATA_DIR``.  Nothing is downloaded here (see :mod:`.download`).
"""

from __future__ import annotations

import io
import os
import pickle
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import torch

from .idx import DataNotFoundError

@dataclass(frozen=True)
class _Layout:
    """Where one CIFAR variant keeps its batches, and what they hold."""

    folder: str
    archive: str
    train: tuple[str, ...]
    test: tuple[str, ...]
    labels: bytes  # the batch dict's key of the labels
    classes: int

    def files(self, split: str) -> tuple[str, ...]:
        return self.train if split == "train" else self.test


_LAYOUT = {
    "cifar10": _Layout(
        folder="cifar-10-batches-py",
        archive="cifar-10-python.tar.gz",
        train=tuple(f"data_batch_{i}" for i in range(1, 6)),
        test=("test_batch",),
        labels=b"labels",
        classes=10,
    ),
    "cifar100": _Layout(
        folder="cifar-100-python",
        archive="cifar-100-python.tar.gz",
        train=("train",),
        test=("test",),
        labels=b"fine_labels",
        classes=100,
    ),
}

#: Per-channel mean and standard deviation of the CIFAR-10 training images (the usual constants).
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


def _places(root: Optional[Union[str, Path]]) -> list[Path]:
    places = [Path(root).expanduser()] if root is not None else []
    env = os.environ.get("CAFIN_DATA_DIR")
    if env:
        places.append(Path(env))
    return places


def _unpickle(raw: bytes, source: str) -> dict[bytes, Any]:
    try:
        batch = pickle.loads(raw, encoding="bytes")
    except Exception as exc:  # pickle raises many types for a damaged file
        raise ValueError(f"{source} is not a CIFAR python-format batch ({exc})") from exc
    if not isinstance(batch, dict) or b"data" not in batch:
        raise ValueError(f"{source} is not a CIFAR python-format batch (no b'data' entry)")
    return batch


def _read_batches(name: str, split: str, place: Path) -> Optional[list[dict[bytes, Any]]]:
    spec = _LAYOUT[name]
    for folder in (place / spec.folder, place):
        paths = [folder / f for f in spec.files(split)]
        if all(p.is_file() for p in paths):
            return [_unpickle(p.read_bytes(), str(p)) for p in paths]
    archive = place / spec.archive
    if archive.is_file():
        with tarfile.open(archive, "r:gz") as tar:
            out = []
            for f in spec.files(split):
                member = tar.extractfile(f"{spec.folder}/{f}")
                if member is None:
                    raise ValueError(f"{archive} has no {spec.folder}/{f}")
                out.append(_unpickle(member.read(), f"{archive}:{f}"))
            return out
    return None


def load_cifar(name: str = "cifar10", split: str = "train",
               root: Optional[Union[str, Path]] = None) -> torch.utils.data.TensorDataset:
    """Images as uint8 ``(N, 3, 32, 32)``, labels as int64; a :class:`DataNotFoundError` naming where it looked."""
    if name not in _LAYOUT:
        raise ValueError(f"name must be one of {sorted(_LAYOUT)}, got {name!r}")
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    places = _places(root)
    for place in places:
        batches = _read_batches(name, split, place)
        if batches is None:
            continue
        data = np.concatenate([b[b"data"] for b in batches])
        labels = np.concatenate([np.asarray(b[_LAYOUT[name].labels], dtype=np.int64) for b in batches])
        if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or data.shape[0] != labels.shape[0]:
            raise ValueError(f"{place}: {name} {split} data has shape {data.shape} for {labels.shape[0]} labels; "
                             "expected (N, 3072) uint8 rows")
        images = torch.from_numpy(np.ascontiguousarray(data, dtype=np.uint8)).view(-1, 3, 32, 32)
        return torch.utils.data.TensorDataset(images, torch.from_numpy(labels))
    spec = _LAYOUT[name]
    looked = "\n  ".join(str(p) for p in places) or "(nowhere: pass root=... or set CAFIN_DATA_DIR)"
    raise DataNotFoundError(
        f"{name} {split} files not found. Looked in:\n  {looked}\n"
        f"for {spec.folder}/ (python version), its batch files, or {spec.archive}. "
        f"Get {spec.archive} from https://www.cs.toronto.edu/~kriz/cifar.html and put it in a folder "
        "passed as root, or pass download=True to the datamodule."
    )


def num_classes(name: str) -> int:
    """10 or 100: the number of classes of ``cifar10`` / ``cifar100``."""
    return _LAYOUT[name].classes
