"""Tiny-ImageNet: a handful of JPEGs written with Pillow into the official zip layout,
served from 127.0.0.1, downloaded, extracted, decoded once into the cache and read back."""

from __future__ import annotations

import hashlib
import io
import zipfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from hetfl.data import DatasetNotFoundError, load_tiny_imagenet
from hetfl.data import tiny_imagenet as tiny
from hetfl.data.archives import ARCHIVE_MD5
from hetfl.data.download import DOWNLOADERS
from hetfl.data.fetch import DownloadError
from local_mirror import LocalMirror

ZIP = "tiny-imagenet-200.zip"
WNIDS = ["n09999999", "n01443537", "n02124075"]  # wnids.txt order; classes are sorted ids
TRAIN_PER_CLASS = {"n09999999": 2, "n01443537": 3, "n02124075": 1}
VAL = [("val_0.JPEG", "n02124075"), ("val_1.JPEG", "n09999999"), ("val_2.JPEG", "n02124075")]
GRAY = "tiny-imagenet-200/train/n01443537/images/n01443537_1.JPEG"


@pytest.fixture(scope="module")
def mirror(tmp_path_factory):
    srv = LocalMirror(tmp_path_factory.mktemp("mirror"))
    yield srv
    srv.close()


def _smooth(rng: np.random.Generator, mode: str, size: int = 64) -> tuple[np.ndarray, bytes]:
    """A smooth image (so JPEG keeps it close) and its JPEG bytes."""
    ramp = np.linspace(0, 1, size)
    a, b, c = rng.uniform(20, 110, size=3)
    gray = (a + b * ramp[:, None] + c * ramp[None, :]).astype(np.uint8)  # (H, W)
    pixels = gray if mode == "L" else np.stack([gray, 255 - gray, gray // 2], axis=-1)
    buffer = io.BytesIO()
    Image.fromarray(pixels, mode).save(buffer, format="JPEG", quality=95)
    return pixels, buffer.getvalue()


def _zip(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buffer.getvalue()


def _tiny_imagenet(rng: np.random.Generator) -> tuple[bytes, dict[str, np.ndarray]]:
    """The zip's bytes (official layout) and each image's source pixels by member name."""
    root = "tiny-imagenet-200"
    members = {f"{root}/wnids.txt": "\n".join(WNIDS).encode() + b"\n", f"{root}/words.txt": b""}
    sources = {}
    for wnid, count in TRAIN_PER_CLASS.items():
        members[f"{root}/train/{wnid}/{wnid}_boxes.txt"] = b""
        for i in range(count):
            name = f"{root}/train/{wnid}/images/{wnid}_{i}.JPEG"
            sources[name], members[name] = _smooth(rng, "L" if name == GRAY else "RGB")
    lines = []
    for file, wnid in VAL:
        name = f"{root}/val/images/{file}"
        sources[name], members[name] = _smooth(rng, "RGB")
        lines.append(f"{file}\t{wnid}\t0\t0\t63\t63")
    members[f"{root}/val/val_annotations.txt"] = "\n".join(lines).encode() + b"\n"
    members[f"{root}/test/images/test_0.JPEG"] = _smooth(rng, "RGB")[1]
    return _zip(members), sources


def _serve(mirror: LocalMirror, request, data: bytes, monkeypatch, inject: bool = True) -> str:
    subdir = request.node.name.replace("[", "-").replace("]", "")
    (mirror.root / subdir).mkdir()
    (mirror.root / subdir / ZIP).write_bytes(data)
    if inject:
        monkeypatch.setitem(ARCHIVE_MD5, ZIP, hashlib.md5(data, usedforsecurity=False).hexdigest())
    return mirror.mirror(subdir)


def _leftovers(dest: Path) -> list[str]:
    return sorted(p.name for p in dest.iterdir()) if dest.exists() else []


def _pil_rgb(path: Path) -> np.ndarray:
    """Pillow's own decode, as (3, 64, 64)."""
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB")).transpose(2, 0, 1)


def test_download_decode_cache_and_reload(mirror, request, tmp_path, monkeypatch):
    archive, sources = _tiny_imagenet(np.random.default_rng(0))
    url = _serve(mirror, request, archive, monkeypatch)
    dest = DOWNLOADERS["tiny-imagenet"](tmp_path / "ti", url)
    assert _leftovers(dest) == ["tiny-imagenet-200", ZIP]

    ds = load_tiny_imagenet(dest)
    assert _leftovers(dest) == ["tiny-imagenet-200", "tiny-imagenet-200.uint8", ZIP]
    assert ds.name == "tiny-imagenet" and ds.num_classes == 3
    assert ds.x_train.shape == (6, 3, 64, 64) and ds.x_test.shape == (3, 3, 64, 64)
    assert ds.x_train.dtype == np.uint8 and ds.y_train.dtype == np.int64
    # classes by sorted wnid: n01443537 -> 0, n02124075 -> 1, n09999999 -> 2
    assert ds.y_train.tolist() == [0, 0, 0, 1, 2, 2]
    assert np.bincount(ds.y_train).tolist() == [3, 1, 2]
    assert ds.y_test.tolist() == [1, 2, 1]  # the val split, in annotation order
    # pixels: Pillow's decode of each file, close to the image that was encoded
    folder = dest / "tiny-imagenet-200"
    train_names = [
        f"tiny-imagenet-200/train/{w}/images/{w}_{i}.JPEG"
        for w in sorted(WNIDS)
        for i in range(TRAIN_PER_CLASS[w])
    ]
    for i, name in enumerate(train_names):
        np.testing.assert_array_equal(ds.x_train[i], _pil_rgb(dest / name))
        source = sources[name]
        source = np.stack([source] * 3) if source.ndim == 2 else source.transpose(2, 0, 1)
        assert np.abs(ds.x_train[i].astype(int) - source).max() <= 8  # JPEG at quality 95
    # the grayscale JPEG became RGB with the gray value in every channel
    gray = ds.x_train[train_names.index(GRAY)]
    assert Image.open(dest / GRAY).mode == "L"
    np.testing.assert_array_equal(gray[0], gray[1])
    np.testing.assert_array_equal(gray[0], gray[2])
    np.testing.assert_array_equal(ds.x_test[0], _pil_rgb(folder / "val" / "images" / "val_0.JPEG"))
    scaled = np.asarray(ds.x_train, dtype=np.float64) / 255
    np.testing.assert_allclose(ds.pixels.mean, scaled.mean(axis=(0, 2, 3)), rtol=1e-12)
    np.testing.assert_allclose(ds.pixels.std, scaled.std(axis=(0, 2, 3)), rtol=1e-12)

    def no_decoding(paths, *args):
        raise AssertionError(f"decoded {paths} again")

    monkeypatch.setattr(tiny, "decode_files", no_decoding)
    again = load_tiny_imagenet(dest)
    assert isinstance(again.x_train, np.memmap)
    np.testing.assert_array_equal(again.x_train, ds.x_train)
    np.testing.assert_array_equal(again.y_test, ds.y_test)
    assert again.pixels == ds.pixels


def test_checksum_mismatch_deletes_the_zip_and_says_so(mirror, request, tmp_path, monkeypatch):
    archive, _ = _tiny_imagenet(np.random.default_rng(1))
    url = _serve(mirror, request, archive, monkeypatch, inject=False)
    dest = tmp_path / "dest"
    with pytest.raises(DownloadError) as err:
        DOWNLOADERS["tiny-imagenet"](dest, url)
    message = str(err.value)
    assert "90528d7ca1a48142e341f4ef8d21d0de" in message and "third-party" in message
    assert "was deleted" in message
    assert _leftovers(dest) == []


def test_truncated_zip_is_named_and_leaves_nothing(mirror, request, tmp_path, monkeypatch):
    archive, _ = _tiny_imagenet(np.random.default_rng(2))
    url = _serve(mirror, request, archive[: len(archive) - 30], monkeypatch)  # no end record
    dest = tmp_path / "dest"
    with pytest.raises(DownloadError, match=rf"{ZIP} could not be extracted, it is truncated"):
        DOWNLOADERS["tiny-imagenet"](dest, url)
    assert _leftovers(dest) == []


@pytest.mark.parametrize(
    "name", ["tiny-imagenet-200/../../evil.txt", "/tmp/evil.txt"], ids=["dotdot", "absolute"]
)
def test_zip_path_traversal_is_refused(mirror, request, tmp_path, monkeypatch, name):
    archive = _zip({"tiny-imagenet-200/wnids.txt": b"n0\n", name: b"evil"})
    url = _serve(mirror, request, archive, monkeypatch)
    dest = tmp_path / "a" / "b"
    with pytest.raises(DownloadError, match="path traversal"):
        DOWNLOADERS["tiny-imagenet"](dest, url)
    assert _leftovers(dest) == [ZIP]
    assert not (tmp_path / "evil.txt").exists() and not (tmp_path / "a" / "evil.txt").exists()


def _extracted(tmp_path: Path, rng: np.random.Generator) -> Path:
    archive, _ = _tiny_imagenet(rng)
    with zipfile.ZipFile(io.BytesIO(archive)) as zf:
        zf.extractall(tmp_path)
    return tmp_path / "tiny-imagenet-200"


def test_an_unknown_wnid_in_the_annotations_is_named(tmp_path):
    folder = _extracted(tmp_path, np.random.default_rng(3))
    annotations = folder / "val" / "val_annotations.txt"
    annotations.write_text(annotations.read_text() + "val_9.JPEG\tn00000000\t0\t0\t1\t1\n")
    with pytest.raises(ValueError, match=r"val_annotations\.txt, line 4: .*n00000000"):
        load_tiny_imagenet(tmp_path)
    assert _leftovers(tmp_path) == ["tiny-imagenet-200"]  # no cache, no temporary directory


def test_an_image_of_the_wrong_size_is_named(tmp_path):
    folder = _extracted(tmp_path, np.random.default_rng(4))
    wrong = folder / "val" / "images" / "val_1.JPEG"
    wrong.write_bytes(_smooth(np.random.default_rng(5), "RGB", size=32)[1])
    with pytest.raises(ValueError, match=r"val_1\.JPEG: image is 32x32; .* are 64x64"):
        load_tiny_imagenet(folder)  # the folder itself is accepted as the path too


def test_missing_tiny_imagenet_names_the_file_the_places_and_the_command(tmp_path):
    folder = tmp_path / "tiny-imagenet-200"
    folder.mkdir()
    (folder / "wnids.txt").write_text("n01443537\n")
    with pytest.raises(DatasetNotFoundError) as err:
        load_tiny_imagenet(tmp_path)
    message = str(err.value)
    assert f"{folder} (missing val/val_annotations.txt)" in message
    assert "hetfl data download tiny-imagenet" in message
