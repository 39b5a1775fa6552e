"""Shared fixtures: small real federations that train in well under a second per round."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hetfl.data import PARTITIONERS, build_clients, global_test, load_synthetic
from hetfl.models import PlainFamily

FMNIST_DIR = Path("/usr/share/datasets/fashion-mnist")


def fmnist_available() -> bool:
    return (FMNIST_DIR / "train-images-idx3-ubyte.gz").exists()


@pytest.fixture(autouse=True)
def _few_threads() -> None:
    torch.set_num_threads(1)


@pytest.fixture
def synthetic_federation():
    """8 IID clients of a learnable synthetic 10-class problem, an MLP family."""
    ds = load_synthetic(n_train=800, n_test=400, num_classes=10, shape=(1, 8, 8), seed=0)
    parts = PARTITIONERS.get("iid")(ds.y_train, 8, np.random.default_rng(0))
    clients = build_clients(ds, parts, test_per_client=20, seed=0)
    family = PlainFamily("mlp", ds.input_shape, ds.num_classes)
    return family, clients, global_test(ds, "cpu")


def write_config(path: Path, text: str) -> Path:
    path.write_text(text)
    return path
