"""One evaluation protocol imposable on every method (`eval.global_stats_pass`,
`eval.require_global_test`, the evaluation plan of `hetfl.engine.evaluation_plan`): forced
on, FedAvg's `global_acc` is the averaged model's score after a statistics pass run by
hand; forced off, FedGKT's `pooled_acc` scores the joined models' running statistics; a
method the protocol cannot score is refused at set-up by name; summary.json records it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hetfl.algorithms import ALGORITHMS
from hetfl.config import ConfigError, validate
from hetfl.core.client.bn_statistics import (
    BNStatistics,
    apply_bn_statistics,
    bn_batch_statistics,
)
from hetfl.core.client.program import Programs
from hetfl.core.client.scoring import evaluate_model
from hetfl.core.training import LocalTraining
from hetfl.data import PARTITIONERS, build_clients, global_test, load_digits
from hetfl.engine.evaluation_plan import GlobalTest, LocalSplits, PooledOwnSplits, build_plan
from hetfl.engine.round_settings import RoundSettings
from hetfl.engine.statistics import add_bn_statistics
from hetfl.models import ScalableFamily, make_family
from hetfl.runner import build_simulation
from hetfl.sim import Simulation


def _digits(
    algorithm: str, family, tmp_path: Path, train: LocalTraining, options=None, **settings
) -> Simulation:
    """4 IID digits clients, all sampled, one round."""
    ds = load_digits(seed=0)
    parts = PARTITIONERS.get("iid")(ds.y_train, 4, np.random.default_rng(0))
    clients = build_clients(ds, parts, test_per_client=20, seed=0)
    strategy, recipe = ALGORITHMS.get(algorithm).build(
        family(ds), options or {}, clients_per_round=4, train=train
    )
    return Simulation(
        strategy,
        Programs(family(ds), recipe, seed=0),
        clients,
        global_test(ds, "cpu"),
        RoundSettings(rounds=1, seed=0, **settings),
        tmp_path,
        info={"algorithm": algorithm},
    )


def _stage_cnn(ds):
    return ScalableFamily(
        {"family": "stage-cnn", "input_shape": ds.input_shape, "num_classes": 10, "stages": 2}
    )


def _split_resnet(ds):
    return make_family("resnet-cifar", ds.input_shape, 10, blocks=1)


SGD = LocalTraining(lr=0.1, steps=4, batch_size=16)


class _Probe:
    metric = "attack_success"

    def samples(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, y


def test_forced_on_fedavg_scores_the_averaged_model_after_a_statistics_pass_by_hand(tmp_path):
    on = _digits("fedavg", _stage_cnn, tmp_path / "on", SGD, global_stats_pass="on")
    auto = _digits("fedavg", _stage_cnn, tmp_path / "auto", SGD)
    row_on, row_auto = on.run()["final"], auto.run()["final"]
    for name, value in auto.state.items():  # the pass changes what is scored, not training
        assert torch.equal(value, on.state[name]), name
    (em,) = on.strategy.eval_models(on.state)
    model = on.programs.family.build(em.spec)
    model.load_state_dict(em.tensors)
    correct, loss, n = evaluate_model(model, on.x_test, on.y_test, pixels=on.pixels)
    assert (row_auto["global_acc"], row_auto["test_loss"]) == (correct / n, loss / n)
    total: BNStatistics = {}
    for cid in sorted(on.clients):  # each client's training data, in client-id order
        add_bn_statistics(total, bn_batch_statistics(model, on.clients[cid].x_train, 500))
    apply_bn_statistics(model, total)
    correct, loss, n = evaluate_model(model, on.x_test, on.y_test, pixels=on.pixels)
    assert (row_on["global_acc"], row_on["test_loss"]) == (correct / n, loss / n)
    assert row_on["test_loss"] != row_auto["test_loss"]
    recorded = json.loads((tmp_path / "on" / "summary.json").read_text())["evaluation"]
    assert recorded == {
        "global_stats_pass": "on",
        "require_global_test": False,
        "plan": ["global test", "local test"],
    }


def test_forced_off_fedgkt_pools_its_joined_models_at_their_running_statistics(tmp_path):
    train = LocalTraining(lr=1e-3, optimizer="amsgrad", steps=2, batch_size=32)
    # one server epoch: the pooled score does not depend on how long the server trained
    one = {"server_epochs": 1}
    off = _digits("fedgkt", _split_resnet, tmp_path, train, one, global_stats_pass="off")
    row = off.run()["final"]
    hits = seen = 0
    for cid in sorted(off.store):
        task = off.strategy.pooled_task(off.infos[cid], off.state)
        assert task is not None and task.stats_pass  # FedGKT's own choice: a pass
        model = off.programs.family.build(task.spec)
        names = model.state_dict()  # the client keeps its own classifier too
        private = {k: v for k, v in off.store.get(cid).items() if k in names}
        model.load_state_dict({**private, **task.payload})
        data = off.clients[cid]
        correct, _, n = evaluate_model(model, data.x_test, data.y_test, pixels=off.pixels)
        hits, seen = hits + correct, seen + n
    assert row["global_acc"] is None
    assert row["pooled_acc"] == pytest.approx(hits / seen, abs=1e-12)


def _config(algorithm: str, **eval_settings) -> dict:
    return {
        "algorithm": algorithm,
        "data": {"dataset": "digits", "num_clients": 4, "test_per_client": 10},
        "model": {"name": "stage-cnn", "stages": 2},
        "train": {"rounds": 1, "clients_per_round": 4},
        "eval": eval_settings,
    }


@pytest.mark.parametrize(
    ("algorithm", "eval_settings", "message"),
    [
        ("fedper", {"require_global_test": True}, r"fedper cannot be scored.*local_acc alone"),
        ("heterofl", {"global_stats_pass": "off"}, r"heterofl cannot be scored.*no running"),
    ],
)
def test_a_method_the_protocol_cannot_score_is_refused_at_set_up_by_name(
    tmp_path, algorithm, eval_settings, message
):
    sim = build_simulation(validate(_config(algorithm, **eval_settings)), tmp_path)
    with pytest.raises(ValueError, match=message):
        sim.setup()
    build_simulation(validate(_config(algorithm)), tmp_path).setup()  # auto: as it does


def test_a_protocol_setting_outside_its_choices_is_refused_at_the_config_edge():
    with pytest.raises(ConfigError, match="global_stats_pass"):
        validate(_config("fedavg", global_stats_pass="sometimes"))


@pytest.mark.parametrize(
    ("kind", "settings", "names"),
    [
        (  # a global model, a backdoor's probe, validation, every local score
            {"has_global": True, "pooled": False},
            {"local_stats_pass": True, "local_trained": True, "probes": (_Probe(),)},
            ["global test", "global validation", "probe attack_success", "local test",
             "local test stats", "trained before aggregation"],
        ),
        (  # FedGKT: its clients' own splits; local validation only if they score nothing
            {"has_global": False, "pooled": True},
            {"global_stats_pass": "off"},
            ["pooled test", "pooled validation", "local test", "local validation"],
        ),
        (  # private layers only: validation on each client's own split
            {"has_global": False, "pooled": False},
            {},
            ["local test", "local validation"],
        ),
        (  # nor any local evaluation: nothing is scored
            {"has_global": False, "pooled": False},
            {"local_eval": "none"},
            [],
        ),
    ],
)  # fmt: skip
def test_the_plan_is_built_once_from_what_the_method_declares_and_the_settings(
    kind, settings, names
):
    plan = build_plan(
        RoundSettings(rounds=1, seed=0, **settings), split_model=False, validation=True, **kind
    )
    assert plan.names() == names
    assert plan.scores_trained == ("trained before aggregation" in names)
    rule = settings.get("global_stats_pass", "auto")
    assert all(
        a.stats_pass == rule for a in plan.asks if isinstance(a, GlobalTest | PooledOwnSplits)
    )
    deferred = [a for a in plan.asks if isinstance(a, LocalSplits) and a.unless_scored]
    assert deferred == ([LocalSplits("validation", unless_scored=True)] if kind["pooled"] else [])
