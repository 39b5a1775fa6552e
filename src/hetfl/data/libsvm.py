"""LIBSVM-format datasets (usps, pendigits, satimage, letter, vowel, ... from the LIBSVM
collection, which FedALRC's linear experiments use: Wei et al., "Non-IID Federated Learning
with Sharper Risk Bound", IEEE TNNLS 2024, §V-A and Table II).

Users bring the files: a training file and, where the collection has one, its test file,
named like the training file with `.t` appended (`usps` and `usps.t`). Each line is

    <label> <index>:<value> <index>:<value> ...   [# comment]

with 1-based feature indices in increasing order; absent features are 0. Labels may be
any integers (usps uses 1..10, satimage 1..7 without 6): they are mapped to 0..C-1 in
increasing order over the train and test files together, so a class missing from one file
keeps its place. Without a `.t` file the training file is split 80/20, stratified by class,
from the run's seed. Values are kept as they are (the collection's `.scale` files are
already in [-1, 1]). Inputs become float32 (N, D) arrays, D the largest index in either file.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from hetfl.core.rng import SERVER, numpy_generator
from hetfl.data.dataset import DATASETS, Dataset, stratified_split

#: The suffix of a LIBSVM test file, next to its training file.
TEST_SUFFIX = ".t"


def read_libsvm(path: str | Path) -> tuple[list[dict[int, float]], list[int]]:
    """The rows (0-based feature index -> value) and integer labels of one LIBSVM file.

    Every malformed line is a `ValueError` naming the file, the line number and the token,
    so a wrong file fails here rather than as a shape error in training. Lines are decoded
    one by one, so a binary file is refused at the line where it stops being text.
    """
    path = Path(path)
    rows: list[dict[int, float]] = []
    labels: list[int] = []
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, start=1):
            tokens = _text(raw, path, number).split("#", 1)[0].split()
            if not tokens:
                continue
            labels.append(_label(tokens[0], path, number))
            row: dict[int, float] = {}
            previous = 0
            for token in tokens[1:]:
                index, value = _feature(token, path, number)
                if index <= previous:
                    raise ValueError(
                        f"{path}:{number}: feature index {index} does not increase "
                        f"(previous {previous}); LIBSVM lines list indices in increasing order"
                    )
                previous = index
                row[index - 1] = value
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no samples (empty file or only comments)")
    return rows, labels


def _text(raw: bytes, path: Path, number: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{path}:{number}: not text (byte 0x{raw[exc.start]:02X} at column {exc.start + 1} "
            "is not UTF-8); a LIBSVM file holds text lines '<label> <index>:<value> ...'"
        ) from None


def _label(token: str, path: Path, number: int) -> int:
    try:
        value = float(token)
    except ValueError:
        raise ValueError(f"{path}:{number}: label {token!r} is not a number") from None
    if not value.is_integer():
        raise ValueError(
            f"{path}:{number}: label {token!r} is not an integer; only classification "
            "datasets are supported"
        )
    return int(value)


def _feature(token: str, path: Path, number: int) -> tuple[int, float]:
    index, sep, value = token.partition(":")
    try:
        parsed = int(index), float(value)
    except ValueError:
        parsed = None
    if not sep or parsed is None or parsed[0] < 1 or not math.isfinite(parsed[1]):
        raise ValueError(
            f"{path}:{number}: {token!r} is not an <index>:<value> pair with an index >= 1 "
            "and a finite value"
        )
    return parsed


def _dense(rows: list[dict[int, float]], dim: int) -> np.ndarray:
    x = np.zeros((len(rows), dim), dtype=np.float32)
    for i, row in enumerate(rows):
        if row:
            x[i, list(row)] = list(row.values())
    return x


@DATASETS.decorator("libsvm")
def load_libsvm(path: str | Path | None, seed: int = 0) -> Dataset:
    """A LIBSVM training file (`data.path`) and its `.t` test file, if there is one.

    `path` is required; it is typed optional only because a config may leave it unset,
    which is reported here.
    """
    if path is None:
        raise ValueError(
            "dataset 'libsvm' needs a file: set data.path to a LIBSVM training file "
            "(its test file, if any, is read from the same name with '.t' appended)"
        )
    train_path = Path(path)
    if not train_path.is_file():
        raise FileNotFoundError(f"{train_path}: no such LIBSVM file")
    test_path = train_path.with_name(train_path.name + TEST_SUFFIX)
    train_rows, train_labels = read_libsvm(train_path)
    test_rows, test_labels = read_libsvm(test_path) if test_path.is_file() else ([], [])
    classes = sorted(set(train_labels) | set(test_labels))
    if len(classes) < 2:
        raise ValueError(f"{train_path}: needs at least two classes, found {classes}")
    to_class = {label: c for c, label in enumerate(classes)}
    dim = 1 + max((max(r, default=-1) for r in (*train_rows, *test_rows)), default=-1)
    if dim == 0:
        raise ValueError(f"{train_path}: no sample has any feature")
    x = _dense(train_rows, dim)
    y = np.array([to_class[v] for v in train_labels], dtype=np.int64)
    if test_rows:
        x_test = _dense(test_rows, dim)
        y_test = np.array([to_class[v] for v in test_labels], dtype=np.int64)
        x_train, y_train = x, y
    else:
        rng = numpy_generator(seed, 0, SERVER, "libsvm-split")
        train, test = stratified_split(y, 0.2, rng)
        x_train, y_train, x_test, y_test = x[train], y[train], x[test], y[test]
    name = f"libsvm:{train_path.name}"
    files = {"x_train": train_path, "y_train": train_path}
    files |= dict.fromkeys(("x_test", "y_test"), test_path if test_rows else train_path)
    return Dataset(name, x_train, y_train, x_test, y_test, len(classes), files=files)
