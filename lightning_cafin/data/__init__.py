"""Real datasets read from local files (downloaded only when asked), and their datamodules."""

from .cifar import load_cifar
from .datamodules import CIFARDataModule, IDXDataModule
from .download import DownloadError, download_cifar, download_idx
from .idx import DEBIAN_FASHION_MNIST, DataNotFoundError, find_idx_files, load_idx_dataset, load_idx_split, read_idx

__all__ = [
    "CIFARDataModule",
    "DEBIAN_FASHION_MNIST",
    "DataNotFoundError",
    "DownloadError",
    "IDXDataModule",
    "download_cifar",
    "download_idx",
    "find_idx_files",
    "load_cifar",
    "load_idx_dataset",
    "load_idx_split",
    "read_idx",
]
