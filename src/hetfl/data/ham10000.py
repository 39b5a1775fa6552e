"""HAM10000 from the files of its official release, resized to 64x64 and split in two ways.

The dataset of Tschandl, Rosendahl and Kittler, "The HAM10000 dataset, a large collection
of multi-source dermatoscopic images of common pigmented skin lesions" (Scientific Data
5, 2018), released on the Harvard Dataverse (doi:10.7910/DVN/DBW86T): 10,015 dermatoscopic
JPEGs (600x450; several images of many lesions), in

    HAM10000_images_part_1.zip      ISIC_*.jpg (5,000 images)
    HAM10000_images_part_2.zip      ISIC_*.jpg (5,015 images)
    HAM10000_metadata.csv           lesion_id,image_id,dx,dx_type,age,sex,localization

The images are read from the two zips as they are, or from folders of the same names
(`HAM10000_images_part_1/`, the zips extracted, as Kaggle's copy ships them). Dataverse
serves the metadata as the tabular file `HAM10000_metadata`; save it, in its original
comma-separated format, as `HAM10000_metadata.csv`. The class is the `dx` column, class k
the k-th of `CLASSES` (sorted codes). Every row needs an image: one missing from both parts,
an unknown `dx` or a missing column is an error naming it.

Each image is converted to RGB and resized to 64x64 with Pillow's bicubic filter, as DTFL's
code does (the authors' repository mahmoudsajjadi/DTFL, branch `master`, commit 3eeb4d4
"last update for ICLR", `DTFL_main.py`, `SkinData`: `Image.open(path).resize((64, 64))`,
Pillow's default filter being bicubic), from the SplitFed code it builds on (Thapa et al.,
2022). The aspect ratio is not kept (600x450 becomes 64x64), as there.

The test set is 20 % of the images, as that code's `train_test_split(df, test_size=0.2)`
(there: no seed; here drawn from the run's seed). Two splits (`SPLITS`, `data.split`):

- `random` (the default, to reproduce the seed papers): images are drawn at random, so
  images of one lesion can land on both sides;
- `lesion`: whole lesions are drawn, per class, until the class's test share is reached,
  so no lesion has images on both sides. Test accuracy then measures lesions never seen,
  not new photographs of lesions trained on (docs/data.md says why that matters).

DTFL's ICLR-branch script also keeps only every 20th metadata row (`df[1:10015:20]`, 501
images), which its `Old_DTFL.py` does not; HetFL uses all 10,015 images. That code also
standardises with ImageNet's mean and std; HetFL computes the `PixelNorm` from the training
images (`pixel_stats`), as for every image dataset, and that code's labels order the
classes by their long names (nv before mel), HetFL by code: neither changes an accuracy.

No checksums of the release's files are known here (Dataverse shows an MD5 per file on its
page; none is recorded in HetFL), and Dataverse serves files by number, not by name, so
HetFL offers no download: `hetfl data download ham10000` says where to get the files
(`HOW_TO_GET`).

The first load decodes every image into `HAM10000.uint8/` beside the folder (`decoded`),
in metadata order; later loads map it and read only the CSV, so a split costs no decoding.
Peak memory: 10,015 x 12,288 bytes (123 MB) for the images, and the same for the copy that
the split makes.
"""

from __future__ import annotations

import csv
import math
import zipfile
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from pathlib import Path, PurePosixPath
from typing import IO

import numpy as np

from hetfl.core.rng import SERVER, numpy_generator
from hetfl.data.dataset import DATASETS, Dataset
from hetfl.data.decoded import decode_rgb, read_arrays, write_arrays
from hetfl.data.fetch import dataset_cache_dir
from hetfl.data.locate import DATA_ENV, find_directory, search_places
from hetfl.data.pixel_stats import pixel_norm_of

#: The folder the release's files are kept in.
FOLDER = "HAM10000"

METADATA = "HAM10000_metadata.csv"

#: The two image parts, each a zip or the folder it extracts to.
PARTS = ("HAM10000_images_part_1", "HAM10000_images_part_2")

