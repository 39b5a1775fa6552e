"""CINIC-10 from the folders of its official release, decoded once into a uint8 cache.

The dataset of Darlow et al., "CINIC-10 is not ImageNet or CIFAR-10" (2018), released by
BayesWatch (https://github.com/BayesWatch/cinic-10) as `CINIC-10.tar.gz` on Edinburgh
DataShare (https://datashare.ed.ac.uk/handle/10283/3192): 270,000 32x32 PNGs, CIFAR-10's
60,000 and 210,000 downsampled ImageNet images of the same 10 classes, in three equal
splits. The archive has no top-level folder; extracted (e.g. `mkdir CINIC-10 && tar -xzf
CINIC-10.tar.gz -C CINIC-10`) it is

    CINIC-10/train/<class>/*.png    90,000 images, 9,000 per class
    CINIC-10/valid/<class>/*.png    90,000
    CINIC-10/test/<class>/*.png     90,000

with the classes airplane, automobile, bird, cat, deer, dog, frog, horse, ship, truck.
HetFL's train split is `train/` and its test split `test/`, as DTFL's code reads them
(`api/data_preprocessing/cinic10/data_loader.py`, `load_cinic10_data`); `valid/` is not
read. Class k is the k-th name in sorted order (the order torchvision's `ImageFolder` gives,
which that code uses), images within a class by file name. Some images are grayscale: every
image becomes RGB; one that is not 32x32, or a class folder missing, is an error naming it.

The `PixelNorm` is computed from the training images loaded (`pixel_stats`); on the full
`train/` it should be close to the statistics the README publishes for train (mean 0.47889522,
0.47227842, 0.43047404; std 0.24205776, 0.23828046, 0.25874835; not verified here, there
being no network), which DTFL's code uses as constants.

No checksum of `CINIC-10.tar.gz` is published with the release (and none is known here),
so HetFL offers no verified download: `hetfl data download cinic10` says where to get it
(`HOW_TO_GET`).

The first load decodes the PNGs into `<folder>.uint8/` beside the folder (`decoded`), which
must be writable then; later loads memory-map it. Delete it after changing the images.
Peak memory: 180,000 x 3072 bytes (553 MB) on the first load; up to the same, mapped and
shared between processes, later.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hetfl.data.dataset import ARRAY_NAMES, DATASETS, Dataset
from hetfl.data.decoded import decode_files, norm_array, norm_of_array, read_arrays, write_arrays
from hetfl.data.fetch import dataset_cache_dir
from hetfl.data.locate import DATA_ENV, find_directory, search_places
from hetfl.data.pixel_stats import pixel_norm_of

#: The release's folder name (the archive itself has none).
FOLDER = "CINIC-10"

#: Where the files come from, for messages (HetFL downloads nothing: no checksum is known).
HOW_TO_GET = (
    "downloading CINIC-10.tar.gz from https://datashare.ed.ac.uk/handle/10283/3192 and "
    f"extracting it into a folder: mkdir {FOLDER} && tar -xzf CINIC-10.tar.gz -C {FOLDER} "
    "(no verified download is offered: no checksum is published)"
)

#: CIFAR-10's classes, in the sorted order that makes them class 0..9.
CLASSES = (
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
)


def image_files(folder: Path, split: str) -> tuple[list[Path], np.ndarray]:
    """Every PNG of `folder/split/`, by class then file name, and its class index."""
    paths: list[Path] = []
    labels: list[int] = []
    for k, name in enumerate(CLASSES):
        directory = folder / split / name
        if not directory.is_dir():
            raise ValueError(
                f"{directory}: no such directory; CINIC-10's {split}/ holds one folder per "
                f"class ({', '.join(CLASSES)})"
            )
        found = sorted(directory.glob("*.png"))
        paths += found
        labels += [k] * len(found)
    if not paths:
        raise ValueError(f"{folder / split}: its class folders hold no *.png images")
    return paths, np.array(labels, dtype=np.int64)


def build_cache(folder: Path, cache: Path) -> None:
    """Decode `folder`'s train and test images into `cache`, placed whole by a rename;
    both splits' folders are checked before anything is decoded."""
    train_paths, y_train = image_files(folder, "train")
    test_paths, y_test = image_files(folder, "test")
    x_train = decode_files(train_paths, (32, 32), "CINIC-10")
    x_test = decode_files(test_paths, (32, 32), "CINIC-10")
    arrays = dict(zip(ARRAY_NAMES, (x_train, y_train, x_test, y_test), strict=True))
    arrays["pixels"] = norm_array(pixel_norm_of(x_train))
    write_arrays(cache, arrays, "CINIC-10", "0.6 GB")


def find_cinic10(path: str | Path | None) -> Path:
    """The folder holding `train/` and `test/`: under `path` as `CINIC-10/` or `path`
    itself; else `$HETFL_DATA`'s `CINIC-10/` or `cinic10/`, then `<cache>/cinic10`."""
    cache = dataset_cache_dir("cinic10")
    return find_directory(
        "cinic10",
        ("train/", "test/"),
        search_places(path, (FOLDER, ""), (FOLDER, "cinic10"), [cache]),
        [HOW_TO_GET, f"setting {DATA_ENV}, or data.path, to the directory holding {FOLDER}/"],
    )


@DATASETS.decorator("cinic10")
def load_cinic10(path: str | Path | None = None) -> Dataset:
    """CINIC-10: 90,000 training (`train/`) and 90,000 test (`test/`) 32x32 colour images
    of CIFAR-10's 10 classes, uint8, with the training set's pixel statistics.

    Looks for the extracted release as `find_cinic10` says. The first load decodes the
    PNGs into `<folder>.uint8/` beside it; later loads read that cache.
    """
    folder = find_cinic10(path).resolve()
    cache = folder.parent / f"{folder.name}.uint8"
    if not cache.is_dir():
        build_cache(folder, cache)
    arrays = read_arrays(cache, (*ARRAY_NAMES, "pixels"))
    return Dataset(
        "cinic10",
        arrays["x_train"],
        arrays["y_train"],
        arrays["x_test"],
        arrays["y_test"],
        num_classes=len(CLASSES),
        files={name: cache / f"{name}.npy" for name in ARRAY_NAMES},
        pixels=norm_of_array(arrays["pixels"]),
    )
