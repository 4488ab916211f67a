"""MNIST-format (IDX) files: Fashion-MNIST and MNIST, found where people keep them.

Looked for, in order: the given root itself, torchvision's layout under it
(``<root>/FashionMNIST/raw``), and Debian's ``dataset-fashion-mnist`` package path.
Files may be gzip-compressed or not.  Nothing is ever downloaded.
"""

from __future__ import annotations

import gzip
import os
from pathlib import Path
from typing import Optional, Union

import numpy as np
import torch

DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")

_DTYPES = {code: np.dtype(t) for code, t in
           {0x08: "u1", 0x09: "i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}.items()}
_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
_LAYOUTS = {"fashion-mnist": "FashionMNIST", "mnist": "MNIST"}


class DataNotFoundError(FileNotFoundError):
    """The IDX files are in none of the places looked at; the message says where and how to get them."""


def read_idx(path: Union[str, Path]) -> torch.Tensor:
    """Read one IDX file (gzip-compressed or plain, told by its content) into a tensor of its dtype and shape."""
    path = Path(path)
    data = path.read_bytes()
    if data[:2] == b"\x1f\x8b":  # the gzip magic number, whatever the file is called
        data = gzip.decompress(data)
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _DTYPES:
        raise ValueError(f"{path} is not an IDX file (bad magic number {data[:4]!r})")
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    arr = np.frombuffer(data, dtype=_DTYPES[data[2]], offset=4 + 4 * ndim)
    if arr.size != int(np.prod(dims)):
        raise ValueError(f"{path}: header says {dims} but holds {arr.size} values (truncated download?)")
    return torch.from_numpy(arr.astype(arr.dtype.newbyteorder("="), copy=True).reshape(dims))


def _candidates(root: Optional[Union[str, Path]], name: str) -> list[Path]:
    places = []
    if root is not None:
        root = Path(root).expanduser()
        places += [root, root / _LAYOUTS.get(name, name) / "raw"]
    env = os.environ.get("CAFIN_DATA_DIR")
    if env:
        places += [Path(env), Path(env) / _LAYOUTS.get(name, name) / "raw"]
    if name == "fashion-mnist":
        places.append(DEBIAN_FASHION_MNIST)
    return places


def _find(folder: Path, stem: str) -> Optional[Path]:
    for candidate in (folder / f"{stem}.gz", folder / stem):
        if candidate.is_file():
            return candidate
    return None


def find_idx_files(name: str = "fashion-mnist", split: str = "train",
                   root: Optional[Union[str, Path]] = None) -> tuple[Path, Path]:
    """(images, labels) paths of ``split`` ('train' or 'test'), or a :class:`DataNotFoundError`."""
    if split not in _FILES:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    images, labels = _FILES[split]
    places = _candidates(root, name)
    for folder in places:
        image_file, label_file = _find(folder, images), _find(folder, labels)
        if image_file is not None and label_file is not None:
            return image_file, label_file
    looked = "\n  ".join(str(p) for p in places) or "(no place: pass root=...)"
    hint = (
        "On Debian/Ubuntu: sudo apt-get install dataset-fashion-mnist (installs to "
        f"{DEBIAN_FASHION_MNIST}). Or put {images}[.gz] and {labels}[.gz] in a folder and pass it as root."
        if name == "fashion-mnist"
        else f"Put {images}[.gz] and {labels}[.gz] in a folder and pass it as root."
    )
    raise DataNotFoundError(f"{name} {split} files not found. Looked in:\n  {looked}\n{hint}")


def load_idx_split(name: str = "fashion-mnist", split: str = "train",
                   root: Optional[Union[str, Path]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Images as stored, uint8 with a channel dim ``(N, 1, H, W)``, and labels as int64."""
    images_path, labels_path = find_idx_files(name, split, root)
    images, labels = read_idx(images_path), read_idx(labels_path).long()
    if images.dim() != 3 or images.shape[0] != labels.shape[0]:
        raise ValueError(f"{images_path} holds {tuple(images.shape)} images for {labels.shape[0]} labels "
                         f"in {labels_path}")
    return images.unsqueeze(1).contiguous(), labels


def load_idx_dataset(name: str = "fashion-mnist", split: str = "train",
                     root: Optional[Union[str, Path]] = None) -> torch.utils.data.TensorDataset:
    """Images as float32 in [0, 1] with a channel dim ``(N, 1, 28, 28)``, labels as int64."""
    images, labels = load_idx_split(name, split, root)
    return torch.utils.data.TensorDataset(images.float().div_(255.0), labels)