#: Where the files come from, for messages (HetFL downloads nothing, see above).
HOW_TO_GET = (
    "downloading HAM10000_images_part_1.zip, HAM10000_images_part_2.zip and "
    f"HAM10000_metadata (saved as {METADATA}) from https://doi.org/10.7910/DVN/DBW86T into "
    f"one folder, {FOLDER}/ (no download is offered: Dataverse serves files by number and "
    "no checksums are recorded)"
)

#: The diagnoses (`dx`), in the sorted order that makes them class 0..6.
CLASSES = ("akiec", "bcc", "bkl", "df", "mel", "nv", "vasc")

#: How the test set is drawn; the first is the default.
SPLITS = ("random", "lesion")

#: The share of images in the test set (DTFL's `test_size=0.2`).
TEST_FRACTION = 0.2

#: The size (W, H) every image is resized to, as DTFL's code does.
SIZE = (64, 64)

_COLUMNS = ("lesion_id", "image_id", "dx")

#: Opens one image's bytes.
Opener = Callable[[], IO[bytes]]


@dataclass(frozen=True)
class Metadata:
    """The metadata rows, in file order: image ids, class indices, lesion indices."""

    image_ids: list[str]
    labels: np.ndarray
    lesions: np.ndarray


def read_metadata(path: Path) -> Metadata:
    """The rows of `HAM10000_metadata.csv`, checked: the columns there, each `dx` one of
    `CLASSES`, each image once, and every lesion's images of one diagnosis (the lesion
    split keeps a lesion on one side)."""
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in _COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(
                f"{path}: no column {', '.join(missing)}; HAM10000's metadata starts "
                f"with the header {','.join(_COLUMNS)},dx_type,age,sex,localization "
                f"(found {reader.fieldnames})"
            )
        rows = [(r["lesion_id"], r["image_id"], r["dx"], n) for n, r in enumerate(reader, 2)]
    if not rows:
        raise ValueError(f"{path}: lists no images")
    classes = {dx: k for k, dx in enumerate(CLASSES)}
    lesion_dx: dict[str, str] = {}
    seen: set[str] = set()
    for lesion, image, dx, line in rows:
        if dx not in classes:
            raise ValueError(
                f"{path}, line {line}: dx {dx!r} is none of HAM10000's {', '.join(CLASSES)}"
            )
        if image in seen:
            raise ValueError(f"{path}, line {line}: image {image} is listed twice")
        seen.add(image)
        if lesion_dx.setdefault(lesion, dx) != dx:
            raise ValueError(
                f"{path}, line {line}: lesion {lesion} is {dx} here but "
                f"{lesion_dx[lesion]} on an earlier line; a lesion has one diagnosis"
            )
    lesion_index = {lesion: i for i, lesion in enumerate(lesion_dx)}
    return Metadata(
        [image for _, image, _, _ in rows],
        np.array([classes[dx] for _, _, dx, _ in rows], dtype=np.int64),
        np.array([lesion_index[lesion] for lesion, _, _, _ in rows], dtype=np.int64),
    )


def image_openers(folder: Path, stack: ExitStack) -> dict[str, Opener]:
    """Each image of the two parts by image id (`ISIC_0024306`); a zip is preferred to a
    folder of the same name, and kept open in `stack`."""
    openers: dict[str, Opener] = {}
    for part in PARTS:
        archive, directory = folder / f"{part}.zip", folder / part
        if archive.is_file():
            zf = stack.enter_context(zipfile.ZipFile(archive))
            for name in zf.namelist():
                member = PurePosixPath(name)
                if member.suffix.lower() == ".jpg":
                    openers[member.stem] = partial(zf.open, name)
        elif directory.is_dir():
            for path in directory.glob("*.jpg"):
                openers[path.stem] = partial(_open_binary, path)
        else:
            raise ValueError(
                f"{folder}: holds neither {archive.name} nor {directory.name}/; HAM10000's "
                f"images are in {PARTS[0]}.zip and {PARTS[1]}.zip"
            )
    return openers


def _open_binary(path: Path) -> IO[bytes]:
    return path.open("rb")


