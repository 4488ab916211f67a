"""The datamodules: splits, subsets, on-device preprocessing, augmentation only while training."""

from types import SimpleNamespace

import pytest
import torch

from lightning_cafin.data import CIFARDataModule, DataNotFoundError, IDXDataModule
from lightning_cafin.data import DEBIAN_FASHION_MNIST
from lightning_cafin.data import datamodules as dm_module
from lightning_cafin.data import download as download_module
from lightning_cafin.data.download import IDX_FILES

from .cifar_files import write_cifar
from .test_download import needs_fashion


def _preprocess(dm, batch, training):
    dm.trainer = SimpleNamespace(training=training)
    return dm.on_after_batch_transfer(batch, 0)


@needs_fashion
def test_fashion_mnist_splits_on_the_real_data():
    dm = IDXDataModule()
    dm.setup("fit")
    assert len(dm.train_set) == 60000 and len(dm.val_set) == 10000 and dm.test_set is dm.val_set
    x, y = next(iter(dm.train_dataloader()))
    assert x.dtype == torch.uint8 and x.shape == (128, 1, 28, 28) and y.dtype == torch.int64
    xs, _ = _preprocess(dm, (x, y), training=True)
    assert xs.dtype == torch.float32
    # normalised with the dataset's statistics: roughly zero mean, unit spread over a batch
    assert abs(float(xs.mean())) < 0.2 and 0.8 < float(xs.std()) < 1.2


@needs_fashion
def test_hold_out_is_disjoint_and_seeded_and_subsets_bound_the_sizes():
    dm = IDXDataModule(val_size=5000, train_subset=1000, val_subset=300, seed=3)
    dm.setup("fit")
    assert len(dm.train_set) == 1000 and len(dm.val_set) == 300 and len(dm.test_set) == 10000
    held_out = set(dm.val_set.dataset.indices)
    assert len(held_out) == 5000 and not held_out & set(dm.train_set.dataset.indices)
    again = IDXDataModule(val_size=5000, seed=3)
    again.setup("fit")
    assert again.val_set.indices == dm.val_set.dataset.indices


@needs_fashion
def test_training_batches_are_shuffled_reproducibly_and_evaluation_ones_are_not():
    a, b = IDXDataModule(train_subset=2000, seed=1), IDXDataModule(train_subset=2000, seed=1)
    for dm in (a, b):
        dm.setup("fit")
    assert torch.equal(next(iter(a.train_dataloader()))[1], next(iter(b.train_dataloader()))[1])
    first_val = next(iter(a.val_dataloader()))[1]
    assert torch.equal(first_val, a.val_set.tensors[1][: len(first_val)])


def test_cifar_augments_training_batches_only(tmp_path):
    write_cifar(tmp_path, "cifar10", "folder", per_file=40)
    dm = CIFARDataModule(root=str(tmp_path), batch_size=32, normalize=False)
    dm.setup("fit")
    assert len(dm.train_set) == 200 and len(dm.val_set) == 40
    x, y = next(iter(dm.val_dataloader()))
    plain, _ = _preprocess(dm, (x, y), training=False)
    assert torch.equal(plain, x.float() / 255)
    torch.manual_seed(0)
    augmented, _ = _preprocess(dm, (x, y), training=True)
    assert augmented.shape == plain.shape and not torch.equal(augmented, plain)
    # a zero-padded crop brings in zeros at the borders for most images
    assert (augmented == 0).any()


def test_cifar_normalises_with_its_channel_statistics(tmp_path):
    write_cifar(tmp_path, "cifar100", "archive", per_file=8)
    dm = CIFARDataModule("cifar100", root=str(tmp_path), augment=False)
    dm.setup("fit")
    x, y = dm.train_set.tensors[0][:4], dm.train_set.tensors[1][:4]
    out, _ = _preprocess(dm, (x, y), training=True)
    expected = (x[:, 1].float() / 255 - 0.4822) / 0.2435
    assert torch.allclose(out[:, 1], expected, atol=1e-6)


def test_missing_data_message(tmp_path, monkeypatch):
    monkeypatch.delenv("CAFIN_DATA_DIR", raising=False)
    dm = IDXDataModule("mnist", root=str(tmp_path))
    with pytest.raises(DataNotFoundError, match=str(tmp_path)):
        dm.setup("fit")
    with pytest.raises(DataNotFoundError, match="download=True"):
        CIFARDataModule(root=str(tmp_path)).setup("fit")


def test_download_only_when_asked(tmp_path, monkeypatch):
    monkeypatch.delenv("CAFIN_DATA_DIR", raising=False)
    calls = []
    monkeypatch.setattr(dm_module, "download_idx", lambda name, root: calls.append((name, root)))
    IDXDataModule("mnist", root=str(tmp_path)).prepare_data()
    assert calls == []
    monkeypatch.chdir(tmp_path)
    IDXDataModule("mnist", download=True).prepare_data()
    assert calls == [("mnist", dm_module.DEFAULT_DOWNLOAD_ROOT)]


@needs_fashion
def test_download_into_root_then_train_from_it(tmp_path, monkeypatch):
    import shutil

    monkeypatch.delenv("CAFIN_DATA_DIR", raising=False)
    server = tmp_path / "server"
    shutil.copytree(DEBIAN_FASHION_MNIST, server)  # served as if it were MNIST: same format
    monkeypatch.setitem(download_module.BASE_URLS, "mnist", server.as_uri() + "/")
    dm = IDXDataModule("mnist", root=str(tmp_path / "data"), download=True, train_subset=10)
    dm.prepare_data()
    assert all((tmp_path / "data" / f).is_file() for f in IDX_FILES)
    dm.setup("fit")
    assert len(dm.train_set) == 10


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"batch_size": 0}, "batch_size must be a positive integer"),
        ({"train_subset": -5}, "train_subset"),
        ({"val_size": -1}, "val_size must be an integer >= 0"),
        ({"num_workers": -1}, "num_workers"),
        ({"dataset": "kmnist"}, "'fashion-mnist' or 'mnist'"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        IDXDataModule(**kwargs)


@needs_fashion
def test_hold_out_larger_than_the_split_is_refused():
    with pytest.raises(ValueError, match="val_size=60000 leaves no training images"):
        IDXDataModule(val_size=60000).setup("fit")
