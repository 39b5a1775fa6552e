"""scikit-learn's 8x8 handwritten digits, split into train and test with HetFL's own
seeded, stratified split."""

from __future__ import annotations

import numpy as np

from hetfl.core.rng import SERVER, numpy_generator
from hetfl.data.dataset import DATASETS, Dataset, stratified_split


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