def build_cache(folder: Path, cache: Path, metadata: Metadata) -> None:
    """Decode every image of `metadata`, resized to `SIZE`, into `cache` in metadata order,
    with the image ids, so that a later load can tell the cache from another CSV's."""
    x = np.empty((len(metadata.image_ids), 3, SIZE[1], SIZE[0]), dtype=np.uint8)
    with ExitStack() as stack:
        openers = image_openers(folder, stack)
        for i, image in enumerate(metadata.image_ids):
            if image not in openers:
                raise ValueError(
                    f"{folder / METADATA} lists image {image}, which is in neither "
                    f"{PARTS[0]} nor {PARTS[1]}"
                )
            with openers[image]() as source:
                x[i] = decode_rgb(source, f"{image}.jpg", SIZE, "HAM10000", resize=True)
    ids = np.array(metadata.image_ids, dtype=str)
    write_arrays(cache, {"x_images": x, "image_ids": ids}, "HAM10000", "130 MB")


def draw_test(metadata: Metadata, split: str, seed: int) -> np.ndarray:
    """The sorted indices of the test images, drawn from the run's `seed`.

    `random`: ceil(20 %) of the images (as scikit-learn's `train_test_split` counts).
    `lesion`: for each class, its lesions in a seeded order, taken until the test set holds
    ceil(20 %) of the class's images; a lesion's images are all taken or none.
    """
    if split not in SPLITS:
        raise ValueError(
            f"unknown HAM10000 split {split!r}; choose one of {', '.join(SPLITS)}: random "
            "(images at random, the seed papers' split), lesion (no lesion on both sides)"
        )
    rng = numpy_generator(seed, 0, SERVER, f"ham10000-{split}-split")
    n = metadata.labels.size
    if split == "random":
        return np.sort(rng.permutation(n)[: math.ceil(TEST_FRACTION * n)])
    test: list[np.ndarray] = []
    for k in range(len(CLASSES)):
        of_class = np.flatnonzero(metadata.labels == k)
        want, taken = math.ceil(TEST_FRACTION * of_class.size), 0
        for lesion in rng.permutation(np.unique(metadata.lesions[of_class])):
            if taken >= want:
                break
            images = np.flatnonzero(metadata.lesions == lesion)
            test.append(images)
            taken += images.size
    return np.sort(np.concatenate(test))


def find_ham10000(path: str | Path | None) -> Path:
    """The folder holding `HAM10000_metadata.csv`: under `path` as `HAM10000/` or `path`
    itself; else `$HETFL_DATA`'s `HAM10000/` or `ham10000/`, then `<cache>/ham10000`."""
    return find_directory(
        "ham10000",
        (METADATA,),
        search_places(path, (FOLDER, ""), (FOLDER, "ham10000"), [dataset_cache_dir("ham10000")]),
        [HOW_TO_GET, f"setting {DATA_ENV}, or data.path, to the directory holding {FOLDER}/"],
    )


@DATASETS.decorator("ham10000")
def load_ham10000(path: str | Path | None = None, seed: int = 0, split: str = "random") -> Dataset:
    """HAM10000: 10,015 dermatoscopic images of 7 diagnoses as 64x64 uint8 RGB, 80 % for
    training and 20 % for test, split by `split` (`SPLITS`) from `seed`.

    Looks for the release's files as `find_ham10000` says. The first load decodes the
    images into `HAM10000.uint8/` beside that folder; later loads read that cache.
    """
    folder = find_ham10000(path).resolve()
    metadata = read_metadata(folder / METADATA)
    test = draw_test(metadata, split, seed)
    cache = folder.parent / f"{folder.name}.uint8"
    if not cache.is_dir():
        build_cache(folder, cache, metadata)
    arrays = read_arrays(cache, ("x_images", "image_ids"))
    if arrays["image_ids"].tolist() != metadata.image_ids:
        raise ValueError(
            f"{cache} holds other images than {folder / METADATA} lists (the metadata "
            f"changed since the images were decoded); delete {cache} to decode them again"
        )
    x = arrays["x_images"]
    train = np.setdiff1d(np.arange(metadata.labels.size), test)
    x_train = np.ascontiguousarray(x[train])
    return Dataset(
        "ham10000",
        x_train,
        metadata.labels[train],
        np.ascontiguousarray(x[test]),
        metadata.labels[test],
        num_classes=len(CLASSES),
        files={
            "x_train": cache / "x_images.npy",
            "y_train": folder / METADATA,
            "x_test": cache / "x_images.npy",
            "y_test": folder / METADATA,
        },
        pixels=pixel_norm_of(x_train),
    )
