"""Downloading the datasets, only when asked (``download=True``).

Every file is fetched to a temporary name, checked by actually reading it (IDX header
against size; CIFAR archive members unpickled), and only then renamed into place, so an
interrupted or wrong download never looks like data.  Progress is printed as it goes.
"""

from __future__ import annotations

import shutil
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Optional, Union

#: Where each dataset's files are published.  Overridable per call (``base_url=``).
BASE_URLS = {
    "fashion-mnist": "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
    "mnist": "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "cifar10": "https://www.cs.toronto.edu/~kriz/",
    "cifar100": "https://www.cs.toronto.edu/~kriz/",
}
IDX_FILES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
             "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")
CIFAR_ARCHIVES = {"cifar10": "cifar-10-python.tar.gz", "cifar100": "cifar-100-python.tar.gz"}


class DownloadError(RuntimeError):
    """A file could not be fetched or was not what it should be; the message names the URL."""


def _fetch(url: str, dest: Path, check: Callable[[Path], None], timeout: float = 60.0) -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    print(f"downloading {url}", file=sys.stderr, flush=True)
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response, open(part, "wb") as out:
            total = int(response.headers.get("Content-Length") or 0)
            done, next_report = 0, 0.1
            while chunk := response.read(1 << 20):
                out.write(chunk)
                done += len(chunk)
                if total and done / total >= next_report:
                    print(f"  {dest.name}: {done / 2**20:.1f} / {total / 2**20:.1f} MB", file=sys.stderr, flush=True)
                    next_report += 0.1
    except (urllib.error.URLError, OSError, ValueError) as exc:
        part.unlink(missing_ok=True)
        raise DownloadError(
            f"could not download {url} ({exc}). If this machine is offline, fetch the file elsewhere and put it "
            f"at {dest}."
        ) from exc
    try:
        check(part)
    except Exception as exc:
        part.unlink(missing_ok=True)
        raise DownloadError(f"{url} did not give a valid {dest.name}: {exc}") from exc
    shutil.move(str(part), dest)
    return dest


def _check_idx(path: Path) -> None:
    from .idx import read_idx

    read_idx(path)


def download_idx(name: str, root: Union[str, Path], base_url: Optional[str] = None) -> Path:
    """Fetch the four IDX files of ``name`` ('fashion-mnist' or 'mnist') into ``root``; present files are kept."""
    if name not in ("fashion-mnist", "mnist"):
        raise ValueError(f"name must be 'fashion-mnist' or 'mnist', got {name!r}")
    root = Path(root).expanduser()
    base = base_url or BASE_URLS[name]
    for f in IDX_FILES:
        if not (root / f).is_file():
            _fetch(base + f, root / f, _check_idx)
    return root


def _check_cifar(name: str) -> Callable[[Path], None]:
    def check(path: Path) -> None:
        import tarfile

        from .cifar import _LAYOUT, _unpickle

        spec = _LAYOUT[name]
        with tarfile.open(path, "r:gz") as tar:
            for f in spec.train + spec.test:
                member = tar.extractfile(f"{spec.folder}/{f}")
                if member is None:
                    raise ValueError(f"the archive has no {spec.folder}/{f}")
                _unpickle(member.read(), f)

    return check


def download_cifar(name: str, root: Union[str, Path], base_url: Optional[str] = None) -> Path:
    """Fetch ``cifar-10-python.tar.gz`` / ``cifar-100-python.tar.gz`` into ``root`` (read in place, not unpacked)."""
    if name not in CIFAR_ARCHIVES:
        raise ValueError(f"name must be one of {sorted(CIFAR_ARCHIVES)}, got {name!r}")
    root = Path(root).expanduser()
    dest = root / CIFAR_ARCHIVES[name]
    if not dest.is_file():
        _fetch((base_url or BASE_URLS[name]) + CIFAR_ARCHIVES[name], dest, _check_cifar(name))
    return root
