"""`data.train_samples`: the partition deals a seeded subset of the training set, so a
Dirichlet split keeps unequal client sizes at a reduced scale; the default deals the whole
set as before, and a subset larger than the training set is refused by name."""

from __future__ import annotations

import numpy as np
import pytest

from hetfl.assembly import load_dataset, partition
from hetfl.config import ConfigError, validate
from hetfl.core.rng import SERVER, numpy_generator
from hetfl.data import PARTITIONERS


def _config(**data):
    base = {"dataset": "digits", "num_clients": 6, "partition": {"kind": "dirichlet", "alpha": 0.5}}
    return validate(
        {
            "algorithm": "fedavg",
            "seed": 3,
            "train": {"clients_per_round": 6},
            "data": {**base, **data},
        }
    )


def test_the_subset_is_drawn_first_then_dealt_by_the_partitioner():
    cfg = _config(train_samples=600)
    dataset = load_dataset(cfg)
    parts = partition(cfg, dataset)
    # by hand: the subset from its own generator, the Dirichlet split of its labels
    pool = np.sort(
        numpy_generator(3, 0, SERVER, "train-samples").choice(
            dataset.y_train.shape[0], size=600, replace=False
        )
    )
    expected = PARTITIONERS.get("dirichlet")(
        dataset.y_train[pool], 6, numpy_generator(3, 0, SERVER, "partition"), alpha=0.5
    )
    assert [p.tolist() for p in parts] == [pool[e].tolist() for e in expected]
    dealt = np.concatenate(parts)
    assert dealt.size == np.unique(dealt).size == 600
    sizes = [p.size for p in parts]
    assert sum(sizes) == 600 and max(sizes) > min(sizes)  # unequal, as Dirichlet deals


def test_without_it_the_whole_training_set_is_dealt_as_before():
    cfg = _config()
    dataset = load_dataset(cfg)
    expected = PARTITIONERS.get("dirichlet")(
        dataset.y_train, 6, numpy_generator(3, 0, SERVER, "partition"), alpha=0.5
    )
    assert [p.tolist() for p in partition(cfg, dataset)] == [e.tolist() for e in expected]


def test_a_subset_beyond_the_training_set_is_refused():
    cfg = _config(train_samples=10**6)
    with pytest.raises(ConfigError, match=r"data\.train_samples = 1000000 but digits has"):
        partition(cfg, load_dataset(cfg))
    with pytest.raises(ValueError, match="train_samples"):
        _config(train_samples=0)
