"""`eval.stats_pass` (`local_acc_stats`): a method with private BatchNorm (FedBN here) is
scored locally a second time after each client re-estimates its model's BatchNorm
statistics on its own training data with the current shared weights, for that evaluation
only; `local_acc` and the client store are untouched."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hetfl.algorithms import ALGORITHMS
from hetfl.config import ConfigError, validate
from hetfl.core.client.bn_statistics import recompute_bn_statistics
from hetfl.core.client.program import Programs
from hetfl.core.client.scoring import evaluate_model
from hetfl.core.training import LocalTraining
from hetfl.data import PARTITIONERS, build_clients, global_test, load_digits
from hetfl.engine.round_settings import RoundSettings
from hetfl.models import ScalableFamily
from hetfl.sim import Simulation


def _fedbn_digits(tmp_path: Path, stats_pass: bool) -> Simulation:
    """4 digits clients of 3 classes each, all sampled, a 2-stage CNN with private BN."""
    ds = load_digits(seed=0)
    parts = PARTITIONERS.get("classes")(ds.y_train, 4, np.random.default_rng(0), k=3)
    clients = build_clients(ds, parts, test_per_client=30, seed=0)
    fam = ScalableFamily(
        {"family": "stage-cnn", "input_shape": ds.input_shape, "num_classes": 10, "stages": 2}
    )
    strategy, recipe = ALGORITHMS.get("fedbn").build(
        fam, {}, clients_per_round=4, train=LocalTraining(lr=0.1, steps=4, batch_size=16)
    )
    settings = RoundSettings(rounds=2, seed=0, local_eval="all", local_stats_pass=stats_pass)
    program = Programs(fam, recipe, seed=0)
    return Simulation(strategy, program, clients, global_test(ds, "cpu"), settings, tmp_path)


def test_local_acc_stats_is_local_acc_after_each_clients_own_statistics_pass(tmp_path):
    sim = _fedbn_digits(tmp_path / "with", stats_pass=True)
    sim.run()
    row = sim.metrics.read()[-1]
    stored = {cid: {k: v.clone() for k, v in sim.store.get(cid).items()} for cid in sim.clients}
    plain, passed = [], []
    for cid, data in sim.clients.items():
        task = sim.strategy.eval_task(sim.infos[cid], sim.state, {})
        model = sim.programs.family.build(task.spec)
        model.load_state_dict({**task.payload, **stored[cid]})
        correct, _, n = evaluate_model(model, data.x_test, data.y_test)
        plain.append(correct / n)
        recompute_bn_statistics(model, data.x_train)
        correct, _, n = evaluate_model(model, data.x_test, data.y_test)
        passed.append(correct / n)
    assert any(name.endswith("running_mean") for name in stored[0])  # private statistics
    assert row["local_acc"] == pytest.approx(sum(plain) / 4, abs=1e-12)
    assert row["local_acc_stats"] == pytest.approx(sum(passed) / 4, abs=1e-12)
    assert row["local_acc_stats"] != row["local_acc"]  # the pass changes what is scored
    for cid in sim.clients:  # the evaluation left the private state as training did
        for name, value in sim.store.get(cid).items():
            assert torch.equal(value, stored[cid][name]), (cid, name)
    without = _fedbn_digits(tmp_path / "without", stats_pass=False)
    without.run()
    other = without.metrics.read()[-1]
    assert other["local_acc_stats"] is None
    assert (other["local_acc"], other["global_acc"]) == (row["local_acc"], row["global_acc"])


def test_stats_pass_without_local_evaluation_is_refused() -> None:
    raw = {
        "algorithm": "fedbn",
        "model": {"name": "stage-cnn"},
        "eval": {"stats_pass": True, "local_eval": "none"},
    }
    with pytest.raises(ConfigError, match=r"stats_pass reports local_acc_stats.*local_eval is"):
        validate(raw)
    assert validate({**raw, "eval": {"stats_pass": True}}).eval.stats_pass
