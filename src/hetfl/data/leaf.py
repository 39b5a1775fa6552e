"""One job: LEAF's FEMNIST and Shakespeare, read from the JSON folders that LEAF's scripts
write.

LEAF (Caldas et al., "LEAF: A Benchmark for Federated Settings", 2018, §3; repository
TalwalkarLab/leaf) publishes no data files: users run its `preprocess.sh`, which downloads
the raw data and writes `data/train/*.json` and `data/test/*.json` (`GENERATE`). Every file
holds `{"users": [id, ...], "num_samples": [n, ...], "user_data": {id: {"x": [...],
"y": [...]}}}` (Shakespeare's may add `hierarchies`, ignored here). The loaders assume the
split by sample (`-t sample`), the one LEAF's reference models need: every user holds
training and test samples, so a test user missing from training is an error.

- FEMNIST: each x is 784 floats, LEAF's 28x28 greyscale thumbnail divided by 255
  (`data/femnist/preprocess/data_to_json.py`), white background = 1.0 and dark ink near 0,
  kept as LEAF stores it (not inverted); y in 0..61 (digits, upper-case, lower-case
  letters). Held as uint8 (N, 1, 28, 28) pixels with the training set's `PixelNorm`.
- Shakespeare: each x is an 80-character window of a speaker's lines and y the character
  after it (`data/shakespeare/preprocess/shake_utils.py`); both are coded by LEAF's
  80-character vocabulary (`models/utils/language_utils.py`, ALL_LETTERS), x as int64
  (N, 80) token codes and y as a class in 0..79.

`train_groups` is each training sample's writer or speaker: the rank of its user id among
the training users (sorted ids); samples are ordered by that rank, each user's in file
order. The JSON is parsed one file at a time into a compact cache (`cache_path`), written
atomically and keyed by the files' names, sizes and modification times, so later loads,
and every Flower node, read arrays only.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hetfl.core.pixels import PIXEL_SCALE, PixelNorm
from hetfl.data.dataset import DATASETS, Dataset
from hetfl.data.fetch import default_cache_dir
from hetfl.data.locate import DatasetNotFoundError, search_places

#: The datasets whose samples have natural owners (the `natural` partition needs them).
LEAF_DATASETS = ("femnist", "shakespeare")

#: LEAF's character vocabulary (`models/utils/language_utils.py`, ALL_LETTERS), in order:
#: a character's code is its position.
SHAKESPEARE_VOCABULARY = (
    "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
)
SEQUENCE_LENGTH = 80
FEMNIST_CLASSES = 62
FEMNIST_SIDE = 28

#: The layout every file must have, quoted in errors.
LAYOUT = (
    '{"users": [id, ...], "num_samples": [n, ...], '
    '"user_data": {id: {"x": [...], "y": [...]}, ...}}'
)

_LEAF_URL = "https://github.com/TalwalkarLab/leaf"

#: How to make each dataset's files with LEAF, as `hetfl data download` and a missing
#: dataset print them. FEMNIST: the small (5 %) sample LEAF's README suggests; Shakespeare:
#: the README's 80/20 split of FedAvg (its `-tf` is spelled `--tf` by the script).
GENERATE = {
    "femnist": "./preprocess.sh -s niid --sf 0.05 -k 0 -t sample   (--sf 1.0: all of it)",
    "shakespeare": "./preprocess.sh -s niid --sf 0.2 -k 0 -t sample --tf 0.8   (--sf 1.0: all)",
}


def generation_message(name: str) -> str:
    """Why `name` cannot be downloaded and how to make its files with LEAF's scripts."""
    return (
        f"LEAF publishes no {name} files to download; generate them with LEAF's scripts:\n"
        f"  git clone {_LEAF_URL}\n"
        f"  cd leaf/data/{name}\n"
        f"  {GENERATE[name]}\n"
        f"then set data.path to leaf/data/{name}/data (the folder holding train/ and test/), "
        f"or copy train/ and test/ into $HETFL_DATA/{name}. The split must be by sample "
        "(-t sample)."
    )


