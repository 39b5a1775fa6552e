"""CIFAR-10 and CIFAR-100 from their official binary archives.

The data of Krizhevsky, "Learning Multiple Layers of Features from Tiny Images" (2009), in
the "binary version" described on https://www.cs.toronto.edu/~kriz/cifar.html; never the
pickled "python version", so nothing is unpickled. Each file is a run of fixed-size records:

- CIFAR-10 (`cifar-10-batches-bin/data_batch_1.bin` .. `data_batch_5.bin` for training,
  `test_batch.bin` for test): 1 label byte (0..9), then 3072 pixel bytes;
- CIFAR-100 (`cifar-100-binary/train.bin`, `test.bin`): a coarse label byte (0..19), a fine
  label byte (0..99), then 3072 pixel bytes. HetFL uses the fine label: 100 classes, as
  the FL papers that report CIFAR-100 do.

The 3072 pixel bytes are three 1024-byte planes, red, green, blue, each 32 rows of 32
pixels, so a record's pixels are one (3, 32, 32) image as they stand. Images stay uint8;
their `PixelNorm` is computed from the training images at load time (`pixel_stats`).
Any number of records per file is accepted (the tests use a few); a file whose size is not
a whole number of records is a `ValueError` naming it and its size.

Peak memory: the returned arrays (CIFAR-10 and CIFAR-100 alike: 60,000 x 3072 bytes of
pixels, 184 MB, plus 0.5 MB of labels) and one chunk of 10,000 raw records (31 MB).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hetfl.data.archives import ARCHIVES, Archive, find_extracted
from hetfl.data.dataset import DATASETS, Dataset
from hetfl.data.pixel_stats import pixel_norm_of

#: The pixels of one record: three 32 x 32 planes.
IMAGE_SHAPE = (3, 32, 32)
_PIXEL_BYTES = 3 * 32 * 32

#: Records read at a time (31 MB), which bounds the memory beyond the returned arrays.
_CHUNK_RECORDS = 10_000


@dataclass(frozen=True)
class CifarLayout:
    """Where one CIFAR variant keeps its records and how a record starts.

    `label_bytes` precede the pixels; the label used is the last of them (CIFAR-100's
    fine label, CIFAR-10's only one).
    """

    archive: Archive
    train_files: tuple[str, ...]
    test_file: str
    label_bytes: int
    num_classes: int

    @property
    def files(self) -> tuple[str, ...]:
        return (*self.train_files, self.test_file)

    @property
    def record_bytes(self) -> int:
        return self.label_bytes + _PIXEL_BYTES


CIFAR10 = CifarLayout(
    ARCHIVES["cifar10"],
    tuple(f"data_batch_{i}.bin" for i in range(1, 6)),
    "test_batch.bin",
    label_bytes=1,
    num_classes=10,
)
CIFAR100 = CifarLayout(
    ARCHIVES["cifar100"], ("train.bin",), "test.bin", label_bytes=2, num_classes=100
)


def read_records(paths: list[Path], layout: CifarLayout) -> tuple[np.ndarray, np.ndarray]:
    """The images (N, 3, 32, 32) uint8 and labels (N,) int64 of the record files `paths`,
    in file order; each file's size is checked against the record size first."""
    counts = [_record_count(path, layout.record_bytes) for path in paths]
    x = np.empty((sum(counts), *IMAGE_SHAPE), dtype=np.uint8)
    y = np.empty(sum(counts), dtype=np.int64)
    start = 0
    for path, count in zip(paths, counts, strict=True):
        with path.open("rb") as f:
            for first in range(0, count, _CHUNK_RECORDS):
                n = min(_CHUNK_RECORDS, count - first)
                raw = np.frombuffer(f.read(n * layout.record_bytes), dtype=np.uint8)
                records = raw.reshape(n, layout.record_bytes)
                x[start : start + n] = records[:, layout.label_bytes :].reshape(n, *IMAGE_SHAPE)
                y[start : start + n] = records[:, layout.label_bytes - 1]
                start += n
    return x, y


def _record_count(path: Path, record_bytes: int) -> int:
    size = path.stat().st_size
    if size == 0 or size % record_bytes:
        raise ValueError(
            f"{path}: {size} bytes is not a whole, positive number of {record_bytes}-byte "
            "records; the file is truncated or not a CIFAR binary batch. Delete the "
            "extracted folder and run the download again."
        )
    return size // record_bytes


def find_cifar(path: str | Path | None, layout: CifarLayout) -> Path:
    """The folder holding every record file of `layout` (`archives.find_extracted`)."""
    return find_extracted(path, layout.archive, layout.files)


def load_cifar(path: str | Path | None, layout: CifarLayout) -> Dataset:
    """One CIFAR variant as uint8 images with the training set's pixel statistics."""
    folder = find_cifar(path, layout)
    x_train, y_train = read_records([folder / name for name in layout.train_files], layout)
    x_test, y_test = read_records([folder / layout.test_file], layout)
    train_source = folder / layout.train_files[0] if len(layout.train_files) == 1 else folder
    test_source = folder / layout.test_file
    return Dataset(
        layout.archive.dataset,
        x_train,
        y_train,
        x_test,
        y_test,
        num_classes=layout.num_classes,
        files={
            "x_train": train_source,
            "y_train": train_source,
            "x_test": test_source,
            "y_test": test_source,
        },
        pixels=pixel_norm_of(x_train),
    )


@DATASETS.decorator("cifar10")
def load_cifar10(path: str | Path | None = None) -> Dataset:
    """CIFAR-10: 50,000 training and 10,000 test 32x32 colour images, 10 classes.

    Looks for `cifar-10-batches-bin/` in `path` (or `path` itself), else in `$HETFL_DATA`
    (directly or under `cifar10/`), then in the download cache (`<cache>/cifar10`, what
    `hetfl data download cifar10` fills). Raises `DatasetNotFoundError` naming the missing
    files, the places searched and the command.
    """
    return load_cifar(path, CIFAR10)


@DATASETS.decorator("cifar100")
def load_cifar100(path: str | Path | None = None) -> Dataset:
    """CIFAR-100 with its 100 fine labels: 50,000 training and 10,000 test images.

    Looks for `cifar-100-binary/` as `load_cifar10` looks for its folder (`$HETFL_DATA`'s
    `cifar100/`, the cache's `<cache>/cifar100`).
    """
    return load_cifar(path, CIFAR100)
