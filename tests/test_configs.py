"""Every shipped config validates and builds its run on fake data of the dataset's shape.

Configs meant for users with the data (and a GPU) are otherwise never run here, so a
renamed option, a model that no longer fits the input, or a partition the dataset cannot
give would only show up on the user's machine. Each distinct federation of a config's
sweep (points that differ only in seed or method options share one) is built through
`build_parts`, as a run builds it, with the loader replaced by arrays of the real
dataset's shape, dtype, class count and size (smaller for Tiny-ImageNet and CINIC-10, to
keep memory low); nothing trains.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch

import hetfl.assembly
from hetfl.assembly import build_parts
from hetfl.config import default_config_path, expand_sweep, load_raw, validate
from hetfl.core.pixels import PixelNorm
from hetfl.data import OWNED_DATASETS, Dataset
from hetfl.engine.rounds import setup_strategy

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = [*sorted((ROOT / "configs").glob("*.yaml")), default_config_path()]

#: Configs here may name plugin files; their registrations must not outlive the test.
pytestmark = pytest.mark.usefixtures("plugins_unloaded")


class Shape(NamedTuple):
    input_shape: tuple[int, ...]
    classes: int
    n_train: int
    n_test: int
    kind: str  # "pixels", "floats" or "codes"


#: What each dataset a config may name looks like to a run.
SHAPES = {
    "fashion-mnist": Shape((1, 28, 28), 10, 60_000, 10_000, "pixels"),
    "cifar10": Shape((3, 32, 32), 10, 50_000, 10_000, "pixels"),
    "cifar100": Shape((3, 32, 32), 100, 50_000, 10_000, "pixels"),
    "cinic10": Shape((3, 32, 32), 10, 20_000, 2_000, "pixels"),
    "ham10000": Shape((3, 64, 64), 7, 8_012, 2_003, "pixels"),
    "tiny-imagenet": Shape((3, 64, 64), 200, 20_000, 2_000, "pixels"),
    "femnist": Shape((1, 28, 28), 62, 40_000, 4_000, "pixels"),
    "shakespeare": Shape((80,), 80, 40_000, 4_000, "codes"),
    "pydoc-topics": Shape((32,), 256, 13_037, 1_489, "codes"),
    "wikitext2": Shape((32,), 256, 40_000, 4_000, "codes"),
}

#: The writers or documents of a dataset with owners (1000 where it has more): the offline
#: corpus's 79 topics.
OWNERS = {"pydoc-topics": 79}


def fake_dataset(name: str) -> Dataset:
    """Labels cycling through the classes; pixel values do not matter to building a run."""
    if name not in SHAPES:
        raise KeyError(f"a config names dataset {name!r}: add its shape to SHAPES")
    s = SHAPES[name]

    def split(n: int) -> tuple[np.ndarray, np.ndarray]:
        dtype = {"pixels": np.uint8, "floats": np.float32, "codes": np.int64}[s.kind]
        # a text's next tokens repeat (a few common bytes), so a document's validation
        # split can keep every class; other datasets cycle through every class
        cycle = 16 if s.kind == "codes" else s.classes
        return np.zeros((n, *s.input_shape), dtype), np.arange(n, dtype=np.int64) % cycle

    (x_train, y_train), (x_test, y_test) = split(s.n_train), split(s.n_test)
    channels = s.input_shape[0]
    pixels = PixelNorm((0.5,) * channels, (0.25,) * channels) if s.kind == "pixels" else None
    owners = OWNERS.get(name, 1000)
    groups = np.arange(s.n_train, dtype=np.int64) % owners if name in OWNED_DATASETS else None
    return Dataset(
        name, x_train, y_train, x_test, y_test, s.classes, pixels=pixels, train_groups=groups
    )


def _federations(path: Path) -> list[dict]:
    """The config's sweep points, one per distinct federation and model."""
    seen, points = set(), []
    for _, raw in expand_sweep(load_raw(path)):
        cfg = validate(raw)
        key = (cfg.data.model_dump_json(), cfg.model.model_dump_json(), cfg.algorithm)
        if key not in seen:
            seen.add(key)
            points.append(raw)
    return points


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_validates_and_builds_its_federation(path, monkeypatch):
    real = hetfl.assembly.load_dataset
    fakes: dict[str, Dataset] = {}

    def load(cfg):
        if cfg.data.dataset in ("digits", "synthetic"):  # built in: the real thing
            return real(cfg)
        if cfg.data.dataset not in fakes:
            fakes[cfg.data.dataset] = fake_dataset(cfg.data.dataset)
        return fakes[cfg.data.dataset]

    monkeypatch.setattr(hetfl.assembly, "load_dataset", load)
    threads = torch.get_num_threads()
    try:
        for raw in _federations(path):
            fedfa = raw.get("options", {}).get("fedfa", {})
            if raw["algorithm"] == "fedfa" and fedfa.get("choice", "zico") == "zico":
                # ZiCo on every client at a config's scale is minutes of CPU; the query is
                # tested at small scale (tests/test_fedfa.py, the golden run), set-up here
                # draws the choices instead
                raw.setdefault("options", {}).setdefault("fedfa", {})["choice"] = "random"
            cfg = validate(raw)
            parts = build_parts(cfg, show_progress=False)
            assert len(parts.clients) == cfg.data.num_clients
            state = setup_strategy(
                parts.strategy, [c.info() for c in parts.clients], parts.settings
            )
            assert state and all(torch.isfinite(v).all() for v in state.values())
    finally:
        torch.set_num_threads(threads)