# --- where the files are ---------------------------------------------------------------------


def _json_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*.json") if p.is_file())


def find_leaf(name: str, path: str | Path | None) -> Path:
    """The folder holding `train/` and `test/` with JSON files, or `DatasetNotFoundError`."""
    places = search_places(path, ("",), (name,), ())  # path alone, else $HETFL_DATA/<name>
    for place in places:
        if all(_json_files(place / split) for split in ("train", "test")):
            return place.resolve()
    searched = "".join(f"\n  - {p} (no .json files in train/ and test/)" for p in places)
    where = f"Searched:{searched}" if places else "No data.path given and $HETFL_DATA is unset."
    raise DatasetNotFoundError(f"{name} not found. {where}\n{generation_message(name)}")


# --- one file --------------------------------------------------------------------------------

#: A pixel code per value, offset by 256 so that a JSON float (LEAF writes pixel / 255) is
#: told apart from a JSON integer, which LEAF never writes in x. The codes are shared int
#: objects: a parsed FEMNIST file holds 8-byte pointers instead of 32-byte floats.
_FLOAT_CODES = tuple(range(256, 512))
_NOT_A_PIXEL = -1


def _pixel_code(text: str) -> int:
    """`json.load`'s float parser for FEMNIST: a value in [0, 1] becomes its pixel + 256."""
    value = float(text)
    if not 0.0 <= value <= 1.0:
        return _NOT_A_PIXEL
    return _FLOAT_CODES[round(value * PIXEL_SCALE)]


def _bad(path: Path, problem: str) -> ValueError:
    return ValueError(f"{path}: {problem}; a LEAF file is {LAYOUT}")


