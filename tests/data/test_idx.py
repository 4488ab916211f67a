"""IDX reading and the search for the files, on crafted files and on the real Debian data."""

import gzip
import struct

import pytest
import torch

from lightning_cafin.data import DataNotFoundError, find_idx_files, load_idx_dataset, read_idx


def write_idx(path, array, code=0x08, compress=False):
    header = bytes([0, 0, code, array.dim()]) + b"".join(struct.pack(">I", d) for d in array.shape)
    payload = header + array.numpy().astype(">u1" if code == 0x08 else ">i4").tobytes()
    with (gzip.open if compress else open)(path, "wb") as f:
        f.write(payload)


@pytest.mark.parametrize("compress", [False, True])
def test_read_idx_round_trip(tmp_path, compress):
    images = torch.randint(0, 256, (3, 4, 5), dtype=torch.uint8)
    path = tmp_path / ("x.gz" if compress else "x")
    write_idx(path, images, compress=compress)
    assert torch.equal(read_idx(path), images)
    ints = torch.randint(-1000, 1000, (7,), dtype=torch.int32)
    write_idx(tmp_path / "i", ints, code=0x0C)
    assert torch.equal(read_idx(tmp_path / "i"), ints)


def test_bad_and_truncated_files(tmp_path):
    (tmp_path / "bad").write_bytes(b"\x01\x02\x03\x04rest")
    with pytest.raises(ValueError, match="not an IDX file"):
        read_idx(tmp_path / "bad")
    write_idx(tmp_path / "t", torch.zeros(4, 4, dtype=torch.uint8))
    (tmp_path / "t").write_bytes((tmp_path / "t").read_bytes()[:-3])
    with pytest.raises(ValueError, match="truncated"):
        read_idx(tmp_path / "t")


def test_torchvision_layout_is_found(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    write_idx(raw / "t10k-images-idx3-ubyte", torch.randint(0, 256, (2, 28, 28), dtype=torch.uint8))
    write_idx(raw / "t10k-labels-idx1-ubyte", torch.tensor([3, 1], dtype=torch.uint8))
    ds = load_idx_dataset("mnist", "test", root=tmp_path)
    assert len(ds) == 2 and ds[0][0].shape == (1, 28, 28) and ds.tensors[1].tolist() == [3, 1]
    assert 0.0 <= float(ds.tensors[0].min()) and float(ds.tensors[0].max()) <= 1.0


def test_missing_data_says_where_it_looked_and_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.delenv("CAFIN_DATA_DIR", raising=False)
    with pytest.raises(DataNotFoundError, match=r"(?s)Looked in:.*MNIST/raw.*pass it as root"):
        find_idx_files("mnist", "train", root=tmp_path)
    with pytest.raises(ValueError, match="split must be"):
        find_idx_files("mnist", "validation", root=tmp_path)


def test_real_fashion_mnist_from_the_debian_package():
    train, test = load_idx_dataset("fashion-mnist", "train"), load_idx_dataset("fashion-mnist", "test")
    assert len(train) == 60000 and len(test) == 10000
    assert sorted(torch.unique(test.tensors[1]).tolist()) == list(range(10))
