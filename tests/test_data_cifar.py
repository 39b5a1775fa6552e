"""CIFAR-10/100 loaders and the archive download, against tiny archives in the official
binary layout served from 127.0.0.1.

The real MD5s cannot match fabricated archives, so verification is tested with the
fixture's own MD5 injected into `ARCHIVE_MD5`, and mismatch with the real table.
"""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path

import numpy as np
import pytest

from hetfl.config import RunConfig
from hetfl.data import DatasetNotFoundError, load_cifar10, load_cifar100
from hetfl.data.archives import ARCHIVE_MD5, ARCHIVES
from hetfl.data.download import DOWNLOADERS
from hetfl.data.fetch import DownloadError
from local_mirror import LocalMirror

CIFAR10_BATCHES = [f"data_batch_{i}.bin" for i in range(1, 6)]


@pytest.fixture(scope="module")
def mirror(tmp_path_factory):
    srv = LocalMirror(tmp_path_factory.mktemp("mirror"))
    yield srv
    srv.close()


def _images(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 256, size=(n, 3, 32, 32), dtype=np.uint8)


def _record(labels: list[int], image: np.ndarray) -> bytes:
    """One record as the CIFAR page describes it: label byte(s), then the red, green and
    blue planes of 1024 bytes, each row-major."""
    planes = b"".join(image[c].tobytes(order="C") for c in range(3))
    assert len(planes) == 3072
    return bytes(labels) + planes


