"""Fashion-MNIST from its four idx `.gz` files (Xiao et al. 2017): the idx reader and the
loader, uint8 pixels standardised per batch with the training set's statistics."""

from __future__ import annotations

import gzip
import weakref
import zlib
from pathlib import Path

import numpy as np

from hetfl.core.pixels import PixelNorm
from hetfl.data.dataset import ARRAY_NAMES, DATASETS, Dataset
from hetfl.data.download import FASHION_MNIST_FILES
from hetfl.data.fetch import dataset_cache_dir
from hetfl.data.locate import DATA_ENV, find_directory, search_places

#: idx type codes (third byte of the magic number) and their big-endian NumPy dtypes.
_IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


def read_idx(path: str | Path) -> np.ndarray:
    """Decode one gzip-compressed idx file (the MNIST family's format).

    The header is a big-endian magic number (two zero bytes, a type code, the number of
    dimensions) followed by one big-endian uint32 per dimension. Everything is checked
    against the bytes that follow, so a truncated or foreign file is a `ValueError` that
    names the file rather than a reshape error deep in NumPy.
    """
    path = Path(path)
    try:
        with gzip.open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise
    except (OSError, EOFError, zlib.error) as exc:
        raise ValueError(f"{path}: not a readable gzip file ({exc})") from exc
    if len(raw) < 4:
        raise ValueError(f"{path}: too short for an idx header ({len(raw)} bytes)")
    zero0, zero1, code, ndim = raw[:4]
    magic = int.from_bytes(raw[:4], "big")
    if zero0 != 0 or zero1 != 0 or code not in _IDX_DTYPES or ndim == 0:
        raise ValueError(f"{path}: bad idx magic number 0x{magic:08X}")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{path}: header declares {ndim} dimensions but the file ends early")
    dims = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    dtype = _IDX_DTYPES[code]
    expected = int(np.prod(dims)) * dtype.itemsize
    if len(raw) - header != expected:
        raise ValueError(
            f"{path}: header declares shape {dims} ({expected} data bytes) "
            f"but the file holds {len(raw) - header} data bytes"
        )
    data = np.frombuffer(raw, dtype=dtype, offset=header).reshape(dims)
    return data.astype(dtype.newbyteorder("="))  # native byte order, writable


#: Where the Debian package `dataset-fashion-mnist` installs the files. Module-level so that
#: tests (and unusual installs) can point it elsewhere.
FASHION_MNIST_SYSTEM_DIR = Path("/usr/share/datasets/fashion-mnist")

#: The training set's pixel mean and standard deviation (in [0, 1] units).
FASHION_MNIST_PIXELS = PixelNorm(mean=(0.2860,), std=(0.3530,))

#: Decoded arrays by resolved directory, held weakly: a second load in one process while
#: the first's arrays are alive (a sweep, a test session) costs nothing, and once nothing
#: holds them they are freed. A run under the process executor copies its clients' samples
#: and the test set into one shared block, after which the parent holds the decoded 55 MB
#: for nothing (measured on Fashion-MNIST FedAvg over 20 clients: 52 MiB of the parent's
#: 219 MiB). The arrays are read-only, which makes sharing them safe.
_FASHION_MNIST_CACHE: dict[str, tuple[weakref.ref[np.ndarray], ...]] = {}


def _find_fashion_mnist(path: str | Path | None) -> Path:
    places = search_places(
        path,
        ("", "fashion-mnist"),
        ("", "fashion-mnist"),
        [FASHION_MNIST_SYSTEM_DIR, dataset_cache_dir("fashion-mnist")],
    )
    return find_directory(
        "Fashion-MNIST",
        FASHION_MNIST_FILES,
        places,
        [
            "installing the Debian package: apt-get install dataset-fashion-mnist",
            f"setting {DATA_ENV} to a directory holding the four files "
            "(directly or in a fashion-mnist/ subdirectory)",
            "running: hetfl data download fashion-mnist "
            f"(verified files go to {dataset_cache_dir('fashion-mnist')})",
        ],
    )


def _decode_fashion_mnist(
    directory: Path,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    arrays: list[np.ndarray] = []
    for images_name, labels_name in (FASHION_MNIST_FILES[:2], FASHION_MNIST_FILES[2:]):
        images, labels = read_idx(directory / images_name), read_idx(directory / labels_name)
        for name, arr, ndim in ((images_name, images, 3), (labels_name, labels, 1)):
            if arr.ndim != ndim or arr.dtype != np.uint8:
                raise ValueError(
                    f"{directory / name}: expected {ndim}-d unsigned bytes, "
                    f"got {arr.ndim}-d {arr.dtype}"
                )
        if images.shape[1:] != (28, 28):
            raise ValueError(f"{directory / images_name}: images are {images.shape[1:]}, not 28x28")
        x = images.reshape(-1, 1, 28, 28)  # (N, 1, 28, 28) uint8, standardised per batch
        y = labels.astype(np.int64)
        for arr in (x, y):
            arr.flags.writeable = False
        arrays += [x, y]
    x_train, y_train, x_test, y_test = arrays
    return x_train, y_train, x_test, y_test


@DATASETS.decorator("fashion-mnist")
def load_fashion_mnist(path: str | Path | None = None) -> Dataset:
    """Fashion-MNIST from its four idx `.gz` files: uint8 pixels, standardised per batch
    with the training set's mean 0.2860 and std 0.3530 (`FASHION_MNIST_PIXELS`). Peak
    memory: the decompressed idx bytes and the arrays, about 110 MB.

    Looks in `path` if given, else in `$HETFL_DATA` and `$HETFL_DATA/fashion-mnist`, then in
    `FASHION_MNIST_SYSTEM_DIR` (the Debian package's location), then in the download cache
    (`$HETFL_CACHE/fashion-mnist`, default `~/.cache/hetfl/fashion-mnist`); see
    `hetfl.data.locate`. Raises `DatasetNotFoundError` when no place has all four files.
    The returned arrays are read-only and shared between loads of the same directory while
    any of them is held.
    """
    directory = _find_fashion_mnist(path).resolve()
    key = str(directory)
    held = [ref() for ref in _FASHION_MNIST_CACHE.get(key, ())]
    arrays = [a for a in held if a is not None]
    if len(arrays) != len(ARRAY_NAMES):  # never loaded, or some array freed since
        arrays = list(_decode_fashion_mnist(directory))
        _FASHION_MNIST_CACHE[key] = tuple(weakref.ref(a) for a in arrays)
    x_train, y_train, x_test, y_test = arrays
    files = dict(zip(ARRAY_NAMES, FASHION_MNIST_FILES, strict=True))
    return Dataset(
        "fashion-mnist",
        x_train,
        y_train,
        x_test,
        y_test,
        num_classes=10,
        files={array: directory / name for array, name in files.items()},
        pixels=FASHION_MNIST_PIXELS,
    )
