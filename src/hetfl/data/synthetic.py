"""A seeded synthetic classification problem: learnable, tiny, and needing no file."""

from __future__ import annotations

import numpy as np

from hetfl.core.rng import SERVER, numpy_generator
from hetfl.data.dataset import DATASETS, Dataset


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
