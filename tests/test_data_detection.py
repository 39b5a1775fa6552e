"""Detection data: PASCAL VOC from archives built here in the development kit's layout and
served from 127.0.0.1, and the seeded synthetic shapes; no network."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from hetfl.assembly import build_federation
from hetfl.config import ConfigError, validate
from hetfl.data import voc
from hetfl.data.archives import ARCHIVE_MD5
from hetfl.data.detection import DetectionSet, pad_targets
from hetfl.data.detection_views import DetectionGroup, detection_clients, restrict_targets
from hetfl.data.download import DOWNLOADERS
from hetfl.data.fetch import DownloadError, md5_of
from hetfl.data.synthetic_detection import synthetic_detection
from local_mirror import LocalMirror

SIDE = 16


def _xml(
    width: int, height: int, objects: list[tuple[str, int, tuple[int, int, int, int]]]
) -> bytes:
    body = "".join(
        f"<object><name>{name}</name><pose>Left</pose><truncated>0</truncated>"
        f"<difficult>{difficult}</difficult><bndbox><xmin>{b[0]}</xmin><ymin>{b[1]}</ymin>"
        f"<xmax>{b[2]}</xmax><ymax>{b[3]}</ymax></bndbox></object>"
        for name, difficult, b in objects
    )
    return (
        f"<annotation><folder>VOC2007</folder><size><width>{width}</width>"
        f"<height>{height}</height><depth>3</depth></size>{body}</annotation>"
    ).encode()


def _image(pixels: np.ndarray, fmt: str) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt)
    return buffer.getvalue()


def _tar(path: Path, members: dict[str, bytes]) -> bytes:
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path.read_bytes()


ROOT = "VOCdevkit/VOC2007"
#: trainval: a 16x16 PNG (pixels kept exactly) with a dog and a difficult person; a 40x20
#: JPEG with a car. test: one 32x32 JPEG with a cat.
PNG = np.random.default_rng(0).integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)


def _archives(tmp_path: Path) -> dict[str, bytes]:
    trainval = {
        f"{ROOT}/ImageSets/Main/trainval.txt": b"000005\n000007\n",
        f"{ROOT}/ImageSets/Main/dog_trainval.txt": b"000005  1\n000007 -1\n",
        f"{ROOT}/Annotations/000005.xml": _xml(
            SIDE, SIDE, [("dog", 0, (1, 3, 8, 16)), ("person", 1, (9, 1, 16, 4))]
        ),
        f"{ROOT}/JPEGImages/000005.png": _image(PNG, "PNG"),
        f"{ROOT}/Annotations/000007.xml": _xml(40, 20, [("car", 0, (11, 6, 30, 15))]),
        f"{ROOT}/JPEGImages/000007.jpg": _image(np.full((20, 40, 3), 90, np.uint8), "JPEG"),
    }
    test = {
        f"{ROOT}/ImageSets/Main/test.txt": b"000001\n",
        f"{ROOT}/Annotations/000001.xml": _xml(32, 32, [("cat", 0, (1, 1, 32, 16))]),
        f"{ROOT}/JPEGImages/000001.jpg": _image(np.full((32, 32, 3), 200, np.uint8), "JPEG"),
    }
    return {
        "VOCtrainval_06-Nov-2007.tar": _tar(tmp_path / "a.tar", trainval),
        "VOCtest_06-Nov-2007.tar": _tar(tmp_path / "b.tar", test),
    }


@pytest.fixture
def served(tmp_path, monkeypatch):
    root = tmp_path / "mirror"
    (root / "voc").mkdir(parents=True)
    for name, data in _archives(tmp_path).items():
        (root / "voc" / name).write_bytes(data)
        monkeypatch.setitem(ARCHIVE_MD5, name, md5_of(root / "voc" / name))
    mirror = LocalMirror(root)
    yield mirror
    mirror.close()


def test_both_archives_are_fetched_verified_merged_and_loaded(served, tmp_path):
    dest = DOWNLOADERS["voc2007"](tmp_path / "voc", served.mirror("voc"))
    assert sorted(served.requests) == [
        "/voc/VOCtest_06-Nov-2007.tar",
        "/voc/VOCtrainval_06-Nov-2007.tar",
    ]
    ds = voc.load_voc(dest, side=SIDE)
    assert ds.name == "voc2007" and ds.num_classes == 20 and ds.input_shape == (3, SIDE, SIDE)
    np.testing.assert_array_equal(ds.x_train[0], PNG.transpose(2, 0, 1))  # no resize: exact
    assert ds.x_train[1].shape == (3, SIDE, SIDE) and ds.x_test.shape == (1, 3, SIDE, SIDE)
    dog, person, car, cat = (voc.CLASSES.index(c) for c in ("dog", "person", "car", "cat"))
    # 1-based inclusive pixels: (xmin - 1) / W .. xmax / W; difficult kept with its flag
    np.testing.assert_allclose(
        ds.targets_train[0],
        [[dog, 0 / 16, 2 / 16, 8 / 16, 16 / 16, 0], [person, 8 / 16, 0, 1, 4 / 16, 1]],
    )
    np.testing.assert_allclose(
        ds.targets_train[1], [[car, 10 / 40, 5 / 20, 30 / 40, 15 / 20, 0], [-1, 0, 0, 0, 0, 0]]
    )
    np.testing.assert_allclose(ds.targets_test[0], [[cat, 0, 0, 1, 0.5, 0]])
    # a second download fetches nothing; the second load reads the cache
    before = len(served.requests)
    assert DOWNLOADERS["voc2007"](tmp_path / "voc", served.mirror("voc")) == dest
    assert len(served.requests) == before
    assert (dest / "VOCdevkit" / f"VOC2007.{SIDE}px-trainval-test.uint8").is_dir()
    again = voc.load_voc(dest, side=SIDE)
    np.testing.assert_array_equal(again.targets_train, ds.targets_train)


def test_a_damaged_archive_is_refused(served, tmp_path):
    (served.root / "voc" / "VOCtest_06-Nov-2007.tar").write_bytes(b"not a tar")
    with pytest.raises(DownloadError, match="MD5 mismatch"):
        DOWNLOADERS["voc2007"](tmp_path / "voc", served.mirror("voc"))
    assert not (tmp_path / "voc" / "VOCdevkit").exists()


def _extracted(tmp_path: Path, name: str = "dog", image: bool = True) -> Path:
    base = tmp_path / "data" / ROOT
    for sub in ("Annotations", "ImageSets/Main", "JPEGImages"):
        (base / sub).mkdir(parents=True)
    (base / "ImageSets/Main/trainval.txt").write_text("1\n")
    (base / "ImageSets/Main/test.txt").write_text("1\n")
    (base / "Annotations/1.xml").write_bytes(_xml(SIDE, SIDE, [(name, 0, (1, 1, 4, 4))]))
    if image:
        (base / "JPEGImages/1.png").write_bytes(_image(PNG, "PNG"))
    return tmp_path / "data"


def test_bad_annotations_and_missing_files_are_named(tmp_path):
    with pytest.raises(ValueError, match="'unicorn' is not a VOC class"):
        voc.load_voc(_extracted(tmp_path / "a", name="unicorn"), side=SIDE)
    with pytest.raises(ValueError, match=r"no 1\.jpg or 1\.png"):
        voc.load_voc(_extracted(tmp_path / "b", image=False), side=SIDE)
    with pytest.raises(ValueError, match="no such image set; VOC2007 has"):
        voc.load_voc(_extracted(tmp_path / "c"), side=SIDE, test_set="val")
    with pytest.raises(FileNotFoundError, match="voc2007 not found"):
        voc.load_voc(tmp_path / "nowhere")


def test_synthetic_scenes_are_seeded_and_the_same_at_every_resolution():
    small = synthetic_detection(n_train=6, n_test=2, num_classes=4, side=16, seed=3)
    large = synthetic_detection(n_train=6, n_test=2, num_classes=4, side=48, seed=3)
    assert small.input_shape == (3, 16, 16) and large.input_shape == (3, 48, 48)
    np.testing.assert_array_equal(small.targets_train, large.targets_train)
    again = synthetic_detection(n_train=6, n_test=2, num_classes=4, side=16, seed=3)
    np.testing.assert_array_equal(again.x_train, small.x_train)
    other = synthetic_detection(n_train=6, n_test=2, num_classes=4, side=16, seed=4)
    assert not np.array_equal(other.targets_train, small.targets_train)
    real = small.targets_train[..., 0] >= 0
    assert set(small.targets_train[..., 0][real].astype(int)) <= {0, 1, 2, 3}
    assert (small.targets_train[..., 5] == 0).all()


def test_a_square_fills_its_box_in_its_colour():
    ds = synthetic_detection(n_train=40, n_test=1, num_classes=1, side=32, max_objects=1)
    label, x1, y1, x2, y2, _ = ds.targets_train[0, 0]
    assert label == 0  # the square
    grid = (np.arange(32) + 0.5) / 32
    cols, rows = (grid >= x1) & (grid <= x2), (grid >= y1) & (grid <= y2)
    patch = ds.x_train[0][:, rows][:, :, cols]
    assert patch.size and (patch == patch[:, :1, :1]).all()  # one colour inside


def test_bad_detection_data_is_refused():
    x = np.zeros((1, 3, 8, 8), np.uint8)
    pixels = synthetic_detection(n_train=1, n_test=1, side=8).pixels
    bad = pad_targets([np.array([[0, 0.5, 0.5, 0.4, 0.9, 0]], np.float32)])
    with pytest.raises(ValueError, match=r"x2 <= x1 or y2 <= y1, the first image 0"):
        DetectionSet("d", x, bad, x, pad_targets([[]]), ("a",), pixels)
    bad = pad_targets([np.array([[3, 0.1, 0.1, 0.4, 0.9, 0]], np.float32)])
    with pytest.raises(ValueError, match=r"labels outside 0\.\.K-1"):
        DetectionSet("d", x, bad, x, pad_targets([[]]), ("a",), pixels)
    with pytest.raises(ValueError, match=r"num_classes must be in 1\.\.6"):
        synthetic_detection(num_classes=7)
    with pytest.raises(ValueError, match="min_size <= max_size"):
        synthetic_detection(min_size=0.6, max_size=0.5)


def test_detection_clients_see_their_group_side_and_classes():
    ds = synthetic_detection(n_train=60, n_test=30, num_classes=4, side=32, seed=2)
    groups = [DetectionGroup(16, 2, 2), DetectionGroup(32, 4, 1)]
    clients = detection_clients(ds, groups, seed=0)
    assert [c.cid for c in clients] == [0, 1, 2]
    assert [tuple(c.x_train.shape[2:]) for c in clients] == [(16, 16), (16, 16), (32, 32)]
    for c, k in zip(clients, (2, 2, 4), strict=True):
        labels = c.y_train[..., 0]
        assert set(c.labels) <= set(range(k)) and c.num_classes == k
        assert ((labels == -1) | (labels < k)).all() and (labels >= 0).any(dim=1).all()
    # the full-class client keeps its whole share: 60 images over 3 clients
    assert clients[2].n_train == 20 and clients[0].n_train <= 20
    # a class-0/1 client's images are its share's images holding class 0 or 1, boxes kept
    kept, rows = restrict_targets(ds.targets_train[:5], 2)
    for i, row in zip(kept, rows, strict=True):
        mine = ds.targets_train[i][
            (ds.targets_train[i, :, 0] >= 0) & (ds.targets_train[i, :, 0] < 2)
        ]
        np.testing.assert_array_equal(row[row[:, 0] >= 0], mine)
    again = detection_clients(ds, groups, seed=0)
    assert torch.equal(again[1].y_train, clients[1].y_train)
    with pytest.raises(ValueError, match="a group detects 5 classes"):
        detection_clients(ds, [DetectionGroup(16, 5, 1)], seed=0)
    with pytest.raises(ValueError, match="31 clients but 60 training and 30 test"):
        detection_clients(ds, [DetectionGroup(16, 2, 31)], seed=0)
    with pytest.raises(ValueError, match="clients >= 1"):
        DetectionGroup(16, 2, 0)


def test_a_run_config_reads_voc2007_into_its_client_groups(tmp_path):
    """`data.dataset: voc2007` with `data.path` and one group of 12 classes (VOC's labels
    0..11, dog the 12th) at 8 px: the client holds the extracted set's one dog, resized."""
    raw = {
        "algorithm": "scalablefl",
        "data": {
            "dataset": "voc2007",
            "path": str(_extracted(tmp_path)),
            "groups": [{"size": 8, "classes": 12, "clients": 1}],
        },
        "model": {"name": "ssd-stage-cnn", "stages": 1},
        "train": {"clients_per_round": 1},
    }
    (client,) = build_federation(validate(raw), torch.device("cpu")).clients
    assert client.x_train.shape == (1, 3, 8, 8) and client.num_classes == 12
    dog = voc.CLASSES.index("dog")
    np.testing.assert_allclose(client.y_train[0], [[dog, 0, 0, 4 / 16, 4 / 16, 0]])
    raw["data"]["groups"][0]["samples"] = 5
    with pytest.raises(ConfigError, match=r"voc2007 deals its whole training set"):
        validate(raw)
