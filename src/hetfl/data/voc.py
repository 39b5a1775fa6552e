"""PASCAL VOC detection data from its development-kit layout, decoded once into a cache.

The layout of the VOC releases (Everingham et al., "The PASCAL Visual Object Classes (VOC)
Challenge", IJCV 2010, and the development kit's documentation), as the 2007 archives
`VOCtrainval_06-Nov-2007.tar` and `VOCtest_06-Nov-2007.tar` extract, both into one
`VOCdevkit/`:

    VOCdevkit/VOC2007/ImageSets/Main/<set>.txt   image ids, one a line (train, val,
                                                 trainval, test)
    VOCdevkit/VOC2007/Annotations/<id>.xml       <size> and one <object> per object:
                                                 <name>, <difficult>, <bndbox> xmin ymin
                                                 xmax ymax (1-based, inclusive pixels)
    VOCdevkit/VOC2007/JPEGImages/<id>.jpg        the image (a .png is read too)

Every image is resized to `side` x `side` (ScalableFL, Nitta et al., arXiv 2311.08716,
Table IX: VOC at 256) with Pillow's bicubic filter; boxes become image fractions,
(xmin - 1) / width .. xmax / width, so resizing leaves them where they were. `difficult`
objects are kept with their flag (scoring ignores them, `hetfl.core.client.average_
precision`); truncated and occluded flags are not read. An object whose class is not one of
the 20 VOC classes, an annotation that lacks a field, or an id without its image is an
error naming the file.

Train and test are the image sets `train_set` (default `trainval`) and `test_set`
(default `test`), SSD's VOC2007 protocol (Liu et al., ECCV 2016, §3.1 reads VOC2007
trainval, with VOC2012 trainval besides, and tests on VOC2007 test). The first load
decodes into `<VOCyyyy>.<side>px-<train>-<test>.uint8/` beside the year's folder (which
must be writable then); later loads memory-map it.

`hetfl data download voc2007` fetches both 2007 archives, checks each against its MD5
(the values torchvision's `VOCDetection` publishes), and places the merged `VOCdevkit/`.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np

from hetfl.data.archives import ARCHIVE_MD5, Archive, download_archives, find_extracted
from hetfl.data.decoded import decode_rgb, norm_array, norm_of_array, read_arrays, write_arrays
from hetfl.data.detection import DetectionSet, pad_targets
from hetfl.data.fetch import ProgressCallback
from hetfl.data.pixel_stats import pixel_norm_of

#: The 20 VOC classes, in the development kit's order (label 0 .. 19).
CLASSES = (
    "aeroplane",
    "bicycle",
    "bird",
    "boat",
    "bottle",
    "bus",
    "car",
    "cat",
    "chair",
    "cow",
    "diningtable",
    "dog",
    "horse",
    "motorbike",
    "person",
    "pottedplant",
    "sheep",
    "sofa",
    "train",
    "tvmonitor",
)

_MIRROR = "http://host.robots.ox.ac.uk/pascal/VOC/voc2007/"
_SOURCE = (
    "third-party: the value torchvision's VOCDetection publishes (torchvision/datasets/voc.py)"
)
#: The two 2007 archives; both extract into `VOCdevkit/`.
ARCHIVES_2007 = (
    Archive("voc2007", "VOCtrainval_06-Nov-2007.tar", "VOCdevkit", _MIRROR, _SOURCE),
    Archive("voc2007", "VOCtest_06-Nov-2007.tar", "VOCdevkit", _MIRROR, _SOURCE),
)
ARCHIVE_MD5.update(
    {
        "VOCtrainval_06-Nov-2007.tar": "c52e279531787c972589f7e41ab4ae64",
        "VOCtest_06-Nov-2007.tar": "b6e924de25625d8de591ea690078ad9f",
    }
)


def download_voc2007(
    dest: str | Path | None = None,
    mirror: str | None = None,
    *,
    timeout: float = 60,
    progress: ProgressCallback | None = None,
) -> Path:
    """Fetch and verify both 2007 archives and place their merged `VOCdevkit/` in `dest`
    (default `<cache>/voc2007`); return `dest`, what `load_voc` takes as `path`."""
    return download_archives(ARCHIVES_2007, dest, mirror, timeout=timeout, progress=progress)


def read_annotation(path: Path) -> tuple[tuple[int, int], np.ndarray]:
    """((width, height), the (m, 6) object rows) of one annotation file."""
    try:
        root = ET.parse(path).getroot()
        width, height = (int(_text(root, f"size/{k}", path)) for k in ("width", "height"))
        rows = []
        for obj in root.iter("object"):
            name = _text(obj, "name", path).strip()
            if name not in CLASSES:
                raise ValueError(f"{path}: object class {name!r} is not a VOC class ({CLASSES})")
            box = [float(_text(obj, f"bndbox/{k}", path)) for k in ("xmin", "ymin", "xmax", "ymax")]
            difficult = obj.findtext("difficult", "0").strip() == "1"
            x1, y1 = (box[0] - 1) / width, (box[1] - 1) / height
            x2, y2 = box[2] / width, box[3] / height
            rows.append([CLASSES.index(name), x1, y1, x2, y2, float(difficult)])
    except ET.ParseError as exc:
        raise ValueError(f"{path}: not a readable annotation ({exc})") from exc
    objects = np.array(rows, dtype=np.float32).reshape(-1, 6)
    objects[:, 1:5] = objects[:, 1:5].clip(0, 1)
    return (width, height), objects


def _text(node: ET.Element, field: str, path: Path) -> str:
    value = node.findtext(field)
    if value is None:
        raise ValueError(f"{path}: the annotation has no <{field}>")
    return value


def image_ids(year_dir: Path, image_set: str) -> list[str]:
    """The ids of `ImageSets/Main/<image_set>.txt`, in file order."""
    listing = year_dir / "ImageSets" / "Main" / f"{image_set}.txt"
    if not listing.is_file():
        present = sorted(p.stem for p in listing.parent.glob("*.txt") if "_" not in p.stem)
        raise ValueError(f"{listing}: no such image set; {year_dir.name} has {present}")
    return [line.split()[0] for line in listing.read_text().splitlines() if line.strip()]


def read_split(year_dir: Path, image_set: str, side: int) -> tuple[np.ndarray, np.ndarray]:
    """(images (N, 3, side, side) uint8, targets (N, M, 6)) of one image set."""
    ids = image_ids(year_dir, image_set)
    x = np.empty((len(ids), 3, side, side), dtype=np.uint8)
    objects = []
    for i, image_id in enumerate(ids):
        _, rows = read_annotation(year_dir / "Annotations" / f"{image_id}.xml")
        image = _image_file(year_dir, image_id)
        x[i] = decode_rgb(image, str(image), (side, side), "VOC", resize=True)
        objects.append(rows)
    return x, pad_targets(objects)


def _image_file(year_dir: Path, image_id: str) -> Path:
    for suffix in (".jpg", ".png"):
        path = year_dir / "JPEGImages" / f"{image_id}{suffix}"
        if path.is_file():
            return path
    raise ValueError(f"{year_dir / 'JPEGImages'}: no {image_id}.jpg or {image_id}.png")


def load_voc(
    path: str | Path | None = None,
    year: str = "2007",
    side: int = 256,
    train_set: str = "trainval",
    test_set: str = "test",
) -> DetectionSet:
    """VOC detection: `train_set` and `test_set` of `VOC<year>`, images `side` x `side`,
    with the training images' pixel statistics (module docstring)."""
    if side < 1:
        raise ValueError(f"side must be a positive number of pixels, got {side}")
    # where to look; only 2007's archives are downloadable, another year's folder is found
    archive = ARCHIVES_2007[0] if year == "2007" else Archive(f"voc{year}", "", "VOCdevkit", "", "")
    sub = f"VOC{year}/"
    devkit = find_extracted(path, archive, (f"{sub}Annotations/", f"{sub}ImageSets/Main/"))
    year_dir = (devkit / f"VOC{year}").resolve()
    cache = year_dir.parent / f"{year_dir.name}.{side}px-{train_set}-{test_set}.uint8"
    names = ("x_train", "targets_train", "x_test", "targets_test")
    if not cache.is_dir():
        x_train, t_train = read_split(year_dir, train_set, side)
        x_test, t_test = read_split(year_dir, test_set, side)
        arrays = dict(zip(names, (x_train, t_train, x_test, t_test), strict=True))
        arrays["pixels"] = norm_array(pixel_norm_of(x_train))
        write_arrays(
            cache, arrays, "VOC", f"{3 * side * side * (len(x_train) + len(x_test)) / 1e9:.1f} GB"
        )
    arrays = read_arrays(cache, (*names, "pixels"))
    return DetectionSet(
        f"voc{year}",
        arrays["x_train"],
        arrays["targets_train"],
        arrays["x_test"],
        arrays["targets_test"],
        CLASSES,
        norm_of_array(arrays["pixels"]),
    )
