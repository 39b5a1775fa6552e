"""`eval.local_trained`: each trained client's model right after local training, before
aggregation, scored on its local test split the same way for every method (FedFA, Park and
Joe-Wong, ECML-PKDD 2024, §5.1), and nothing else of the run changed by measuring it.

The hand computation below rebuilds each client's model from what the round gave
`aggregate` (the sent tensors) and what the client kept (the store), re-estimates every
BatchNorm layer's statistics on the client's training data with PyTorch's own cumulative
average (momentum None, over consecutive batches of 500 samples: the mean of the batches'
means and of their unbiased variances), masks the logits of the classes
the client lacks and counts correct argmaxes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from hetfl.config import ConfigError, validate
from hetfl.core.client.terms import mask_logits
from hetfl.core.pixels import model_inputs
from hetfl.core.types import TrainedRound
from hetfl.engine.outputs import read_metrics
from hetfl.runner import build_simulation
from hetfl.sim import Simulation

BASE = {
    "seed": 3,
    "data": {"dataset": "digits", "num_clients": 3, "test_per_client": 30},
    "model": {"name": "stage-cnn", "stages": 2},
    "train": {"rounds": 1, "clients_per_round": 3, "local_steps": 3, "batch_size": 32},
    "eval": {"local_trained": True},
    "device": "cpu",
    "threads": 1,
}
#: HeteroFL: static BN with the scaler, label split (classes); FedBN: BatchNorm with running
#: statistics, kept private on the clients.
SETTINGS = {
    "heterofl": {
        "options": {"heterofl": {"levels": [1.0, 0.5], "assignment": "fixed"}},
        "data": {**BASE["data"], "partition": {"kind": "classes", "k": 4}},
    },
    "fedbn": {"model": {"name": "stage-cnn", "stages": 2, "bn": "batch"}},
}


def _raw(algorithm: str, **changes) -> dict:
    return {**BASE, "algorithm": algorithm, **SETTINGS.get(algorithm, {}), **changes}


def _recording(sim: Simulation) -> list[TrainedRound]:
    """Every round's hand-off to the strategy's aggregation, as the strategy received it."""
    seen: list[TrainedRound] = []
    aggregate = sim.strategy.aggregate

    def recorded(rnd, state, trained):
        seen.append(trained)
        return aggregate(rnd, state, trained)

    sim.strategy.aggregate = recorded  # type: ignore[method-assign]
    return seen


def _by_hand(sim: Simulation, trained: TrainedRound) -> dict[int, float]:
    """Each trained client's accuracy, its model rebuilt as the module docstring says."""
    family = sim.programs.family
    accs = {}
    for t in trained.trained:
        data = sim.clients[t.task.cid]
        spec = t.task.spec.replace(bn="batch", scaler=False)  # static BN evaluated as batch
        model = family.build(spec)
        tensors = {**sim.store.get(t.task.cid), **t.result.tensors}
        model.load_state_dict(
            {k: v for k, v in tensors.items() if k in model.state_dict()}, strict=False
        )
        norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        assert norms
        for m in norms:
            m.reset_running_stats()
            m.momentum = None
        model.train()
        with torch.no_grad():
            for batch in data.x_train.split(500):  # 572 samples for HeteroFL's client 1
                model(model_inputs(batch, data.pixels))
            model.eval()
            logits = mask_logits(model(model_inputs(data.x_test, data.pixels)), data.labels)
        accs[t.task.cid] = float((logits.argmax(1) == data.y_test).sum()) / len(data.y_test)
    return accs


@pytest.mark.parametrize("algorithm", sorted(SETTINGS))
def test_local_acc_trained_is_each_trained_model_scored_by_hand(algorithm, tmp_path) -> None:
    sim = build_simulation(validate(_raw(algorithm)), tmp_path, show_progress=False)
    seen = _recording(sim)
    sim.run()
    (row,) = read_metrics(tmp_path / "metrics.jsonl")
    accs = _by_hand(sim, seen[0])
    assert len(accs) == 3
    assert row["local_acc_trained"] == sum(accs.values()) / len(accs)
    trace = read_metrics(tmp_path / "clients.jsonl")
    assert {r["cid"]: r["local_acc_trained"] for r in trace} == accs


def test_measuring_it_changes_nothing_else_and_is_off_by_default(tmp_path) -> None:
    """Two rounds of FedAvg, measured and not: every other number of every row and trace
    row is the same (the scores are not in macs, bytes or the state); off by default the
    key is null."""
    raw = _raw("fedavg", train={**BASE["train"], "rounds": 2, "clients_per_round": 2})
    rows, traces = {}, {}
    for measured in (True, False):
        run_dir = tmp_path / str(measured)
        cfg = raw if measured else {**raw, "eval": {}}
        build_simulation(validate(cfg), run_dir, show_progress=False).run()
        rows[measured] = read_metrics(run_dir / "metrics.jsonl")
        traces[measured] = read_metrics(run_dir / "clients.jsonl")
    assert [r["local_acc_trained"] for r in rows[False]] == [None, None]
    assert all(0 <= r["local_acc_trained"] <= 1 for r in rows[True])

    def others(rs):
        return [
            {k: v for k, v in r.items() if k not in ("local_acc_trained", "wall_time_s")}
            for r in rs
        ]

    assert others(rows[True]) == others(rows[False])
    assert others(traces[True]) == others(traces[False])


def test_split_models_refuse_it(tmp_path) -> None:
    """A split model's client side ends before the classifier: refused in the config, and
    by the engine at set-up (its evaluation plan) for a strategy with a server program."""
    raw = {
        "algorithm": "splitfed",
        "data": {"dataset": "digits", "num_clients": 2},
        "model": {"name": "resnet-cifar", "blocks": 1},
        "train": {"rounds": 1, "clients_per_round": 2},
    }
    with pytest.raises(
        ConfigError, match=r"resnet-cifar' is a split model.*local_trained to false"
    ):
        validate({**raw, "eval": {"local_trained": True}})
    sim = build_simulation(validate(raw), tmp_path, show_progress=False)
    settings = dataclasses.replace(sim.settings, local_trained=True)
    engine = Simulation(
        sim.strategy,
        sim.programs,
        list(sim.clients.values()),
        (sim.x_test, sim.y_test),
        settings,
        tmp_path,
    )
    with pytest.raises(ValueError, match="client side ends before the classifier"):
        engine.setup()
