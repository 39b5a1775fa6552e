"""Dataset sources: everything becomes one `Dataset` of NumPy arrays in a fixed layout.

Images are (N, C, H, W) and tabular data (N, D); inputs are float32, or uint8 pixels with
their standardisation (`hetfl.core.pixels`), or int64 token codes; labels are int64 in
0..num_classes-1, so partitioners and client views never need to know where the data came
from. `Dataset` checks this itself (finite inputs, labels in range, one label per input),
so every source, and every Flower node loading its partition, refuses bad data with an
error naming the array and its file. Sources read local files only — downloading is a
separate, explicit step (`hetfl.data.download`) — and a missing dataset is an error that
names the places searched and the fixes. No source touches the global RNG; the seeded
ones derive their generators from `hetfl.core.rng`.
"""

from __future__ import annotations

import gzip
import math
import zipfile
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hetfl.core.pixels import PixelNorm
from hetfl.core.registry import Registry
from hetfl.core.rng import SERVER, numpy_generator
from hetfl.data.download import FASHION_MNIST_FILES
from hetfl.data.fetch import dataset_cache_dir
from hetfl.data.locate import DATA_ENV, find_directory, search_places

#: The input dtypes a dataset may hold (see `Dataset`).
_INPUT_DTYPES = (np.dtype(np.float32), np.dtype(np.uint8), np.dtype(np.int64))

#: A dataset's arrays, in the order sources list them (and the keys of an .npz archive).
ARRAY_NAMES = ("x_train", "y_train", "x_test", "y_test")


@dataclass(frozen=True, eq=False)
class Dataset:
    """A train/test pair of arrays, checked when made; y int64, x one of three kinds:

    - float32: features, or images already scaled (digits, synthetic, user arrays);
    - uint8 (N, C, H, W): pixels as stored, with `pixels` the per-channel statistics that
      standardise a batch when it is drawn (`hetfl.core.pixels`); required with uint8;
    - int64 (N, T): token codes, e.g. characters (Shakespeare), all >= 0.

    `train_groups`, when the data has natural owners (LEAF's writers and speakers), holds
    the owner id of each training sample; the `natural` partition deals owners to clients.

    Every source ends here, and a Flower node builds its partition through the same
    loaders, so `__post_init__` is the one place that refuses data a run cannot learn from:
    non-finite inputs, labels outside 0..num_classes-1, inputs and labels of different
    lengths. Each error names the array and, through `files`, the file it was read from
    (the file each array came from, by array name; empty for built-in sources).

    `eq=False` because arrays do not compare to one bool; two datasets are the same object
    or different ones.
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    files: Mapping[str, Path] = field(default_factory=dict)
    pixels: PixelNorm | None = None
    train_groups: np.ndarray | None = None

    def __post_init__(self) -> None:
        for split in ("train", "test"):
            self._check_split(split)
        if self.x_train.dtype != self.x_test.dtype:
            raise ValueError(
                f"{self._source('x_train', 'x_test')}: train inputs are {self.x_train.dtype} "
                f"but test inputs are {self.x_test.dtype}"
            )
        self._check_pixels()
        self._check_groups()
        if self.x_train.shape[1:] != self.x_test.shape[1:]:
            raise ValueError(
                f"{self._source('x_train', 'x_test')}: train inputs are "
                f"{self.x_train.shape[1:]} but test inputs are {self.x_test.shape[1:]}"
            )

    def _check_split(self, split: str) -> None:
        xname, yname = f"x_{split}", f"y_{split}"
        x, y = getattr(self, xname), getattr(self, yname)
        if x.dtype not in _INPUT_DTYPES or y.dtype != np.int64:
            raise ValueError(
                f"dataset {self.name!r}: {xname} must be float32, uint8 (pixels) or int64 "
                f"(token codes) and {yname} int64, got {x.dtype} and {y.dtype}"
            )
        if y.ndim != 1 or x.ndim == 0 or x.shape[0] != y.shape[0]:
            raise ValueError(
                f"{self._source(xname, yname)}: {xname} has {x.shape[0] if x.ndim else 0} "
                f"rows but {yname} has shape {y.shape}; every input needs one label"
            )
        if x.dtype == np.int64 and x.size and int(x.min()) < 0:
            raise ValueError(f"{self._source(xname)}: {xname} holds negative token codes")
        finite = (
            np.isfinite(x).reshape(x.shape[0], math.prod(x.shape[1:]))
            if x.dtype == np.float32
            else np.ones((x.shape[0], 1), dtype=bool)
        )
        if not finite.all():
            bad_rows = np.flatnonzero(~finite.all(axis=1))
            raise ValueError(
                f"{self._source(xname)}: {xname} has {int((~finite).sum())} non-finite values "
                f"(NaN or Inf) in {bad_rows.size} samples, the first in sample "
                f"{int(bad_rows[0])}; inputs must be finite: repair or drop those samples"
            )
        outside = np.flatnonzero((y < 0) | (y >= self.num_classes))
        if outside.size:
            first = int(outside[0])
            raise ValueError(
                f"{self._source(yname)}: {yname} has {outside.size} labels outside "
                f"0..{self.num_classes - 1}, the first label {int(y[first])} at index {first}; "
                f"labels must be class indices from 0 to {self.num_classes - 1}"
            )

    def _check_pixels(self) -> None:
        x = self.x_train
        if x.dtype != np.uint8:
            if self.pixels is not None:
                raise ValueError(
                    f"dataset {self.name!r}: pixel statistics are for uint8 images, but its "
                    f"inputs are {x.dtype}"
                )
            return
        if self.pixels is None or x.ndim != 4 or x.shape[1] != self.pixels.channels:
            raise ValueError(
                f"dataset {self.name!r}: uint8 inputs must be images (N, C, H, W) with one "
                f"pixel mean and std per channel; got shape {x.shape} and "
                f"{'no statistics' if self.pixels is None else self.pixels}"
            )

    def _check_groups(self) -> None:
        g = self.train_groups
        if g is None:
            return
        if g.dtype != np.int64 or g.shape != self.y_train.shape:
            raise ValueError(
                f"dataset {self.name!r}: train_groups must be int64 with one owner id per "
                f"training sample ({self.y_train.shape[0]}), got {g.dtype} of shape {g.shape}"
            )

    @property
    def num_groups(self) -> int:
        """How many natural owners (writers, speakers) the training set has; 0 without."""
        return 0 if self.train_groups is None else int(np.unique(self.train_groups).size)

    def _source(self, *arrays: str) -> str:
        """Where the named arrays came from: their files, or the dataset's name."""
        files = dict.fromkeys(str(self.files[a]) for a in arrays if a in self.files)
        return " and ".join(files) if files else f"dataset {self.name!r}"

    @property
    def input_shape(self) -> tuple[int, ...]:
        """The shape of one input, e.g. (1, 28, 28); what a model family is built for."""
        return tuple(int(d) for d in self.x_train.shape[1:])