def _users_of(path: Path, parse_float: Callable[[str], Any] | None) -> Iterator[tuple[str, Any]]:
    """(user, its {"x", "y"} record) for every user of one file, after checking the layout."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh, parse_float=parse_float)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _bad(path, f"not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise _bad(path, f"holds a {type(data).__name__}, not an object")
    missing = [k for k in ("users", "num_samples", "user_data") if k not in data]
    if missing:
        raise _bad(path, f"missing key {missing[0]!r} (has {', '.join(map(repr, data))})")
    users, counts, records = data["users"], data["num_samples"], data["user_data"]
    if not isinstance(users, list) or not all(isinstance(u, str) for u in users):
        raise _bad(path, "'users' must be a list of user id strings")
    if not isinstance(counts, list) or len(counts) != len(users):
        raise _bad(path, f"'num_samples' must list one count per user ({len(users)} users)")
    if len(set(users)) != len(users):
        raise _bad(path, "'users' lists a user twice")
    if not isinstance(records, dict) or set(records) != set(users):
        extra = sorted(set(records) - set(users)) if isinstance(records, dict) else []
        absent = sorted(set(users) - set(records)) if isinstance(records, dict) else users
        raise _bad(
            path,
            f"'user_data' must hold exactly the listed users (not listed: {extra[:3]}, "
            f"without data: {absent[:3]})",
        )
    for user, count in zip(users, counts, strict=True):
        record = records[user]
        if not isinstance(record, dict) or not all(k in record for k in ("x", "y")):
            raise _bad(path, f"user {user!r} has no 'x' and 'y' lists")
        x, y = record["x"], record["y"]
        if not isinstance(x, list) or not isinstance(y, list) or not len(x) == len(y) == count:
            raise _bad(
                path,
                f"user {user!r}: num_samples says {count} but x has "
                f"{len(x) if isinstance(x, list) else 'no list'} and y "
                f"{len(y) if isinstance(y, list) else 'no list'} entries",
            )
        yield user, record


# --- decoding a user's samples ---------------------------------------------------------------


def _labels(raw: list[Any], num_classes: int, where: str) -> np.ndarray:
    for i, v in enumerate(raw):
        if type(v) is not int or not 0 <= v < num_classes:
            raise ValueError(
                f"{where}: label {v!r} (sample {i}) is not an integer in 0..{num_classes - 1}"
            )
    return np.array(raw, dtype=np.uint8).reshape(-1)


def _femnist_user(x: list[Any], y: list[Any], where: str) -> tuple[np.ndarray, np.ndarray]:
    """784 floats in [0, 1] per sample (parsed to codes by `_pixel_code`) -> uint8 images."""
    pixels = FEMNIST_SIDE * FEMNIST_SIDE
    try:
        codes = np.array(x, dtype=np.int64) if x else np.zeros((0, pixels), dtype=np.int64)
    except (ValueError, TypeError, OverflowError) as exc:
        raise ValueError(f"{where}: each x must be {pixels} pixel values ({exc})") from exc
    if codes.ndim != 2 or codes.shape[1] != pixels:
        raise ValueError(f"{where}: each x must be {pixels} pixel values, got shape {codes.shape}")
    floats = _FLOAT_CODES[0]
    bad = np.flatnonzero(((codes < floats) | (codes > _FLOAT_CODES[-1])).any(axis=1))
    if bad.size:
        raise ValueError(
            f"{where}: sample {int(bad[0])} has pixel values that are not floats in [0, 1] "
            "(LEAF writes each pixel divided by 255)"
        )
    images = (codes - floats).astype(np.uint8).reshape(-1, 1, FEMNIST_SIDE, FEMNIST_SIDE)
    return images, _labels(y, FEMNIST_CLASSES, where)


#: Byte -> vocabulary code; 255 for a character outside the vocabulary.
_CHAR_CODES = np.full(256, 255, dtype=np.uint8)
_CHAR_CODES[[ord(c) for c in SHAKESPEARE_VOCABULARY]] = np.arange(
    len(SHAKESPEARE_VOCABULARY), dtype=np.uint8
)


def encode_characters(text: str, where: str) -> np.ndarray:
    """`text` as uint8 vocabulary codes; a character outside the vocabulary is an error."""
    if not text.isascii():
        unknown = next(c for c in text if not c.isascii())
    else:
        codes = _CHAR_CODES[np.frombuffer(text.encode("ascii"), dtype=np.uint8)]
        outside = np.flatnonzero(codes == 255)
        if not outside.size:
            return codes
        unknown = text[int(outside[0])]
    raise ValueError(f"{where}: character {unknown!r} is not in LEAF's 80-character vocabulary")


def _shakespeare_user(x: list[Any], y: list[Any], where: str) -> tuple[np.ndarray, np.ndarray]:
    """80-character strings and next characters -> uint8 codes (N, 80) and (N,)."""
    if not all(isinstance(s, str) and len(s) == SEQUENCE_LENGTH for s in x):
        raise ValueError(f"{where}: each x must be a string of {SEQUENCE_LENGTH} characters")
    if not all(isinstance(c, str) and len(c) == 1 for c in y):
        raise ValueError(f"{where}: each y must be a string of one character")
    codes = encode_characters("".join(x), where).reshape(-1, SEQUENCE_LENGTH)
    return codes, encode_characters("".join(y), where)


# --- a split, the cache ----------------------------------------------------------------------


@dataclass(frozen=True)
class _Format:
    """What distinguishes the two datasets when reading their files."""

    decode: Callable[[list[Any], list[Any], str], tuple[np.ndarray, np.ndarray]]
    parse_float: Callable[[str], Any] | None
    sample_shape: tuple[int, ...]


_FORMATS = {
    "femnist": _Format(_femnist_user, _pixel_code, (1, FEMNIST_SIDE, FEMNIST_SIDE)),
    "shakespeare": _Format(_shakespeare_user, None, (SEQUENCE_LENGTH,)),
}

_Split = dict[str, tuple[np.ndarray, np.ndarray]]


def _read_split(folder: Path, fmt: _Format) -> _Split:
    """Every user's decoded (x, y) in one split's files, read one file at a time."""
    users: _Split = {}
    first_seen: dict[str, Path] = {}
    for path in _json_files(folder):
        for user, record in _users_of(path, fmt.parse_float):
            if user in users:
                raise _bad(path, f"user {user!r} is also in {first_seen[user]}")
            users[user] = fmt.decode(record["x"], record["y"], f"{path}: user {user!r}")
            first_seen[user] = path
    return users


def _stack(users: _Split, order: list[str], fmt: _Format) -> tuple[np.ndarray, ...]:
    """x, y and owner rank of `order`'s users' samples, in that order."""
    xs = [users[u][0] for u in order]
    ys = [users[u][1] for u in order]
    owners = np.repeat(np.arange(len(order), dtype=np.int64), [y.size for y in ys])
    x = np.concatenate(xs) if xs else np.zeros((0, *fmt.sample_shape), dtype=np.uint8)
    y = np.concatenate(ys) if ys else np.zeros(0, dtype=np.uint8)
    return x, y, owners


def _pixel_stats(x: np.ndarray) -> np.ndarray:
    """[mean, std] of uint8 pixels over [0, 1], from a histogram counted in chunks (a
    whole-array float64 copy of full FEMNIST would take 4.5 GB)."""
    flat = x.reshape(-1)
    counts = np.zeros(256, dtype=np.int64)
    for start in range(0, flat.size, 1 << 22):
        counts += np.bincount(flat[start : start + (1 << 22)], minlength=256)
    values = np.arange(256, dtype=np.float64) / PIXEL_SCALE
    total = max(int(counts.sum()), 1)
    mean = float(counts @ values) / total
    var = float(counts @ values**2) / total - mean**2
    return np.array([mean, np.sqrt(max(var, 0.0))], dtype=np.float64)


def _decode(name: str, root: Path) -> dict[str, np.ndarray]:
    """The compact arrays of a LEAF folder: uint8 x and y, int64 owners (training users
    with samples, by sorted id), and for FEMNIST the training pixels' [mean, std]."""
    fmt = _FORMATS[name]
    train = _read_split(root / "train", fmt)
    owners = sorted(u for u, (_, y) in train.items() if y.size)
    x_train, y_train, groups = _stack(train, owners, fmt)
    del train
    test = _read_split(root / "test", fmt)
    known = set(owners)
    strangers = sorted(u for u, (_, y) in test.items() if y.size and u not in known)
    if strangers:
        raise ValueError(
            f"{root / 'test'}: user {strangers[0]!r} ({len(strangers)} users in all) has test "
            f"samples but no training samples in {root / 'train'}; the loader needs LEAF's "
            "split by sample (preprocess.sh -t sample), where every user has both"
        )
    x_test, y_test, _ = _stack(test, sorted(test), fmt)
    arrays = {
        "x_train": x_train,
        "y_train": y_train,
        "train_groups": groups,
        "x_test": x_test,
        "y_test": y_test,
    }
    if name == "femnist":
        arrays["pixel_stats"] = _pixel_stats(x_train)
    return arrays


