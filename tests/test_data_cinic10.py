"""CINIC-10 against an archive built here in the release's layout: `CINIC-10.tar.gz` with
`train/`, `valid/`, `test/` at its root, one folder per class, 32x32 PNGs (some grayscale),
extracted as its README says; no network."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from hetfl.cli import cmd_download
from hetfl.data import DATASETS, DatasetNotFoundError, load_cinic10
from hetfl.data import cinic10 as cinic

#: Images per class in each split (class k has k % 3 + 1 in train: unequal on purpose).
TRAIN = {name: k % 3 + 1 for k, name in enumerate(cinic.CLASSES)}
GRAY = "train/cat/n02121808_7.png"


def _png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels, "L" if pixels.ndim == 2 else "RGB").save(buffer, format="PNG")
    return buffer.getvalue()


def _archive(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """`CINIC-10.tar.gz` (members at the root, as the release) and each image's (3, 32, 32)
    pixels by member name."""
    rng = np.random.default_rng(0)
    members: dict[str, bytes] = {"README.md": b"CINIC-10\n"}
    pixels: dict[str, np.ndarray] = {}
    counts = {"train": TRAIN, "valid": dict.fromkeys(cinic.CLASSES, 2), "test": {}}
    counts["test"] = {name: 1 + (k == 0) for k, name in enumerate(cinic.CLASSES)}
    for split, per_class in counts.items():
        for name, count in per_class.items():
            for i in range(count):
                # CIFAR-10 and ImageNet file names side by side, as in the release
                stem = f"cifar10-{split}-{i}" if i % 2 else f"n02121808_{7 - i}"
                member = f"{split}/{name}/{stem}.png"
                image = rng.integers(0, 256, size=(32, 32, 3), dtype=np.uint8)
                if member == GRAY:
                    image = image[:, :, 0]
                    pixels[member] = np.stack([image] * 3)
                else:
                    pixels[member] = image.transpose(2, 0, 1)
                members[member] = _png(image)
    path = tmp_path / "CINIC-10.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path, pixels


def _extracted(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """The archive extracted as the README says: `mkdir CINIC-10 && tar -xzf ... -C CINIC-10`."""
    archive, pixels = _archive(tmp_path)
    with tarfile.open(archive) as tar:
        tar.extractall(tmp_path / "data" / "CINIC-10", filter="data")
    return tmp_path / "data", pixels


def _in_order(pixels: dict[str, np.ndarray], split: str) -> list[str]:
    """The members of `split` in the loader's order: by class, then file name."""
    return [
        m
        for name in cinic.CLASSES
        for m in sorted(m for m in pixels if m.startswith(f"{split}/{name}/"))
    ]


def test_pixels_and_labels_of_the_release_layout_then_the_cache(tmp_path, monkeypatch):
    data, pixels = _extracted(tmp_path)
    ds = load_cinic10(data)
    assert ds.name == "cinic10" and ds.num_classes == 10
    assert ds.x_train.dtype == np.uint8 and ds.x_train.shape == (sum(TRAIN.values()), 3, 32, 32)
    assert ds.x_test.shape == (11, 3, 32, 32)  # valid/ (20 images) is not read
    train, test = _in_order(pixels, "train"), _in_order(pixels, "test")
    for x, members in ((ds.x_train, train), (ds.x_test, test)):
        for i, member in enumerate(members):
            np.testing.assert_array_equal(x[i], pixels[member])  # PNG: exact
    # classes in sorted order: airplane 0 .. truck 9; train counts 1, 2, 3, 1, ...
    assert ds.y_train.tolist() == [
        k for k, name in enumerate(cinic.CLASSES) for _ in range(TRAIN[name])
    ]
    assert ds.y_test.tolist() == [0, 0, *range(1, 10)]
    gray = ds.x_train[train.index(GRAY)]
    np.testing.assert_array_equal(gray[0], gray[2])
    scaled = np.asarray(ds.x_train, dtype=np.float64) / 255
    np.testing.assert_allclose(ds.pixels.mean, scaled.mean(axis=(0, 2, 3)), rtol=1e-12)
    np.testing.assert_allclose(ds.pixels.std, scaled.std(axis=(0, 2, 3)), rtol=1e-12)
    assert sorted(p.name for p in data.iterdir()) == ["CINIC-10", "CINIC-10.uint8"]

    def no_decoding(paths, *args):
        raise AssertionError(f"decoded {paths} again")

    monkeypatch.setattr(cinic, "decode_files", no_decoding)
    monkeypatch.setenv("HETFL_DATA", str(data))
    again = DATASETS.get("cinic10")()  # found through $HETFL_DATA/CINIC-10, read from the cache
    assert isinstance(again.x_train, np.memmap)
    np.testing.assert_array_equal(again.x_test, ds.x_test)
    np.testing.assert_array_equal(again.y_train, ds.y_train)
    assert again.pixels == ds.pixels


def test_a_missing_class_folder_is_named_before_anything_is_decoded(tmp_path):
    data, _ = _extracted(tmp_path)
    for png in (data / "CINIC-10" / "test" / "truck").iterdir():
        png.unlink()
    (data / "CINIC-10" / "test" / "truck").rmdir()
    with pytest.raises(ValueError, match=r"test/truck: no such directory; .* one folder per class"):
        load_cinic10(data / "CINIC-10")
    assert not (data / "CINIC-10.uint8").exists()


def test_an_image_of_the_wrong_size_is_named(tmp_path):
    data, _ = _extracted(tmp_path)
    bad = data / "CINIC-10" / "test" / "dog" / "n02121808_7.png"
    bad.write_bytes(_png(np.zeros((28, 30, 3), dtype=np.uint8)))
    with pytest.raises(
        ValueError, match=r"dog/n02121808_7\.png: image is 30x28; CINIC-10 .* 32x32"
    ):
        load_cinic10(data)


def test_missing_cinic10_names_the_folders_the_places_and_the_fix(tmp_path):
    (tmp_path / "CINIC-10" / "train").mkdir(parents=True)
    with pytest.raises(DatasetNotFoundError) as info:
        load_cinic10(tmp_path)
    message = str(info.value)
    assert "cinic10 not found; it needs train/, test/" in message
    assert f"{tmp_path / 'CINIC-10'} (missing test/)" in message
    assert "tar -xzf CINIC-10.tar.gz -C CINIC-10" in message
    assert "no checksum is published" in message
    with pytest.raises(ValueError, match=r"HetFL does not download cinic10; get it by downloading"):
        cmd_download("cinic10", None, None)
