"""HAM10000 against files built here in the release's layout: `HAM10000_images_part_1.zip`
and `_part_2.zip` of ISIC_*.jpg and `HAM10000_metadata.csv`; the two test splits (random,
by seed; by lesion, never straddling); the errors a broken copy gets."""

from __future__ import annotations

import io
import math
import zipfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from hetfl.assembly import load_dataset
from hetfl.cli import cmd_download
from hetfl.config import RunConfig
from hetfl.data import DatasetNotFoundError, load_ham10000
from hetfl.data import ham10000 as ham

#: Lesions as (diagnosis, images); many with several images, as in HAM10000.
LESIONS = [(dx, 1 + (i * 7 + k) % 3) for k, dx in enumerate(ham.CLASSES) for i in range(3)]
HEADER = "lesion_id,image_id,dx,dx_type,age,sex,localization"


def _jpeg(j: int) -> bytes:
    """Image j: flat, its red value 10 + 5j (so a decoded pixel tells which image it is),
    40x30 like the release's 600x450 (resized to 64x64 by the loader)."""
    pixels = np.empty((30, 40, 3), dtype=np.uint8)
    pixels[:] = (10 + 5 * j, 200 - 3 * j, 128)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=100, subsampling=0)
    return buffer.getvalue()


def _release(folder: Path) -> list[tuple[str, str, str]]:
    """The release's three files in `folder`; the (lesion, image, dx) rows, in file order
    (a lesion's images are not adjacent, as in the real metadata)."""
    rows = []
    for n, (dx, count) in enumerate(LESIONS):
        rows += [(f"HAM_{n:07d}", dx) for _ in range(count)]
    order = np.random.default_rng(1).permutation(len(rows))
    rows = [
        (lesion, f"ISIC_{24306 + j:07d}", dx)
        for j, (lesion, dx) in enumerate(rows[i] for i in order)
    ]
    folder.mkdir(parents=True)
    lines = [HEADER] + [f"{lesion},{image},{dx},histo,45.0,male,back" for lesion, image, dx in rows]
    (folder / ham.METADATA).write_text("\n".join(lines) + "\n")
    half = len(rows) // 2
    for part, chunk in zip(ham.PARTS, (rows[:half], rows[half:]), strict=True):
        with zipfile.ZipFile(folder / f"{part}.zip", "w") as zf:
            for _, image, _ in chunk:
                zf.writestr(f"{image}.jpg", _jpeg(int(image[5:]) - 24306))
    return rows


def _image_of(x: np.ndarray) -> int:
    """Which image a decoded sample is, from its red value; it must be flat."""
    assert x.shape == (3, 64, 64) and int(np.ptp(x, axis=(1, 2)).max()) <= 2
    return round((float(x[0].mean()) - 10) / 5)


def _sides(ds, rows) -> tuple[list[int], list[int]]:
    """The image numbers of the train and test samples, checked against their labels."""
    sides = []
    for x, y in ((ds.x_train, ds.y_train), (ds.x_test, ds.y_test)):
        images = [_image_of(sample) for sample in x]
        assert [ham.CLASSES[k] for k in y] == [rows[j][2] for j in images]
        sides.append(images)
    return sides[0], sides[1]


def test_random_split_pixels_labels_and_seed(tmp_path, monkeypatch):
    rows = _release(tmp_path / "HAM10000")
    ds = load_ham10000(tmp_path, seed=3)
    n = len(rows)
    assert ds.name == "ham10000" and ds.num_classes == 7 and ds.x_train.dtype == np.uint8
    assert ds.x_test.shape == (math.ceil(0.2 * n), 3, 64, 64)
    train, test = _sides(ds, rows)
    assert sorted(train + test) == list(range(n))  # every image once, in metadata order
    assert train == sorted(train) and test == sorted(test)
    scaled = np.asarray(ds.x_train, dtype=np.float64) / 255
    np.testing.assert_allclose(ds.pixels.mean, scaled.mean(axis=(0, 2, 3)), rtol=1e-12)
    # images drawn at random: some lesion has images on both sides (why `lesion` exists)
    lesion = {j: rows[j][0] for j in range(n)}
    assert {lesion[j] for j in train} & {lesion[j] for j in test}

    def no_decoding(*args, **kwargs):
        raise AssertionError("decoded again")

    monkeypatch.setattr(ham, "decode_rgb", no_decoding)  # later loads read the cache
    again = load_ham10000(tmp_path, seed=3)
    np.testing.assert_array_equal(again.x_test, ds.x_test)
    np.testing.assert_array_equal(again.y_train, ds.y_train)
    other = load_ham10000(tmp_path, seed=4)
    assert _sides(other, rows)[1] != test
    metadata = tmp_path / "HAM10000" / ham.METADATA
    lines = metadata.read_text().splitlines()
    metadata.write_text("\n".join([lines[0], *lines[:0:-1]]) + "\n")  # rows reordered
    with pytest.raises(ValueError, match=r"HAM10000\.uint8 holds other images than .* delete"):
        load_ham10000(tmp_path)