def _tar_gz(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        folders = sorted({name.split("/")[0] for name in members})
        for folder in folders:
            info = tarfile.TarInfo(folder)
            info.type = tarfile.DIRTYPE
            info.mode = 0o755
            tar.addfile(info)
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _cifar10(rng: np.random.Generator, counts=(3, 2, 2, 1, 2), n_test=3):
    """The archive's bytes, and the images and labels it holds (train, test)."""
    x = _images(rng, sum(counts) + n_test)
    y = rng.integers(0, 10, size=x.shape[0])
    records = [_record([int(label)], image) for label, image in zip(y, x, strict=True)]
    members, start = {}, 0
    for name, count in zip(CIFAR10_BATCHES, counts, strict=True):
        members[f"cifar-10-batches-bin/{name}"] = b"".join(records[start : start + count])
        start += count
    members["cifar-10-batches-bin/test_batch.bin"] = b"".join(records[start:])
    members["cifar-10-batches-bin/batches.meta.txt"] = b"airplane\n"
    n = sum(counts)
    return _tar_gz(members), (x[:n], y[:n]), (x[n:], y[n:])


def _serve(mirror: LocalMirror, request, name: str, data: bytes) -> str:
    """Put `data` at `<test dir>/name` on the mirror; return the mirror URL."""
    subdir = request.node.name.replace("[", "-").replace("]", "")
    (mirror.root / subdir).mkdir(exist_ok=True)
    (mirror.root / subdir / name).write_bytes(data)
    return mirror.mirror(subdir)


def _inject_md5(monkeypatch, name: str, data: bytes) -> None:
    monkeypatch.setitem(ARCHIVE_MD5, name, hashlib.md5(data, usedforsecurity=False).hexdigest())


def _leftovers(dest: Path) -> list[str]:
    return sorted(p.name for p in dest.iterdir()) if dest.exists() else []


def test_cifar10_downloads_verifies_extracts_and_loads(mirror, request, tmp_path, monkeypatch):
    archive, (x_train, y_train), (x_test, y_test) = _cifar10(np.random.default_rng(0))
    url = _serve(mirror, request, "cifar-10-binary.tar.gz", archive)
    _inject_md5(monkeypatch, "cifar-10-binary.tar.gz", archive)
    calls: list[tuple] = []
    dest = DOWNLOADERS["cifar10"](tmp_path / "c10", url, progress=lambda *a: calls.append(a))
    assert _leftovers(dest) == ["cifar-10-batches-bin", "cifar-10-binary.tar.gz"]
    assert calls[-1] == ("cifar-10-binary.tar.gz", len(archive), len(archive))

    ds = load_cifar10(dest)
    assert ds.name == "cifar10" and ds.num_classes == 10
    assert ds.x_train.shape == (10, 3, 32, 32) and ds.x_test.shape == (3, 3, 32, 32)
    assert ds.x_train.dtype == np.uint8 and ds.y_train.dtype == np.int64
    np.testing.assert_array_equal(ds.x_train, x_train)  # five batches, in file order
    np.testing.assert_array_equal(ds.y_train, y_train)
    np.testing.assert_array_equal(ds.x_test, x_test)
    np.testing.assert_array_equal(ds.y_test, y_test)
    # channel-major planes, read straight from the bytes: pixel (c, row, col) of record 0
    raw = (dest / "cifar-10-batches-bin" / "data_batch_1.bin").read_bytes()
    for c, row, col in [(0, 0, 0), (1, 5, 7), (2, 31, 31)]:
        assert ds.x_train[0, c, row, col] == raw[1 + 1024 * c + 32 * row + col]
    # pixel statistics: the training set's, per channel, on the [0, 1] scale
    scaled = x_train.astype(np.float64) / 255
    np.testing.assert_allclose(ds.pixels.mean, scaled.mean(axis=(0, 2, 3)), rtol=1e-12)
    np.testing.assert_allclose(ds.pixels.std, scaled.std(axis=(0, 2, 3)), rtol=1e-12)

    before = len(mirror.requests)  # a second download finds the folder and fetches nothing
    assert DOWNLOADERS["cifar10"](dest, url) == dest and len(mirror.requests) == before


def test_cifar100_uses_the_fine_label(mirror, request, tmp_path, monkeypatch):
    rng = np.random.default_rng(1)
    x = _images(rng, 7)
    coarse = rng.integers(0, 20, size=7)
    fine = rng.integers(20, 100, size=7)  # never equal to a coarse label
    records = [
        _record([int(c), int(f)], image) for c, f, image in zip(coarse, fine, x, strict=True)
    ]
    archive = _tar_gz(
        {
            "cifar-100-binary/train.bin": b"".join(records[:5]),
            "cifar-100-binary/test.bin": b"".join(records[5:]),
            "cifar-100-binary/fine_label_names.txt": b"apple\n",
        }
    )
    url = _serve(mirror, request, "cifar-100-binary.tar.gz", archive)
    _inject_md5(monkeypatch, "cifar-100-binary.tar.gz", archive)
    ds = load_cifar100(DOWNLOADERS["cifar100"](tmp_path / "c100", url))
    assert ds.name == "cifar100" and ds.num_classes == 100
    assert ds.y_train.tolist() == fine[:5].tolist() and ds.y_test.tolist() == fine[5:].tolist()
    np.testing.assert_array_equal(ds.x_train, x[:5])
    np.testing.assert_array_equal(ds.x_test, x[5:])


def test_a_truncated_record_file_is_named(tmp_path):
    folder = tmp_path / "cifar-100-binary"
    folder.mkdir()
    image = np.zeros((3, 32, 32), np.uint8)
    (folder / "train.bin").write_bytes(_record([1, 2], image) * 2)
    (folder / "test.bin").write_bytes(_record([1, 2], image)[:-1])  # one byte short
    with pytest.raises(ValueError, match=r"test\.bin: 3073 bytes is not a whole, positive"):
        load_cifar100(tmp_path)


def test_missing_cifar_names_the_file_the_places_and_the_command(tmp_path, monkeypatch):
    monkeypatch.delenv("HETFL_DATA", raising=False)
    monkeypatch.setenv("HETFL_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "data" / "cifar-10-batches-bin"
    folder.mkdir(parents=True)
    for name in CIFAR10_BATCHES[:4]:  # data_batch_5.bin and test_batch.bin are missing
        (folder / name).write_bytes(b"")
    for path in (tmp_path / "data", None):
        with pytest.raises(DatasetNotFoundError) as err:
            load_cifar10(path)
        message = str(err.value)
        assert "hetfl data download cifar10" in message
        if path is None:
            assert str(tmp_path / "cache" / "cifar10" / "cifar-10-batches-bin") in message
        else:
            assert f"{folder} (missing data_batch_5.bin, test_batch.bin)" in message


def test_checksum_mismatch_deletes_the_archive_and_says_so(mirror, request, tmp_path):
    archive, _, _ = _cifar10(np.random.default_rng(2))
    url = _serve(mirror, request, "cifar-10-binary.tar.gz", archive)
    dest = tmp_path / "dest"
    with pytest.raises(DownloadError) as err:  # the real MD5 cannot match a fabrication
        DOWNLOADERS["cifar10"](dest, url)
    message = str(err.value)
    assert "c32a1d4ab5d03f1284b67883e8d87530" in message and "cifar.html" in message
    assert hashlib.md5(archive, usedforsecurity=False).hexdigest() in message
    assert "was deleted" in message
    assert _leftovers(dest) == []


@pytest.mark.parametrize("md5_of", ["whole", "truncated"])
def test_a_truncated_archive_is_named_and_leaves_nothing(
    mirror, request, tmp_path, monkeypatch, md5_of
):
    """Against the whole archive's MD5 a truncated one fails verification; against its own
    (as if upstream served it) it fails extraction. Either way nothing stays."""
    archive, _, _ = _cifar10(np.random.default_rng(3))
    truncated = archive[: len(archive) // 2]
    url = _serve(mirror, request, "cifar-10-binary.tar.gz", truncated)
    _inject_md5(monkeypatch, "cifar-10-binary.tar.gz", archive if md5_of == "whole" else truncated)
    dest = tmp_path / "dest"
    with pytest.raises(DownloadError, match=r"cifar-10-binary\.tar\.gz") as err:
        DOWNLOADERS["cifar10"](dest, url)
    expected = "MD5 mismatch" if md5_of == "whole" else "truncated or damaged"
    assert expected in str(err.value) and "deleted" in str(err.value)
    assert _leftovers(dest) == []


def _traversal(kind: str) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        ok = tarfile.TarInfo("cifar-10-batches-bin/data_batch_1.bin")
        ok.size = 4
        tar.addfile(ok, io.BytesIO(b"safe"))
        bad = tarfile.TarInfo(
            {"dotdot": "cifar-10-batches-bin/../../evil.bin", "absolute": "/tmp/evil.bin"}.get(
                kind, "cifar-10-batches-bin/link"
            )
        )
        if kind == "symlink":
            bad.type, bad.linkname = tarfile.SYMTYPE, "../../evil.bin"
            tar.addfile(bad)
        else:
            bad.size = 4
            tar.addfile(bad, io.BytesIO(b"evil"))
    return buffer.getvalue()


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink"])
def test_path_traversal_members_are_refused(mirror, request, tmp_path, monkeypatch, kind):
    archive = _traversal(kind)
    url = _serve(mirror, request, "cifar-10-binary.tar.gz", archive)
    _inject_md5(monkeypatch, "cifar-10-binary.tar.gz", archive)
    dest = tmp_path / "a" / "b"
    match = "link or a device" if kind == "symlink" else "path traversal"
    with pytest.raises(DownloadError, match=match):
        DOWNLOADERS["cifar10"](dest, url)
    assert _leftovers(dest) == ["cifar-10-binary.tar.gz"]  # no folder, no temporary directory
    assert not (tmp_path / "evil.bin").exists() and not (tmp_path / "a" / "evil.bin").exists()


def test_cli_and_config_download(mirror, request, tmp_path, monkeypatch, capsys):
    from hetfl.assembly import load_dataset
    from hetfl.cli import main

    archive, (_, y_train), _ = _cifar10(np.random.default_rng(4))
    url = _serve(mirror, request, "cifar-10-binary.tar.gz", archive)
    _inject_md5(monkeypatch, "cifar-10-binary.tar.gz", archive)
    dest = tmp_path / "cli"
    assert main(["data", "download", "cifar10", "--dest", str(dest), "--mirror", url]) == 0
    assert f"cifar10: verified files in {dest}" in capsys.readouterr().out
    assert _leftovers(dest) == ["cifar-10-batches-bin", "cifar-10-binary.tar.gz"]
    # `data.download: true` fetches into the cache, and the loader reads it from there
    monkeypatch.setenv("HETFL_CACHE", str(tmp_path / "cache"))
    cfg = RunConfig.model_validate(
        {
            "data": {"dataset": "cifar10", "num_clients": 2, "download": True, "mirror": url},
            "train": {"clients_per_round": 2},
        }
    )
    ds = load_dataset(cfg)
    assert ds.y_train.tolist() == y_train.tolist()
    assert (tmp_path / "cache" / "cifar10" / ARCHIVES["cifar10"].folder).is_dir()
    # ... and a run trains on it end to end: uint8 pixels, augmented, through `hetfl run`
    run_cfg = tmp_path / "run.yaml"
    run_cfg.write_text(
        f"name: c10\noutput_dir: {tmp_path / 'runs'}\nexecutor: sequential\n"
        f"data: {{dataset: cifar10, path: {dest}, num_clients: 2, test_per_client: 1,"
        " augment: {crop_padding: 4, flip: true, cutout: 8}}\n"
        "model: {name: small-cnn}\ntrain: {rounds: 1, clients_per_round: 2, batch_size: 4}\n"
    )
    assert main(["run", str(run_cfg)]) == 0
    rows = (tmp_path / "runs" / "c10" / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 1 and '"global_acc"' in rows[0]