def _signature(root: Path) -> str:
    """The files the cache was made from: name, size and modification time of each."""
    lines = []
    for split in ("train", "test"):
        for path in _json_files(root / split):
            stat = path.stat()
            lines.append(f"{split}/{path.name} {stat.st_size} {stat.st_mtime_ns}")
    return "\n".join(lines)


def cache_path(name: str, root: Path) -> Path:
    """`<cache>/leaf/<name>-<hash of the folder>.npz`: one cache per folder, replaced when
    its files change."""
    digest = hashlib.sha256(str(root).encode()).hexdigest()[:16]
    return default_cache_dir() / "leaf" / f"{name}-{digest}.npz"


def _read_cache(path: Path, signature: str) -> dict[str, np.ndarray] | None:
    """The cached arrays if the cache exists, reads whole and matches `signature`."""
    try:
        with np.load(path, allow_pickle=False) as f:
            if str(f["signature"]) != signature:
                return None
            return {k: f[k] for k in f.files if k != "signature"}
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        return None  # absent, unreadable or from another version: decode again


def _write_cache(path: Path, signature: str, arrays: dict[str, np.ndarray]) -> None:
    """Write to a temporary file beside `path`, then rename: never a half-written cache."""
    path.parent.mkdir(parents=True, exist_ok=True)
    payload: dict[str, Any] = {"signature": np.array(signature), **arrays}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            np.savez(fh, **payload)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def leaf_arrays(name: str, root: Path) -> dict[str, np.ndarray]:
    """The compact arrays of `root`, from the cache when its files have not changed."""
    signature = _signature(root)
    path = cache_path(name, root)
    arrays = _read_cache(path, signature)
    if arrays is None:
        arrays = _decode(name, root)
        _write_cache(path, signature, arrays)
    return arrays


