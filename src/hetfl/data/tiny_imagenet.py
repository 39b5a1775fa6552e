"""Tiny-ImageNet-200 from `tiny-imagenet-200.zip`, decoded once into a uint8 cache.

The dataset of Stanford's CS231n (Le and Yang, "Tiny ImageNet Visual Recognition
Challenge", 2015): 200 ImageNet classes, 64x64 colour JPEGs. The zip extracts to

    tiny-imagenet-200/wnids.txt                     the class ids (WordNet ids), one a line
    tiny-imagenet-200/train/<wnid>/images/*.JPEG    500 training images per class
    tiny-imagenet-200/val/images/*.JPEG             10,000 validation images
    tiny-imagenet-200/val/val_annotations.txt       file, wnid, bounding box, tab-separated
    tiny-imagenet-200/test/images/*.JPEG            unlabelled

The test folder has no labels, so the val split is HetFL's test split, as in the FL papers
that report Tiny-ImageNet. Class k is the k-th wnid in sorted order (the order
torchvision's `ImageFolder` gives `train/`); any number of classes and images is accepted.
Some images are grayscale: every image is converted to RGB (the gray value in all three
channels), and one that is not 64x64 is an error naming it.

Decoding 110,000 JPEGs takes minutes, so the first load decodes them once with Pillow into
`tiny-imagenet-200.uint8/` beside the extracted folder (x_train.npy, y_train.npy,
x_test.npy, y_test.npy, pixels.npy with the training set's per-channel mean and std),
written into a temporary directory and renamed into place, so a cache is whole or absent.
Later loads memory-map the image arrays and decode nothing. The directory holding
`tiny-imagenet-200/` must therefore be writable for the first load.

Peak memory: the first load holds the decoded arrays, 110,000 x 12,288 bytes (1.35 GB),
plus the file list (about 30 MB); later loads map the cache, so pages are read as samples
are used and can be shared between processes, up to the same 1.35 GB.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hetfl.core.pixels import PixelNorm
from hetfl.data.archives import ARCHIVES, find_extracted
from hetfl.data.dataset import ARRAY_NAMES, DATASETS, Dataset
from hetfl.data.decoded import (
    decode_files,
    norm_array,
    norm_of_array,
    read_arrays,
    write_arrays,
)
from hetfl.data.pixel_stats import pixel_norm_of

ARCHIVE = ARCHIVES["tiny-imagenet"]
FOLDER = ARCHIVE.folder

#: The files that mark an extracted Tiny-ImageNet folder.
MARKER_FILES = ("wnids.txt", "val/val_annotations.txt")

#: The cache folder's name, beside `tiny-imagenet-200/`.
CACHE_NAME = f"{FOLDER}.uint8"


def read_classes(folder: Path) -> list[str]:
    """The wnids of `wnids.txt`, sorted: class k is the k-th."""
    wnids = sorted({line.strip() for line in (folder / "wnids.txt").read_text().splitlines()})
    wnids = [w for w in wnids if w]
    if not wnids:
        raise ValueError(f"{folder / 'wnids.txt'}: lists no class ids")
    return wnids


def train_files(folder: Path, wnids: list[str]) -> tuple[list[Path], np.ndarray]:
    """Every training image, by class then file name, and its class index."""
    paths: list[Path] = []
    labels: list[int] = []
    for k, wnid in enumerate(wnids):
        images = folder / "train" / wnid / "images"
        if not images.is_dir():
            raise ValueError(
                f"{images}: no such directory; wnids.txt lists {wnid} but the training "
                "images of a class are in train/<wnid>/images/"
            )
        found = sorted(images.glob("*.JPEG"))
        paths += found
        labels += [k] * len(found)
    return paths, np.array(labels, dtype=np.int64)


def val_files(folder: Path, wnids: list[str]) -> tuple[list[Path], np.ndarray]:
    """Every validation image, in annotation-file order, and its class index."""
    annotations = folder / "val" / "val_annotations.txt"
    index = {wnid: k for k, wnid in enumerate(wnids)}
    paths: list[Path] = []
    labels: list[int] = []
    for number, line in enumerate(annotations.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) < 2 or fields[1] not in index:
            raise ValueError(
                f"{annotations}, line {number}: expected 'file<TAB>wnid<TAB>box...' with a "
                f"wnid of wnids.txt, got {line!r}"
            )
        paths.append(folder / "val" / "images" / fields[0])
        labels.append(index[fields[1]])
    return paths, np.array(labels, dtype=np.int64)


def build_cache(folder: Path, cache: Path) -> None:
    """Decode the extracted `folder` into `cache`, placed whole by a rename."""
    wnids = read_classes(folder)
    train_paths, y_train = train_files(folder, wnids)
    test_paths, y_test = val_files(folder, wnids)
    if not train_paths:
        raise ValueError(f"{folder / 'train'}: holds no *.JPEG images")
    x_train = decode_files(train_paths, (64, 64), "Tiny-ImageNet")
    x_test = decode_files(test_paths, (64, 64), "Tiny-ImageNet")
    pixels = pixel_norm_of(x_train)
    arrays = dict(zip(ARRAY_NAMES, (x_train, y_train, x_test, y_test), strict=True))
    arrays["pixels"] = norm_array(pixels)
    write_arrays(cache, arrays, "Tiny-ImageNet", "1.4 GB")


def read_cache(cache: Path) -> tuple[list[np.ndarray], PixelNorm]:
    """The cached arrays in `ARRAY_NAMES` order (images memory-mapped, read-only) and the
    pixel statistics."""
    arrays = read_arrays(cache, (*ARRAY_NAMES, "pixels"))
    return [arrays[name] for name in ARRAY_NAMES], norm_of_array(arrays["pixels"])


def find_tiny_imagenet(path: str | Path | None) -> Path:
    """The extracted `tiny-imagenet-200/` folder (`archives.find_extracted`)."""
    return find_extracted(path, ARCHIVE, MARKER_FILES)


@DATASETS.decorator("tiny-imagenet")
def load_tiny_imagenet(path: str | Path | None = None) -> Dataset:
    """Tiny-ImageNet-200: 100,000 training and 10,000 test (the val split) 64x64 images of
    200 classes, uint8, with the training set's pixel statistics.

    Looks for `tiny-imagenet-200/` in `path` (or `path` itself), else in `$HETFL_DATA`
    (directly or under `tiny-imagenet/`), then in the download cache (`<cache>/tiny-imagenet`,
    what `hetfl data download tiny-imagenet` fills). The first load decodes the JPEGs into
    the cache beside that folder; later loads read the cache.
    """
    folder = find_tiny_imagenet(path)
    cache = folder.parent / CACHE_NAME
    if not cache.is_dir():
        build_cache(folder, cache)
    (x_train, y_train, x_test, y_test), pixels = read_cache(cache)
    return Dataset(
        ARCHIVE.dataset,
        x_train,
        y_train,
        x_test,
        y_test,
        num_classes=len(read_classes(folder)),
        files={name: cache / f"{name}.npy" for name in ARRAY_NAMES},
        pixels=pixels,
    )
