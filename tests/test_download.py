"""The checked Fashion-MNIST download, against a local HTTP server serving the Debian files.

The Debian package recompressed the `.gz` files, so their MD5s differ from upstream's and
only the decompressed-data SHA-256 can accept them: a passing download here proves that
check works, and the corrupted, truncated and missing files prove that bad data is deleted
and reported. One server (on 127.0.0.1, port 0) and one full download are shared by the
module; tests that need bad files get their own directory on that server.
"""

from __future__ import annotations

import gzip
import hashlib
import shutil
import socket
from pathlib import Path

import pytest

from hetfl.data import fashion_mnist
from hetfl.data.download import (
    FASHION_MNIST_FILES,
    IDX_SHA256,
    UPSTREAM_GZ_MD5,
    check_file,
    download_fashion_mnist,
    download_file,
    verify_file,
)
from hetfl.data.fetch import DownloadError, dataset_cache_dir, default_cache_dir, file_url
from local_mirror import LocalMirror

DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")

pytestmark = pytest.mark.skipif(
    not all((DEBIAN_DIR / name).is_file() for name in FASHION_MNIST_FILES),
    reason=f"needs the Debian Fashion-MNIST files in {DEBIAN_DIR} "
    "(apt-get install dataset-fashion-mnist)",
)