DATASETS = Registry[Callable[..., Dataset]]("dataset")


# --- idx files (MNIST, Fashion-MNIST) -------------------------------------------------------

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


# --- Fashion-MNIST ---------------------------------------------------------------------------

#: Where the Debian package `dataset-fashion-mnist` installs the files. Module-level so that
#: tests (and unusual installs) can point it elsewhere.
FASHION_MNIST_SYSTEM_DIR = Path("/usr/share/datasets/fashion-mnist")

#: The training set's pixel mean and standard deviation (in [0, 1] units).
FASHION_MNIST_PIXELS = PixelNorm(mean=(0.2860,), std=(0.3530,))

#: Decoded arrays by resolved directory, so a second load in one process (a sweep, a test
#: session) costs nothing. The arrays are read-only, which makes sharing them safe.
_FASHION_MNIST_CACHE: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}


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
    The returned arrays are read-only and shared between loads of the same directory.
    """
    directory = _find_fashion_mnist(path).resolve()
    key = str(directory)
    if key not in _FASHION_MNIST_CACHE:
        _FASHION_MNIST_CACHE[key] = _decode_fashion_mnist(directory)
    x_train, y_train, x_test, y_test = _FASHION_MNIST_CACHE[key]
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


# --- scikit-learn digits ---------------------------------------------------------------------


def stratified_split(
    labels: np.ndarray, test_fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Sorted (train, test) indices with `round(test_fraction * n_c)` of each class in test.

    Written here rather than taken from scikit-learn so that the split follows HetFL's
    derived generators and not a global random state.
    """
    train, test = [], []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        n_test = round(test_fraction * idx.size)
        test.append(idx[:n_test])
        train.append(idx[n_test:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


@DATASETS.decorator("digits")
def load_digits(seed: int = 0) -> Dataset:
    """scikit-learn's 8x8 handwritten digits (1797 images, shipped with the package).

    A real dataset that needs no files, so the demo job and the tests run anywhere. Pixels
    are scaled from 0..16 to 0..1; the 80/20 split is stratified and depends on `seed`.
    """
    from sklearn.datasets import load_digits as sklearn_digits  # slow import; only when used

    bunch = sklearn_digits()
    x = (bunch.images.astype(np.float32) / np.float32(16.0))[:, None]  # (N, 1, 8, 8)
    y = bunch.target.astype(np.int64)
    train, test = stratified_split(y, 0.2, numpy_generator(seed, 0, SERVER, "digits-split"))
    return Dataset("digits", x[train], y[train], x[test], y[test], num_classes=10)


# --- synthetic -------------------------------------------------------------------------------


@DATASETS.decorator("synthetic")
def load_synthetic(
    n_train: int = 2000,
    n_test: int = 500,
    num_classes: int = 10,
    shape: tuple[int, ...] = (1, 8, 8),
    seed: int = 0,
    noise: float = 2.0,
) -> Dataset:
    """Gaussian classes: x = mean[y] + noise * N(0, I), with class means drawn from N(0, I).

    Learnable by design (a linear model separates the classes well), so tests can check
    that training beats chance within a few steps; `noise` makes the problem harder.
    Classes are balanced (sizes differ by at most one).
    """
    if n_train < num_classes or n_test < 0 or num_classes < 2 or noise < 0:
        raise ValueError(
            f"synthetic dataset needs n_train >= num_classes >= 2, n_test >= 0 and noise >= 0 "
            f"(got n_train={n_train}, n_test={n_test}, num_classes={num_classes}, "
            f"noise={noise})"
        )
    rng = numpy_generator(seed, 0, SERVER, "synthetic-data")
    shape = tuple(int(d) for d in shape)
    means = rng.standard_normal((num_classes, *shape)).astype(np.float32)

    def draw(n: int) -> tuple[np.ndarray, np.ndarray]:
        y = rng.permutation(np.arange(n) % num_classes).astype(np.int64)
        x = means[y] + np.float32(noise) * rng.standard_normal((n, *shape), dtype=np.float32)
        return x, y

    x_train, y_train = draw(n_train)
    x_test, y_test = draw(n_test)
    return Dataset("synthetic", x_train, y_train, x_test, y_test, num_classes)


# --- user arrays -----------------------------------------------------------------------------

NPZ_KEYS = ARRAY_NAMES


#: How every .npz archive starts: a zip file's local header (or, empty, its end record).
_ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")
_NPY_MAGIC = b"\x93NUMPY"
_NPZ_FORMAT = "a NumPy .npz archive (what numpy.savez writes) with arrays " + ", ".join(NPZ_KEYS)


@DATASETS.decorator("npz")
def load_npz(path: str | Path | None) -> Dataset:
    """A user's own arrays from one `.npz` file with keys x_train, y_train, x_test, y_test.

    Inputs are cast to float32 and kept in the shape they have; labels must be integers
    from 0, and `num_classes` is the largest label plus one. `path` is required; it is typed
    optional only because a config may leave it unset, which is reported here. The file is
    never unpickled (`allow_pickle=False`): a `.npz` is data, not code.
    """
    if path is None:
        raise ValueError("dataset 'npz' needs a file: set data.path to an .npz file")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such .npz file")
    arrays = _read_npz(path)
    for split in ("train", "test"):
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if x.dtype.kind not in "biuf" or x.ndim < 2:
            raise ValueError(
                f"{path}: x_{split} must be a numeric array of shape (N, ...), "
                f"got {x.dtype} of shape {x.shape}"
            )
        if y.dtype.kind not in "iu" or y.ndim != 1:
            raise ValueError(
                f"{path}: y_{split} must be a 1-d integer array, got {y.dtype} of shape {y.shape}"
            )
    if arrays["y_train"].size == 0:
        raise ValueError(f"{path}: y_train is empty")
    num_classes = int(max(arrays["y_train"].max(), arrays["y_test"].max(initial=0))) + 1
    return Dataset(
        f"npz:{path.stem}",
        arrays["x_train"].astype(np.float32),
        arrays["y_train"].astype(np.int64),
        arrays["x_test"].astype(np.float32),
        arrays["y_test"].astype(np.int64),
        num_classes,
        files=dict.fromkeys(NPZ_KEYS, path),
    )


def _read_npz(path: Path) -> dict[str, np.ndarray]:
    """The four arrays of an .npz file; anything else is a `ValueError` naming the file.

    The magic bytes are checked first: `np.load` takes any file that is neither a zip nor
    an .npy for a pickle, and with pickles refused says only that it "cannot load file
    containing pickled data", which points the user the wrong way.
    """
    with open(path, "rb") as fh:
        head = fh.read(len(_NPY_MAGIC))
    if head.startswith(_NPY_MAGIC):
        raise ValueError(
            f"{path}: is a single-array .npy file; dataset 'npz' needs {_NPZ_FORMAT} "
            "(numpy.savez(path, x_train=..., y_train=..., x_test=..., y_test=...))"
        )
    if not head.startswith(_ZIP_MAGIC):
        raise ValueError(
            f"{path}: not a NumPy .npz archive (it does not start with a zip header, "
            f"first bytes {head[:4]!r}); dataset 'npz' needs {_NPZ_FORMAT}"
        )
    try:
        with np.load(path, allow_pickle=False) as f:
            names = list(f.files)
            arrays = {key: f[key] for key in NPZ_KEYS if key in names}
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError) as exc:
        raise ValueError(
            f"{path}: not a readable .npz archive ({type(exc).__name__}: {exc}); "
            f"dataset 'npz' needs {_NPZ_FORMAT}, written in full"
        ) from exc
    missing = [key for key in NPZ_KEYS if key not in arrays]
    if missing:
        raise ValueError(
            f"{path}: missing array {missing[0]!r} (has {', '.join(names) or 'no arrays'}; "
            f"needs {', '.join(NPZ_KEYS)})"
        )
    return arrays
