"""FedGKT scored on the global test set (`eval.pooled_global`, the evaluation plan's
`PooledGlobalTest`): each trained client's extractor joined to the server model on the
run's global test set, the unweighted mean over clients, equals a direct computation with
and without the statistics pass; `eval.require_global_test` now accepts FedGKT and asks it;
the worker processes give the sequential executor's metrics bit for bit; a client that
cannot take the global test images is refused by name."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from golden.harness import BY_NAME
from hetfl.assembly import build_parts
from hetfl.config import validate
from hetfl.core.pixels import model_inputs
from hetfl.core.spec import Spec
from hetfl.core.types import ClientData, EvalTask
from hetfl.engine.evaluation_plan import EvaluationPlan, PooledGlobalTest, build_plan, run_plan
from hetfl.engine.round_settings import RoundSettings
from hetfl.engine.steps import RoundOutcome
from hetfl.runner import build_simulation
from hetfl.sim import ProcessExecutor
from hetfl.sim.engine import Simulation
from hetfl.sim.executor import Executor


def _config(**eval_settings: Any) -> dict[str, Any]:
    """The golden FedGKT run (digits, 1-block resnet-cifar, 3 clients a round), cut to one
    round of 2 sampled clients, one epoch on either side, with `eval_settings`."""
    raw = copy.deepcopy(BY_NAME["fedgkt"].config)
    raw["train"].update(rounds=1, clients_per_round=2, local_epochs=1)
    raw["options"]["fedgkt"]["server_epochs"] = 1
    raw["eval"] = {**raw["eval"], "test_samples": 64, **eval_settings}
    return raw


def _run(tmp_path: Path, executor: Executor | None = None, **eval_settings: Any) -> Simulation:
    sim = build_simulation(validate(_config(**eval_settings)), tmp_path, show_progress=False)
    if executor is not None:
        sim.executor.close()
        sim.executor = executor
    sim.run()
    return sim


def _joined_by_hand(sim: Simulation, cid: int, stats_pass: bool) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) on the run's global test set of client `cid`'s md1
    (its private store) joined to the server model (the global state), after a statistics
    pass over the client's training data in one batch (reset, cumulative average) or at
    the running statistics as kept."""
    family = sim.programs.family
    whole = family.build(family.side_spec("whole"))
    mine = sim.store.get(cid)
    whole.load_state_dict({**{k: v for k, v in mine.items() if k.startswith("md1.")}, **sim.state})
    data = sim.clients[cid]
    if stats_pass:
        for m in whole.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.reset_running_stats()
                m.momentum = None
        with torch.no_grad():
            whole.train()(model_inputs(data.x_train, data.pixels))
    with torch.no_grad():
        logits = whole.eval()(model_inputs(sim.x_test, sim.pixels)).double()
    y = sim.y_test
    acc = float((logits.argmax(1) == y).double().mean())
    return acc, float(F.cross_entropy(logits, y, reduction="mean"))


@pytest.fixture(scope="module")
def sequential(tmp_path_factory) -> Simulation:
    """One round with the option on, run by the sequential executor."""
    return _run(tmp_path_factory.mktemp("sequential"), pooled_global=True)


@pytest.mark.parametrize("rule", ["auto", "off"])
def test_the_global_score_is_the_clients_joined_models_on_the_global_test_set_by_hand(
    sequential, rule
):
    sim = sequential
    assert sim.plan.names()[:2] == ["pooled global test", "pooled test"]
    (row,) = sim.metrics.read()
    if rule == "off":  # the same round scored by the protocol's other rule
        plan = EvaluationPlan((PooledGlobalTest("off"),))
        row = {"global_acc": None, "test_loss": None, "pooled_acc": row["pooled_acc"]}
        scores = run_plan(plan, sim, 1, RoundOutcome()).scores
        row.update(global_acc=scores.global_acc, test_loss=scores.test_loss)
    trained = sorted(sim.store)
    assert len(trained) == 2 and sim.y_test.numel() == 64  # the seeded subsample
    assert all(sim.clients[c].n_train <= 500 for c in trained)  # the pass: one batch
    by_hand = [_joined_by_hand(sim, cid, stats_pass=rule == "auto") for cid in trained]
    assert row["global_acc"] == pytest.approx(sum(a for a, _ in by_hand) / 2, abs=1e-12)
    assert row["test_loss"] == pytest.approx(sum(loss for _, loss in by_hand) / 2, abs=1e-6)
    assert row["pooled_acc"] is not None  # the own splits are still scored beside it


def test_without_the_option_fedgkt_asks_no_global_score():
    plan = build_plan(
        RoundSettings(rounds=1, seed=0),
        has_global=False,
        pooled=True,
        split_model=True,
        validation=False,
    )
    assert plan.names() == ["pooled test", "local test"]


def test_require_global_test_accepts_fedgkt_and_asks_its_global_score(tmp_path):
    sim = build_simulation(
        validate(_config(require_global_test=True)), tmp_path, show_progress=False
    )
    sim.setup()  # refused before this option existed
    assert sim.plan.names()[0] == "pooled global test"
    plan = build_plan(
        RoundSettings(rounds=1, seed=0, require_global_test=True, global_stats_pass="on"),
        has_global=False,
        pooled=True,
        split_model=True,
        validation=False,
    )
    assert plan.asks[0] == PooledGlobalTest("on")  # the protocol's rule reaches it
    with pytest.raises(ValueError, match=r"fedper cannot be scored.*local_acc alone"):
        build_plan(
            RoundSettings(rounds=1, seed=0, require_global_test=True),
            has_global=False,
            pooled=False,
            split_model=False,
            validation=False,
            method="fedper",
        )


def test_a_global_acc_target_is_accepted_once_the_global_test_set_scores_fedgkt():
    raw = {**_config(pooled_global=True), "targets": [{"metric": "global_acc", "value": 0.5}]}
    (target,) = build_parts(validate(raw), show_progress=False).settings.targets
    assert target.metric == "global_acc"


def _rows(sim: Simulation) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k != "wall_time_s"} for r in sim.metrics.read()]


def test_worker_processes_give_the_sequential_scores_bit_for_bit(sequential, tmp_path):
    executor = ProcessExecutor(2)
    try:
        processes = _run(tmp_path, executor, pooled_global=True)
    finally:
        executor.close()
    assert _rows(processes) == _rows(sequential)
    assert _rows(sequential)[0]["global_acc"] is not None


def test_a_client_whose_inputs_differ_from_the_global_test_set_is_refused_by_name(tmp_path):
    sim = build_simulation(validate(_config(pooled_global=True)), tmp_path, show_progress=False)
    data = sim.clients[0]
    sim.clients[0] = replace(data, x_test=data.x_test[:, :, :4, :4])  # a view's resize
    task = EvalTask(0, Spec({}), {}, [], split="global")
    with pytest.raises(ValueError, match=r"client 0 takes inputs of shape \(1, 4, 4\)"):
        sim._scored_data(task)
    assert sim._scored_data(replace(task, split="test")) is sim.clients[0]


def test_a_client_s_own_data_holds_no_global_test_set():
    x = torch.zeros(2, 1, 8, 8)
    y = torch.zeros(2, dtype=torch.long)
    data = ClientData(0, x, y, x, y, num_classes=10)
    with pytest.raises(ValueError, match="holds no global test set"):
        data.split("global")
    assert replace(data, global_test=(x[:1], y[:1])).split("global")[1].shape == (1,)
