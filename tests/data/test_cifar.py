"""CIFAR python-format reading in every accepted layout, and the message when nothing is found."""

import numpy as np
import pytest
import torch

from lightning_cafin.data import DataNotFoundError, load_cifar

from .cifar_files import SPEC, write_cifar


@pytest.mark.parametrize("layout", ["folder", "flat", "archive"])
@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_reads_every_layout_exactly(tmp_path, monkeypatch, name, layout):
    monkeypatch.delenv("CAFIN_DATA_DIR", raising=False)
    batches = write_cifar(tmp_path, name, layout)
    _, _, train_files, test_files, key, _ = SPEC[name]
    for split, files in (("train", train_files), ("test", test_files)):
        ds = load_cifar(name, split, tmp_path)
        images, labels = ds.tensors
        rows = np.concatenate([batches[f][b"data"] for f in files])
        expected_labels = np.concatenate([batches[f][key] for f in files])
        assert images.dtype == torch.uint8 and images.shape == (len(rows), 3, 32, 32)
        # a row is 1024 red, then 1024 green, then 1024 blue values, each row-major 32x32
        assert torch.equal(images[:, 1, 2, 5], torch.from_numpy(rows[:, 1024 + 2 * 32 + 5]))
        assert torch.equal(images.reshape(len(rows), -1), torch.from_numpy(rows))
        assert torch.equal(labels, torch.from_numpy(expected_labels.astype(np.int64)))


def test_found_through_cafin_data_dir(tmp_path, monkeypatch):
    write_cifar(tmp_path, "cifar10", "folder")
    monkeypatch.setenv("CAFIN_DATA_DIR", str(tmp_path))
    assert len(load_cifar("cifar10", "test")) == 6


def test_missing_data_names_the_places_and_the_way_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv("CAFIN_DATA_DIR", str(tmp_path / "env"))
    with pytest.raises(DataNotFoundError) as err:
        load_cifar("cifar100", "train", tmp_path / "nowhere")
    msg = str(err.value)
    assert str(tmp_path / "nowhere") in msg and str(tmp_path / "env") in msg
    assert "cifar-100-python.tar.gz" in msg and "https://www.cs.toronto.edu/~kriz/cifar.html" in msg
    assert "download=True" in msg


def test_damaged_batch_is_an_error_naming_the_file(tmp_path):
    write_cifar(tmp_path, "cifar10", "folder")
    bad = tmp_path / "cifar-10-batches-py" / "test_batch"
    bad.write_bytes(b"not a pickle at all")
    with pytest.raises(ValueError, match="test_batch"):
        load_cifar("cifar10", "test", tmp_path)


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="name must be one of"):
        load_cifar("cifar11", "train", tmp_path)
    with pytest.raises(ValueError, match="split must be"):
        load_cifar("cifar10", "val", tmp_path)
