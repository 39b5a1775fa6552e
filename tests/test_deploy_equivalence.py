"""The Flower adapter and the simulator are the same engine twice: one round of the same
config and seed through Flower's simulation engine (Ray backend) and through the
simulator gives the same aggregated global state, and the same metrics row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("flwr")
pytest.importorskip("ray")

from flwr.simulation import run_simulation

from hetfl.config import validate
from hetfl.flower import client_app, make_server_app
from hetfl.runner import build_simulation, run_one

pytestmark = pytest.mark.flower


@pytest.mark.parametrize(
    ("algorithm", "options", "model"),
    [
        ("fedprox", {"mu": 0.1}, {"name": "mlp"}),
        # Heterogeneous sub-models: per-client widths, sliced index maps, per-width passes.
        ("fjord", {"levels": [0.25, 0.5, 1.0]}, {"name": "stage-cnn", "stages": 2}),
        # Bases shared across capacities, every other tensor per capacity (declared tensors).
        ("flanc", {"levels": [0.5, 1.0], "lambda_orth": 0.1}, {"name": "composed-cnn"}),
        # LoRA adapters of two ranks on a frozen base, the product-space SVD on the server.
        ("flexlora", {"ranks": [2, 4]}, {"name": "mlp"}),
    ],
)
def test_one_round_through_ray_equals_the_simulator(tmp_path: Path, algorithm, options, model):
    cfg = validate(
        {
            "name": "eq",
            "seed": 5,
            "algorithm": algorithm,
            "options": {algorithm: options},
            "data": {
                "dataset": "digits",
                "num_clients": 3,
                "partition": {"kind": "dirichlet", "alpha": 0.5, "min_size": 20},
                "test_per_client": 20,
            },
            "model": model,
            # Two of three clients are sampled: plan's draw must agree too.
            "train": {"rounds": 1, "clients_per_round": 2, "batch_size": 16, "lr": 0.05},
            "eval": {"local_eval": "sampled"},
            "device": "cpu",
            "threads": 1,
        }
    )
    flower_dir, sim_dir = tmp_path / "flower", tmp_path / "sim"
    run_simulation(
        make_server_app(cfg, flower_dir, show_progress=False),
        client_app,
        num_supernodes=cfg.data.num_clients,
        backend_name="ray",
        backend_config={
            "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
            # "local": a Ray of its own, never a cluster RAY_ADDRESS names on this machine
            "init_args": {"address": "local", "num_cpus": 2, "include_dashboard": False},
        },
    )
    run_one(cfg, sim_dir, show_progress=False)

    def final_state(run_dir: Path) -> dict[str, torch.Tensor]:
        ckpt = torch.load(run_dir / "checkpoints" / "latest.pt", weights_only=False)
        return ckpt["global"]

    flower, sim = final_state(flower_dir), final_state(sim_dir)
    assert set(flower) == set(sim)
    for name in sim:
        torch.testing.assert_close(flower[name], sim[name], rtol=0, atol=1e-6)
    # The round moved the model: the states compared are not two untouched copies.
    initial = build_simulation(cfg, tmp_path / "initial", show_progress=False)
    initial.setup()
    assert any(not torch.equal(sim[k], initial.state[k]) for k in sim)
    row_f = json.loads((flower_dir / "metrics.jsonl").read_text())
    row_s = json.loads((sim_dir / "metrics.jsonl").read_text())
    for row in (row_f, row_s):
        row.pop("wall_time_s")
    assert row_f == row_s
    assert row_s["clients"] == 2 and row_s["loss"] is not None
