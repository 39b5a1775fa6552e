"""A short run on real Fashion-MNIST data: accuracy must rise well above chance (0.1)."""

from __future__ import annotations

import json

import pytest

from conftest import FMNIST_DIR, fmnist_available
from hetfl.cli import main

pytestmark = pytest.mark.skipif(
    not fmnist_available(), reason=f"Fashion-MNIST not installed in {FMNIST_DIR}"
)


def test_short_fedavg_run_learns_fashion_mnist(tmp_path):
    cfg = tmp_path / "fmnist.yaml"
    cfg.write_text(
        f"""
name: fmnist
algorithm: fedavg
data:
  dataset: fashion-mnist
  num_clients: 10
  partition: {{kind: dirichlet, alpha: 0.5}}
  test_per_client: 50
model: {{name: small-cnn}}
train: {{rounds: 4, clients_per_round: 5, local_steps: 25, batch_size: 32, lr: 0.05}}
output_dir: {tmp_path / "runs"}
"""
    )
    assert main(["run", str(cfg), "--quiet"]) == 0
    rows = [
        json.loads(x) for x in (tmp_path / "runs/fmnist/metrics.jsonl").read_text().split("\n") if x
    ]
    accs = [r["global_acc"] for r in rows]
    assert accs[-1] > 0.5, accs
    assert accs[-1] > accs[0], accs
    assert rows[-1]["loss"] < rows[0]["loss"]
