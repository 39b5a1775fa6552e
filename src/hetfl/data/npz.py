"""A user's own arrays, from a NumPy `.npz` archive with the four arrays a `Dataset` holds."""

from __future__ import annotations

import zipfile
import zlib
from pathlib import Path

import numpy as np

from hetfl.data.dataset import ARRAY_NAMES, DATASETS, Dataset

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
