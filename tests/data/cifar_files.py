"""Writing CIFAR python-format files (random pixels, never zeros) in each layout the reader accepts."""

from __future__ import annotations

import io
import pickle
import tarfile
from pathlib import Path

import numpy as np

SPEC = {
    "cifar10": ("cifar-10-batches-py", "cifar-10-python.tar.gz", [f"data_batch_{i}" for i in range(1, 6)],
                ["test_batch"], b"labels", 10),
    "cifar100": ("cifar-100-python", "cifar-100-python.tar.gz", ["train"], ["test"], b"fine_labels", 100),
}


def make_batches(name: str, per_file: int = 6, seed: int = 0) -> dict[str, dict]:
    """Batch name -> the dict pickled in it, with random uint8 rows and labels."""
    _, _, train, test, key, classes = SPEC[name]
    rng = np.random.default_rng(seed)
    out = {}
    for f in train + test:
        out[f] = {
            b"data": rng.integers(1, 256, (per_file, 3072), dtype=np.uint8),
            key: rng.integers(0, classes, per_file).tolist(),
        }
    return out


def write_cifar(root: Path, name: str = "cifar10", layout: str = "folder", per_file: int = 6, seed: int = 0) -> dict:
    """Write the files under ``root`` as ``folder`` (extracted), ``flat`` (batches in root) or ``archive``."""
    folder, archive, *_ = SPEC[name]
    batches = make_batches(name, per_file, seed)
    root.mkdir(parents=True, exist_ok=True)
    if layout == "archive":
        with tarfile.open(root / archive, "w:gz") as tar:
            for f, batch in batches.items():
                raw = pickle.dumps(batch)
                info = tarfile.TarInfo(f"{folder}/{f}")
                info.size = len(raw)
                tar.addfile(info, io.BytesIO(raw))
        return batches
    target = root / folder if layout == "folder" else root
    target.mkdir(parents=True, exist_ok=True)
    for f, batch in batches.items():
        (target / f).write_bytes(pickle.dumps(batch))
    return batches
