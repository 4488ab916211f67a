"""Downloads, only when asked: fetched over file:// URLs here, checked before they count as data."""

import shutil

import pytest

from lightning_cafin.data import DEBIAN_FASHION_MNIST, DownloadError, download_cifar, download_idx, load_cifar
from lightning_cafin.data.download import IDX_FILES
from lightning_cafin.data.idx import read_idx

from .cifar_files import write_cifar

needs_fashion = pytest.mark.skipif(
    not (DEBIAN_FASHION_MNIST / IDX_FILES[0]).is_file(), reason="Debian's dataset-fashion-mnist is not installed"
)


@needs_fashion
def test_idx_download_fetches_validates_and_keeps_present_files(tmp_path, capsys):
    server = tmp_path / "server"
    shutil.copytree(DEBIAN_FASHION_MNIST, server)
    root = download_idx("fashion-mnist", tmp_path / "data", base_url=server.as_uri() + "/")
    for f in IDX_FILES:
        assert (root / f).read_bytes() == (server / f).read_bytes()
    assert not list(root.glob("*.part"))
    assert "downloading" in capsys.readouterr().err
    assert read_idx(root / IDX_FILES[0]).shape == (60000, 28, 28)
    shutil.rmtree(server)  # present files are not fetched again
    download_idx("fashion-mnist", root, base_url=server.as_uri() + "/")


def test_a_file_that_is_not_idx_is_refused_and_removed(tmp_path):
    server = tmp_path / "server"
    server.mkdir()
    for f in IDX_FILES:
        (server / f).write_bytes(b"<html>rate limited</html>")
    with pytest.raises(DownloadError, match="did not give a valid train-images-idx3-ubyte.gz"):
        download_idx("mnist", tmp_path / "data", base_url=server.as_uri() + "/")
    assert not list((tmp_path / "data").iterdir())


def test_unreachable_url_names_the_url_and_where_to_put_the_file(tmp_path):
    url = (tmp_path / "missing").as_uri() + "/"
    with pytest.raises(DownloadError) as err:
        download_idx("mnist", tmp_path / "data", base_url=url)
    assert url + "train-images-idx3-ubyte.gz" in str(err.value)
    assert str(tmp_path / "data" / "train-images-idx3-ubyte.gz") in str(err.value)


def test_cifar_archive_download_is_read_in_place(tmp_path, monkeypatch):
    monkeypatch.delenv("CAFIN_DATA_DIR", raising=False)
    server = tmp_path / "server"
    write_cifar(server, "cifar10", "archive")
    root = download_cifar("cifar10", tmp_path / "data", base_url=server.as_uri() + "/")
    assert (root / "cifar-10-python.tar.gz").is_file()
    assert len(load_cifar("cifar10", "train", root)) == 30


def test_cifar_archive_missing_a_batch_is_refused(tmp_path):
    import tarfile

    server = tmp_path / "server"
    server.mkdir()
    with tarfile.open(server / "cifar-10-python.tar.gz", "w:gz"):
        pass
    with pytest.raises(DownloadError, match="cifar-10-python.tar.gz"):
        download_cifar("cifar10", tmp_path / "data", base_url=server.as_uri() + "/")
    assert not (tmp_path / "data" / "cifar-10-python.tar.gz").exists()


def test_bad_names():
    with pytest.raises(ValueError, match="'fashion-mnist' or 'mnist'"):
        download_idx("kmnist", "x")
    with pytest.raises(ValueError, match="cifar10"):
        download_cifar("svhn", "x")