SMALL = "t10k-labels-idx1-ubyte.gz"  # 5 KB: the file the failure tests download


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The server; `<root>/debian/` holds copies of the four Debian files."""
    root = tmp_path_factory.mktemp("mirror")
    (root / "debian").mkdir()
    for name in FASHION_MNIST_FILES:
        shutil.copyfile(DEBIAN_DIR / name, root / "debian" / name)
    srv = LocalMirror(root)
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def downloaded(server, tmp_path_factory):
    """One full download from the Debian copy, and the progress calls it made."""
    dest = tmp_path_factory.mktemp("cache") / "fashion-mnist"
    calls: list[tuple[str, int, int | None]] = []
    result = download_fashion_mnist(
        dest, server.mirror("debian"), timeout=10, progress=lambda *a: calls.append(a)
    )
    return result, calls


@pytest.fixture
def bad_mirror(server, request):
    """A fresh directory on the server (named after the test) holding a copy of SMALL."""
    name = request.node.name.replace("[", "-").replace("]", "")
    directory = server.root / name
    directory.mkdir()
    shutil.copyfile(DEBIAN_DIR / SMALL, directory / SMALL)
    return directory, server.mirror(name)


def _leftovers(dest: Path) -> list[str]:
    return sorted(p.name for p in dest.iterdir()) if dest.exists() else []


def test_download_passes_the_decompressed_hash_check_and_loads(downloaded, monkeypatch):
    dest, calls = downloaded
    assert _leftovers(dest) == sorted(FASHION_MNIST_FILES)  # no .part files left
    for name in FASHION_MNIST_FILES:
        raw = (dest / name).read_bytes()
        assert raw == (DEBIAN_DIR / name).read_bytes()
        # Debian recompressed: upstream's MD5 cannot be what accepted the file ...
        assert hashlib.md5(raw, usedforsecurity=False).hexdigest() != UPSTREAM_GZ_MD5[name]
        # ... the decompressed-data SHA-256 did.
        assert hashlib.sha256(gzip.decompress(raw)).hexdigest() == IDX_SHA256[name]
        check = check_file(dest / name, name)
        assert check.ok and check.method == "idx-sha256"
    # Progress: bytes grow per file and end at the Content-Length.
    for name in FASHION_MNIST_FILES:
        mine = [(got, total) for n, got, total in calls if n == name]
        size = (DEBIAN_DIR / name).stat().st_size
        assert mine[-1] == (size, size)
        assert [got for got, _ in mine] == sorted(got for got, _ in mine)

    monkeypatch.setattr(fashion_mnist, "_FASHION_MNIST_CACHE", {})  # free the arrays afterwards
    ds = fashion_mnist.load_fashion_mnist(dest)
    assert ds.x_train.shape == (60000, 1, 28, 28) and ds.y_train.shape == (60000,)
    assert ds.x_test.shape == (10000, 1, 28, 28) and ds.y_test.shape == (10000,)


def test_second_call_does_not_download_again(server, downloaded):
    dest, _ = downloaded
    before = len(server.requests)
    calls: list[tuple] = []
    assert download_fashion_mnist(dest, server.mirror("debian"), progress=calls.append) == dest
    assert len(server.requests) == before and calls == []


def test_upstream_md5_is_accepted_without_decompressing(downloaded, monkeypatch):
    dest, _ = downloaded
    debian_md5 = hashlib.md5((dest / SMALL).read_bytes(), usedforsecurity=False).hexdigest()
    monkeypatch.setitem(UPSTREAM_GZ_MD5, SMALL, debian_md5)  # pretend it is upstream's file
    check = check_file(dest / SMALL, SMALL)
    assert check.ok and check.method == "gz-md5" and check.idx_sha256 is None


def _flip_middle(path: Path) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    for i in range(mid, mid + 16):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _not_gzip(path: Path) -> None:
    path.write_text("<html><body>Access denied</body></html>")


def _wrong_data(path: Path) -> None:
    """Valid gzip, wrong contents: only the hash can catch it."""
    path.write_bytes(gzip.compress(gzip.decompress(path.read_bytes())[:-1] + b"\x00"))


@pytest.mark.parametrize("corrupt", [_flip_middle, _truncate, _not_gzip, _wrong_data])
def test_corrupted_file_is_rejected_and_deleted(bad_mirror, tmp_path, corrupt):
    served, mirror = bad_mirror
    corrupt(served / SMALL)
    dest = tmp_path / "dest"
    with pytest.raises(DownloadError) as err:
        download_file(SMALL, dest, mirror, timeout=10)
    message = str(err.value)
    assert SMALL in message and file_url(mirror, SMALL) in message
    assert UPSTREAM_GZ_MD5[SMALL] in message and IDX_SHA256[SMALL] in message
    actual = hashlib.md5((served / SMALL).read_bytes(), usedforsecurity=False).hexdigest()
    assert actual in message and "deleted" in message
    assert _leftovers(dest) == []


def test_corrupted_big_file_stops_the_full_download(server, tmp_path):
    served = server.root / "corrupt-train-images"
    served.mkdir()
    for name in FASHION_MNIST_FILES:
        shutil.copyfile(DEBIAN_DIR / name, served / name)
    _flip_middle(served / FASHION_MNIST_FILES[0])
    dest = tmp_path / "dest"
    with pytest.raises(DownloadError, match=FASHION_MNIST_FILES[0]):
        download_fashion_mnist(dest, server.mirror(served.name), timeout=10)
    assert _leftovers(dest) == []


def test_missing_file_is_a_download_error_naming_the_url(bad_mirror, tmp_path):
    served, mirror = bad_mirror
    (served / SMALL).unlink()
    dest = tmp_path / "dest"
    with pytest.raises(DownloadError, match="HTTP 404") as err:
        download_file(SMALL, dest, mirror, timeout=10)
    assert file_url(mirror, SMALL) in str(err.value)
    assert _leftovers(dest) == []


def test_connection_ending_early_is_a_download_error(server, tmp_path):
    dest = tmp_path / "dest"
    with pytest.raises(DownloadError, match=SMALL):
        download_file(SMALL, dest, server.mirror("short"), timeout=10)
    assert _leftovers(dest) == []


def test_unwritable_destination_is_a_download_error(bad_mirror, tmp_path):
    _, mirror = bad_mirror
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(DownloadError, match="cannot write"):
        download_file(SMALL, blocker / "dest", mirror, timeout=10)


def test_unreachable_mirror_is_a_download_error(tmp_path):
    with socket.socket() as s:  # a port that was free a moment ago: connection refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dest = tmp_path / "dest"
    with pytest.raises(DownloadError, match="Check the network connection"):
        download_file(SMALL, dest, f"http://127.0.0.1:{port}", timeout=5)
    assert _leftovers(dest) == []


def test_existing_bad_file_is_reported_not_overwritten(bad_mirror, tmp_path):
    _, mirror = bad_mirror
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / SMALL).write_bytes(b"someone else's data")
    with pytest.raises(DownloadError, match="not overwritten"):
        download_file(SMALL, dest, mirror, timeout=10)
    assert (dest / SMALL).read_bytes() == b"someone else's data"
    assert _leftovers(dest) == [SMALL]


@pytest.mark.parametrize("mirror", ["http://h/data", "http://h/data/", "http://h/data//"])
def test_mirror_url_with_or_without_trailing_slash(mirror):
    assert file_url(mirror, SMALL) == f"http://h/data/{SMALL}"


def test_verify_file_on_missing_and_unknown_files(tmp_path):
    assert not verify_file(tmp_path / SMALL, SMALL)
    assert not check_file(tmp_path / SMALL, SMALL).ok
    with pytest.raises(ValueError, match="unknown Fashion-MNIST file"):
        verify_file(DEBIAN_DIR / SMALL, "nope.gz")
    assert verify_file(DEBIAN_DIR / SMALL, SMALL)


def test_cache_dir_follows_hetfl_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("HETFL_CACHE", str(tmp_path))
    assert dataset_cache_dir("fashion-mnist") == tmp_path / "fashion-mnist"
    monkeypatch.delenv("HETFL_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "hetfl"


def test_cli_download_and_config_download(server, tmp_path, capsys, monkeypatch):
    from hetfl.cli import main

    dest = tmp_path / "cli"
    assert main(["data", "download", "fashion-mnist", "--dest", str(dest),
                 "--mirror", server.mirror("debian")]) == 0  # fmt: skip
    assert "verified files in" in capsys.readouterr().out
    assert _leftovers(dest) == sorted(FASHION_MNIST_FILES)
    # a config with `download: true` fetches into the cache before the run
    monkeypatch.setenv("HETFL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(fashion_mnist, "FASHION_MNIST_SYSTEM_DIR", tmp_path / "no-system")
    monkeypatch.delenv("HETFL_DATA", raising=False)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        "name: d\ndata: {dataset: fashion-mnist, num_clients: 2, partition: {kind: iid},\n"
        f"  download: true, mirror: '{server.mirror('debian')}'}}\n"
        "train: {rounds: 1, clients_per_round: 1, local_steps: 1}\n"
        f"eval: {{local_eval: none}}\noutput_dir: {tmp_path / 'runs'}\n"
    )
    monkeypatch.setattr(fashion_mnist, "_FASHION_MNIST_CACHE", {})
    assert main(["run", str(cfg), "--quiet"]) == 0
    assert _leftovers(tmp_path / "cache" / "fashion-mnist") == sorted(FASHION_MNIST_FILES)


def test_cli_download_errors_exit_2(server, tmp_path, capsys):
    from hetfl.cli import main

    assert main(["data", "download", "fashion-mnist", "--dest", str(tmp_path),
                 "--mirror", server.mirror("nowhere")]) == 2  # fmt: skip
    assert "nowhere" in capsys.readouterr().err  # the message names the URL
    assert main(["data", "download", "cifar-10"]) == 2
    assert "no download for dataset 'cifar-10'" in capsys.readouterr().err
