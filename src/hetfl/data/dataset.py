"""The `Dataset` record every source produces, one of NumPy arrays in a fixed layout, and the
registry of sources (`DATASETS`); each source lives in its own module.

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

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hetfl.core.pixels import PixelNorm
from hetfl.core.registry import Registry

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
#: The datasets whose training samples have owners (`train_groups`: LEAF's writers and
#: speakers, the text corpora's documents), which the `natural` partition deals.
OWNED_DATASETS = ("femnist", "pydoc-topics", "shakespeare", "wikitext2")


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