# --- the datasets ----------------------------------------------------------------------------


def _files(root: Path) -> dict[str, Path]:
    return {
        "x_train": root / "train",
        "y_train": root / "train",
        "x_test": root / "test",
        "y_test": root / "test",
    }


@DATASETS.decorator("femnist")
def load_femnist(path: str | Path | None = None) -> Dataset:
    """LEAF's FEMNIST: uint8 (N, 1, 28, 28) images as LEAF stores them (white background
    = 255), 62 classes, `train_groups` = writer; `path` is the folder holding LEAF's
    `train/` and `test/` (default `$HETFL_DATA/femnist`).

    Peak memory: a cached load holds the arrays once, 785 bytes per image (full FEMNIST,
    about 805,000 images: 0.63 GB). The first load, which decodes the JSON, holds them twice
    (per-user pieces and their concatenation) plus the largest JSON file's text and 8 bytes
    per pixel of it (pixels are parsed to shared small ints, not 32-byte floats): about
    1.7 GB for full FEMNIST, measured at 180 MB for a 94 MB file of 6,000 images.
    """
    root = find_leaf("femnist", path)
    a = leaf_arrays("femnist", root)
    mean, std = (float(v) for v in a["pixel_stats"])
    return Dataset(
        "femnist",
        a["x_train"],
        a["y_train"].astype(np.int64),
        a["x_test"],
        a["y_test"].astype(np.int64),
        num_classes=FEMNIST_CLASSES,
        files=_files(root),
        pixels=PixelNorm((mean,), (std,)),
        train_groups=a["train_groups"],
    )


@DATASETS.decorator("shakespeare")
def load_shakespeare(path: str | Path | None = None) -> Dataset:
    """LEAF's Shakespeare: int64 (N, 80) character codes, the next character's code as
    label (80 classes), `train_groups` = speaker; `path` is the folder holding LEAF's
    `train/` and `test/` (default `$HETFL_DATA/shakespeare`).

    Peak memory: about 0.7 KB per sample (train and test), measured: the dataset holds
    int64 codes (648 bytes per sample, the `Dataset` contract for tokens) while the uint8
    cache they come from (81 bytes) is still loaded. Full Shakespeare (4.2 million
    samples) peaks at about 3 GB, `--sf 0.2` at about 0.6 GB. The first load's decoding
    peaks lower (the JSON text, about 150 bytes per parsed sample and the uint8 codes).
    """
    root = find_leaf("shakespeare", path)
    a = leaf_arrays("shakespeare", root)
    return Dataset(
        "shakespeare",
        a["x_train"].astype(np.int64),
        a["y_train"].astype(np.int64),
        a["x_test"].astype(np.int64),
        a["y_test"].astype(np.int64),
        num_classes=len(SHAKESPEARE_VOCABULARY),
        files=_files(root),
        train_groups=a["train_groups"],
    )
