"""Lightning datamodules over real image datasets held in memory.

Images stay ``uint8`` until they reach the training device, where
``on_after_batch_transfer`` scales, normalises and (for training batches, when asked)
augments them for the whole batch at once: a 2-core CPU host never becomes the
bottleneck of a GPU run, and no worker processes are needed.

Validation uses the dataset's test split unless ``val_size`` holds images out of the
training split (then the test split is left for ``cafin test``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional, Sequence, Union

import torch
from lightning.pytorch import LightningDataModule
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset
from typing_extensions import override

from .augment import prepare_batch
from .cifar import CIFAR_MEAN, CIFAR_STD, load_cifar
from .download import download_cifar, download_idx
from .idx import find_idx_files, load_idx_split

#: Where ``download=True`` puts files when no ``root`` is given.
DEFAULT_DOWNLOAD_ROOT = Path("data")

#: A split as setup() makes it: the loaded tensors, or a subset of them (both have a length).
_Split = Union[TensorDataset, Subset[tuple[Tensor, ...]]]

#: Per-dataset (mean, std) of the training images, for normalisation.
IDX_STATS = {"fashion-mnist": ((0.2860,), (0.3530,)), "mnist": ((0.1307,), (0.3081,))}


def _positive(name: str, value: Optional[int], allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer{' or None' if allow_none else ''}, got {value!r}")


class _InMemoryImageDataModule(LightningDataModule):
    """Shared loaders and on-device preprocessing; subclasses read their files in ``_load``."""

    mean: Sequence[float] = ()
    std: Sequence[float] = ()
    #: zero padding of the random crop when ``augment`` is on
    crop_padding: int = 4

    def __init__(self, root: Optional[str], batch_size: int, eval_batch_size: Optional[int], val_size: int,
                 train_subset: Optional[int], val_subset: Optional[int], augment: bool, normalize: bool,
                 download: bool, num_workers: int, seed: int) -> None:
        super().__init__()
        _positive("batch_size", batch_size, allow_none=False)
        _positive("eval_batch_size", eval_batch_size)
        _positive("train_subset", train_subset)
        _positive("val_subset", val_subset)
        if isinstance(val_size, bool) or not isinstance(val_size, int) or val_size < 0:
            raise ValueError(f"val_size must be an integer >= 0 (0: validate on the test split), got {val_size!r}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        self.root = root
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or max(batch_size, 500)
        self.val_size, self.train_subset, self.val_subset = val_size, train_subset, val_subset
        self.augment, self.normalize, self.download = augment, normalize, download
        self.num_workers, self.seed = num_workers, seed
        self.train_set: Optional[Dataset] = None
        self.val_set: Optional[Dataset] = None
        self.test_set: Optional[Dataset] = None

    # -- files ------------------------------------------------------------------------
    def _load(self, split: str) -> TensorDataset:
        raise NotImplementedError

    def _fetch(self, root: Path) -> None:
        raise NotImplementedError

    def _effective_root(self) -> Optional[str]:
        if self.root is None and self.download:
            return str(DEFAULT_DOWNLOAD_ROOT)
        return self.root

    @override
    def prepare_data(self) -> None:
        # Lightning calls this on one process per node: the only place that may download.
        if self.download:
            self._fetch(Path(self.root) if self.root is not None else DEFAULT_DOWNLOAD_ROOT)

    @override
    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        train: _Split = self._load("train")  # train first: a missing-files error names the train split
        test = self._load("test")
        val: _Split
        if self.val_size:
            if self.val_size >= len(train):
                raise ValueError(f"val_size={self.val_size} leaves no training images (the split has {len(train)})")
            order = torch.randperm(len(train), generator=torch.Generator().manual_seed(self.seed))
            val = Subset(train, order[: self.val_size].tolist())
            train = Subset(train, order[self.val_size :].tolist())
        else:
            val = test
        if self.train_subset is not None:
            train = Subset(train, range(min(self.train_subset, len(train))))
        if self.val_subset is not None:
            val = Subset(val, range(min(self.val_subset, len(val))))
        self.train_set, self.val_set, self.test_set = train, val, test

    # -- loaders ----------------------------------------------------------------------
    def _loader(self, dataset: Optional[Dataset], batch_size: int, train: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError(f"{type(self).__name__}.setup() has not run: call it before asking for a loader")
        generator = torch.Generator().manual_seed(self.seed) if train else None
        return DataLoader(dataset, batch_size=batch_size, shuffle=train, drop_last=train, generator=generator,
                          num_workers=self.num_workers, persistent_workers=self.num_workers > 0)

    @override
    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, self.batch_size, train=True)

    @override
    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, self.eval_batch_size, train=False)

    @override
    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, self.eval_batch_size, train=False)

    # -- on the device ----------------------------------------------------------------
    @override
    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        x, y = batch
        training = self.trainer is not None and self.trainer.training
        padding = self.crop_padding if self.augment and training else None
        return prepare_batch(x, self.mean, self.std, padding, self.normalize), y


class IDXDataModule(_InMemoryImageDataModule):
    """Fashion-MNIST or MNIST from IDX files (``.gz`` or plain): 60,000 training, 10,000 test images.

    Args:
        dataset: ``"fashion-mnist"`` or ``"mnist"``.
        root: a folder holding the four IDX files, or torchvision's layout under it
            (``<root>/FashionMNIST/raw``); ``$CAFIN_DATA_DIR`` and, for Fashion-MNIST, the
            Debian package's ``/usr/share/datasets/fashion-mnist`` are looked in too.
        batch_size: training batch size; ``eval_batch_size`` the validation/test one.
        val_size: images held out of the training split for validation (0: validate on the test split).
        train_subset / val_subset: use only the first N images (quick runs).
        augment: random crop (padding 2) and horizontal flip of training batches (off by default:
            digits and garments are not mirror-symmetric data in the usual recipes).
        normalize: subtract the dataset's mean and divide by its standard deviation.
        download: fetch the files into ``root`` (default ``./data``) if they are missing.
        num_workers: DataLoader workers (0 is right for in-memory tensors).
        seed: shuffling and hold-out seed.
    """

    crop_padding = 2

    def __init__(self, dataset: Literal["fashion-mnist", "mnist"] = "fashion-mnist", root: Optional[str] = None,
                 batch_size: int = 128, eval_batch_size: Optional[int] = None, val_size: int = 0,
                 train_subset: Optional[int] = None, val_subset: Optional[int] = None, augment: bool = False,
                 normalize: bool = True, download: bool = False, num_workers: int = 0, seed: int = 0) -> None:
        if dataset not in IDX_STATS:
            raise ValueError(f"dataset must be 'fashion-mnist' or 'mnist', got {dataset!r}")
        super().__init__(root, batch_size, eval_batch_size, val_size, train_subset, val_subset, augment, normalize,
                         download, num_workers, seed)
        self.dataset = dataset
        self.mean, self.std = IDX_STATS[dataset]

    def _fetch(self, root: Path) -> None:
        try:
            find_idx_files(self.dataset, "train", self.root)
            find_idx_files(self.dataset, "test", self.root)
        except FileNotFoundError:
            download_idx(self.dataset, root)

    def _load(self, split: str) -> TensorDataset:
        return TensorDataset(*load_idx_split(self.dataset, split, self._effective_root()))


class CIFARDataModule(_InMemoryImageDataModule):
    """CIFAR-10 or CIFAR-100 (python-format batches, extracted or as the ``.tar.gz``): 50,000 / 10,000 images.

    Args:
        dataset: ``"cifar10"`` or ``"cifar100"``.
        root: a folder holding ``cifar-10-batches-py/`` (or ``cifar-100-python/``), its batch
            files, or the archive; ``$CAFIN_DATA_DIR`` is looked in too.
        augment: the standard recipe -- random 32x32 crop of the 4-pixel zero-padded image
            and a random horizontal flip -- on training batches, on the device.
        Others as :class:`IDXDataModule`.
    """

    mean, std = CIFAR_MEAN, CIFAR_STD

    def __init__(self, dataset: Literal["cifar10", "cifar100"] = "cifar10", root: Optional[str] = None,
                 batch_size: int = 256, eval_batch_size: Optional[int] = None, val_size: int = 0,
                 train_subset: Optional[int] = None, val_subset: Optional[int] = None, augment: bool = True,
                 normalize: bool = True, download: bool = False, num_workers: int = 0, seed: int = 0) -> None:
        if dataset not in ("cifar10", "cifar100"):
            raise ValueError(f"dataset must be 'cifar10' or 'cifar100', got {dataset!r}")
        super().__init__(root, batch_size, eval_batch_size, val_size, train_subset, val_subset, augment, normalize,
                         download, num_workers, seed)
        self.dataset = dataset

    def _fetch(self, root: Path) -> None:
        try:
            load_cifar(self.dataset, "test", self.root)
        except FileNotFoundError:
            download_cifar(self.dataset, root)

    def _load(self, split: str) -> TensorDataset:
        return load_cifar(self.dataset, split, self._effective_root())


__all__ = ["CIFARDataModule", "DEFAULT_DOWNLOAD_ROOT", "IDXDataModule"]