def test_lesion_split_never_straddles_and_follows_the_seed(tmp_path):
    rows = _release(tmp_path / "HAM10000")
    lesion = [r[0] for r in rows]
    tests = []
    for seed in (0, 1, 2):
        ds = load_ham10000(tmp_path / "HAM10000", seed=seed, split="lesion")
        train, test = _sides(ds, rows)
        assert sorted(train + test) == list(range(len(rows)))
        assert not {lesion[j] for j in train} & {lesion[j] for j in test}
        for dx in ham.CLASSES:  # each class's share reached, by whole lesions
            of_class = [j for j in range(len(rows)) if rows[j][2] == dx]
            in_test = [j for j in test if rows[j][2] == dx]
            assert len(in_test) >= math.ceil(0.2 * len(of_class))
            assert len(in_test) < math.ceil(0.2 * len(of_class)) + 3  # one lesion at most over
        tests.append(test)
    again = load_ham10000(tmp_path / "HAM10000", seed=1, split="lesion")
    assert _sides(again, rows)[1] == tests[1]
    assert tests[0] != tests[1] or tests[1] != tests[2]


def test_folders_as_kaggle_ships_them_and_data_split_in_a_config(tmp_path):
    rows = _release(tmp_path / "zips" / "HAM10000")
    folder = tmp_path / "folders" / "HAM10000"
    folder.mkdir(parents=True)
    (folder / ham.METADATA).write_bytes(
        (tmp_path / "zips" / "HAM10000" / ham.METADATA).read_bytes()
    )
    for part in ham.PARTS:
        with zipfile.ZipFile(tmp_path / "zips" / "HAM10000" / f"{part}.zip") as zf:
            zf.extractall(folder / part)
    cfg = RunConfig.model_validate(
        {"seed": 5, "data": {"dataset": "ham10000", "path": str(folder), "split": "lesion"}}
    )
    from_folders = load_dataset(cfg)
    from_zips = load_ham10000(tmp_path / "zips", seed=5, split="lesion")
    np.testing.assert_array_equal(from_folders.x_test, from_zips.x_test)
    np.testing.assert_array_equal(from_folders.y_train, from_zips.y_train)
    _sides(from_folders, rows)


def test_bad_settings_and_broken_copies_are_named(tmp_path):
    _release(tmp_path / "HAM10000")
    with pytest.raises(
        ValueError, match="unknown HAM10000 split 'patient'; choose one of random, lesion"
    ):
        load_ham10000(tmp_path, split="patient")
    for data, message in (
        ({"dataset": "ham10000", "split": "patient"}, "unknown split 'patient' for ham10000"),
        ({"dataset": "cifar10", "split": "lesion"}, "split is only for datasets that draw"),
    ):
        with pytest.raises(ValueError, match=message):
            RunConfig.model_validate({"data": data})
    with pytest.raises(
        DatasetNotFoundError, match=r"ham10000 not found; it needs HAM10000_metadata\.csv"
    ):
        load_ham10000(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match=r"does not download ham10000; .*doi\.org/10\.7910"):
        cmd_download("ham10000", None, None)

    metadata = tmp_path / "HAM10000" / ham.METADATA
    good = metadata.read_text()
    metadata.write_text(good.replace(",nv,", ",naevus,", 1))
    with pytest.raises(ValueError, match=r"metadata\.csv, line \d+: dx 'naevus' is none of"):
        load_ham10000(tmp_path)
    metadata.write_text(good.replace("lesion_id", "lesion", 1))
    with pytest.raises(ValueError, match="no column lesion_id"):
        load_ham10000(tmp_path)
    metadata.write_text(good + "HAM_0000000,ISIC_9999998,vasc,histo,50.0,female,face\n")
    with pytest.raises(ValueError, match="lesion HAM_0000000 is vasc here but akiec on an earlier"):
        load_ham10000(tmp_path)
    metadata.write_text(HEADER + "\n")
    with pytest.raises(ValueError, match=r"metadata\.csv: lists no images"):
        load_ham10000(tmp_path)
    metadata.write_text(good + "HAM_9999999,ISIC_9999999,mel,histo,50.0,female,face\n")
    with pytest.raises(ValueError, match="lists image ISIC_9999999, which is in neither"):
        load_ham10000(tmp_path)
    metadata.write_text(good)
    (tmp_path / "HAM10000" / f"{ham.PARTS[1]}.zip").unlink()
    with pytest.raises(ValueError, match=r"holds neither HAM10000_images_part_2\.zip nor"):
        load_ham10000(tmp_path)
    assert not (tmp_path / "HAM10000.uint8").exists()


def test_an_image_is_resized_to_64x64_bicubic_as_dtfls_code(tmp_path):
    ramp = np.linspace(0, 255, 40)
    pixels = np.stack(np.broadcast_arrays(ramp[None, :], ramp[:, None][:30], 90), axis=-1)
    path = tmp_path / "ISIC_0000000.png"  # lossless, so the reference is exact
    Image.fromarray(pixels.astype(np.uint8)).save(path)
    with Image.open(path) as image:
        want = np.asarray(image.resize((64, 64), Image.Resampling.BICUBIC)).transpose(2, 0, 1)
        nearest = np.asarray(image.resize((64, 64), Image.Resampling.NEAREST)).transpose(2, 0, 1)
    got = ham.decode_rgb(path, path.name, ham.SIZE, "HAM10000", resize=True)
    np.testing.assert_array_equal(got, want)
    assert not np.array_equal(got, nearest)
