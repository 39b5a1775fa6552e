"""FLANC (`hetfl.algorithms.flanc`) against hand computations: the payload of a capacity,
the aggregation of bases across capacities and of every other tensor within one, an absent
capacity, the evaluation groups, a short run on real data, and bad settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from hetfl.algorithms import ALGORITHMS
from hetfl.algorithms.flanc import FLANCOptions
from hetfl.config import validate
from hetfl.core.client.regularisers import OrthogonalityPenalty
from hetfl.core.server.strategy import Strategy
from hetfl.core.spec import capacity_group
from hetfl.core.training import LocalTraining
from hetfl.core.types import ClientInfo, ClientResult, TrainedRound
from hetfl.models import ComposedFamily, SpecError
from hetfl.runner import run_one
from strategies import trained


def _family(side: int = 28) -> ComposedFamily:
    return ComposedFamily(
        {"family": "composed-cnn", "input_shape": (1, side, side), "num_classes": 10}
    )


def _strategy(family: ComposedFamily, cpr: int = 4, **options: object) -> Strategy:
    strategy, _ = ALGORITHMS.get("flanc").build(
        family, options, clients_per_round=cpr, train=LocalTraining()
    )
    return strategy


def _infos(capacities: list[float], sizes: list[int]) -> list[ClientInfo]:
    return [
        ClientInfo(cid=i, n_train=n, input_shape=(1, 28, 28), labels=(0,), attrs={"capacity": c})
        for i, (c, n) in enumerate(zip(capacities, sizes, strict=True))
    ]


def test_a_client_receives_the_bases_and_its_capacity_tensors_only() -> None:
    strategy = _strategy(_family(), capacity="declared", levels=[0.5, 1.0])
    infos = _infos([0.5, 0.9, 1.0, 1.0], [10, 10, 10, 10])
    state = strategy.setup(infos, torch.Generator().manual_seed(0))
    tasks = strategy.plan(1, state, infos, torch.Generator().manual_seed(1))
    task = next(t for t in tasks if t.cid == 0)
    assert {e.global_name.split("/")[0] for e in task.index_map} == {"basis", "cap0.5"}
    # Hand count at p = 0.5 (R1 = 16, R2 = 32): stem 1->64 3x3 + bias 640; each composed
    # layer's bank 32*16*9 = 4608 and coefficients 64 x (64/16)*32 = 8192; head
    # (64*7*7) * 10 + 10 = 31370. 57,610 numbers, 230,440 bytes.
    numbers = sum(v.numel() for v in task.payload.values())
    assert numbers == 640 + 2 * (4608 + 8192) + 31370
    assert sum(v.numel() * v.element_size() for v in task.payload.values()) == 230_440
    # the capacity-0.9 client runs the 0.5 model: the largest level not above its capacity
    assert next(t for t in tasks if t.cid == 1).spec["capacity"] == 0.5


def _results(strategy: Strategy, state, infos, cids: list[int]) -> TrainedRound:
    tasks = strategy.plan(1, state, infos, torch.Generator().manual_seed(1))
    results = [
        ClientResult(
            cid=t.cid,
            tensors={k: torch.full_like(v, float(t.cid + 1)) for k, v in t.payload.items()},
            num_examples=infos[t.cid].n_train,
            num_steps=1,
            loss=0.0,
        )
        for t in tasks
        if t.cid in cids
    ]
    return trained(tasks, results)


def test_bases_average_over_all_clients_and_the_rest_within_each_capacity() -> None:
    strategy = _strategy(_family(), capacity="declared", levels=[0.5, 1.0])
    infos = _infos([0.5, 0.5, 1.0, 1.0], [10, 30, 10, 30])  # sizes must not weigh
    state = strategy.setup(infos, torch.Generator().manual_seed(0))
    new = strategy.aggregate(1, state, _results(strategy, state, infos, [0, 1, 2, 3])).state
    for name, value in new.items():
        group = name.split("/")[0]
        expected = {"basis": (1 + 2 + 3 + 4) / 4, "cap0.5": (1 + 2) / 2, "cap1": (3 + 4) / 2}
        if name.endswith("num_batches_tracked"):
            continue
        assert torch.all(value == expected[group]), name


def test_an_absent_capacity_keeps_its_tensors() -> None:
    strategy = _strategy(_family(), capacity="declared", levels=[0.5, 1.0])
    infos = _infos([0.5, 0.5, 1.0, 1.0], [10, 10, 10, 10])
    state = strategy.setup(infos, torch.Generator().manual_seed(0))
    new = strategy.aggregate(1, state, _results(strategy, state, infos, [0, 1])).state
    for name, value in new.items():
        if name.startswith("cap1/"):
            assert torch.equal(value, state[name]), name
        else:
            assert torch.all(value == 1.5), name


def test_a_short_run_on_digits_reports_every_capacity_and_their_mean(tmp_path: Path) -> None:
    cfg = validate(
        {
            "name": "flanc",
            "algorithm": "flanc",
            "options": {"flanc": {"lambda_orth": 0.1, "levels": [0.5, 1.0]}},
            "data": {"dataset": "digits", "num_clients": 4, "test_per_client": 10},
            "model": {"name": "composed-cnn"},
            "train": {
                "rounds": 3,
                "clients_per_round": 4,
                "local_epochs": 3,
                "lr": 0.05,
                "momentum": 0.9,
            },
            "eval": {"local_eval": "none"},
            "device": "cpu",
        }
    )
    run_one(cfg, tmp_path, show_progress=False)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    groups = rows[-1]["groups"]
    accs = [groups[f"capacity={p:g}"]["acc"] for p in (0.5, 1.0)]
    assert groups["capacity=mean"]["acc"] == pytest.approx(sum(accs) / 2)
    assert rows[-1]["global_acc"] == groups["capacity=1"]["acc"]
    assert rows[-1]["global_acc"] > rows[0]["global_acc"] and min(accs) > 0.5  # chance 0.1


def test_bad_settings_are_refused_with_clear_errors() -> None:
    with pytest.raises(
        SpecError,
        match=r"layer conv3.conv at capacity 0.3: S_p/R1 must be an integer, got S_p = 39",
    ):
        _strategy(_family(), levels=[0.3, 1.0])
    with pytest.raises(ValueError, match=r"width levels must be in \(0, 1\]"):
        _strategy(_family(), levels=[0.5, 1.5])
    with pytest.raises(ValueError, match=r"clients_per_round is 3; ask at least 4"):
        _strategy(_family(), cpr=3)
    with pytest.raises(ValidationError, match=r"lambda_orth"):
        FLANCOptions(lambda_orth=-0.1)
    with pytest.raises(ValidationError, match=r"capacity"):
        FLANCOptions(capacity="fixed")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"needs a composed model .* 'flanc-cnn' is not one"):
        validate({"algorithm": "flanc", "model": {"name": "flanc-cnn"}})
    with pytest.raises(ValueError, match=r"client 0 declares capacity 0.1, below the smallest"):
        strategy = _strategy(_family(), capacity="declared")
        strategy.setup(_infos([0.1], [10]), torch.Generator())


def test_the_recipe_holds_the_orthogonality_penalty_at_the_configured_lambda() -> None:
    for options, lam in (({}, 10.0), ({"lambda_orth": 0.1}, 0.1), ({"lambda_orth": 0.0}, 0.0)):
        _, recipe = ALGORITHMS.get("flanc").build(
            _family(), options, clients_per_round=4, train=LocalTraining()
        )
        assert recipe.loss_terms == (OrthogonalityPenalty(lam),), options


def test_plan_under_dynamic_all_levels_gives_every_level_every_round() -> None:
    """Through `Strategy.plan`: each round's four or ten sampled clients hold all four
    levels, and each task's payload is its own capacity's tensors."""
    levels = (0.25, 0.5, 0.75, 1.0)
    infos = _infos([1.0] * 12, [10] * 12)
    for cpr in (4, 10):
        strategy = _strategy(_family(), cpr=cpr)
        state = strategy.setup(infos, torch.Generator().manual_seed(0))
        for rnd in range(1, 21):
            tasks = strategy.plan(rnd, state, infos, torch.Generator().manual_seed(rnd))
            assert len(tasks) == cpr
            assert {t.spec["capacity"] for t in tasks} == set(levels), (cpr, rnd)
            for t in tasks:
                group = capacity_group(t.spec["capacity"])
                assert {e.global_name.split("/")[0] for e in t.index_map} == {"basis", group}


def test_resnet18_bank_rows_and_per_capacity_normalisation_aggregate_by_hand() -> None:
    """ResNet-18 (`code` banks: one per block, conv1 rows [0, R2), conv2 rows [R2, 2·R2)).
    Clients 0, 1 at capacity 0.5 and 2, 3 at 1 send, for client c, c + 1 in conv1's bases,
    10 (c + 1) in conv2's, and c + 1 in everything else. The bank rows average over all
    four clients, each half from its own convolution; every BatchNorm tensor (affine and
    running statistics) only within its capacity."""
    fam = ComposedFamily(
        {"family": "composed-resnet18", "input_shape": (3, 8, 8), "num_classes": 10}
    )
    strategy = _strategy(fam, capacity="declared", levels=[0.5, 1.0])
    infos = _infos([0.5, 0.5, 1.0, 1.0], [10, 30, 10, 30])
    state = strategy.setup(infos, torch.Generator().manual_seed(0))
    tasks = strategy.plan(1, state, infos, torch.Generator().manual_seed(1))
    for t in tasks:  # what a client receives: the block's bank, split between its convolutions
        torch.testing.assert_close(
            t.payload["layer2.1.conv1.basis"], state["basis/layer2.1"][:32], rtol=0, atol=0
        )
        torch.testing.assert_close(
            t.payload["layer2.1.conv2.basis"], state["basis/layer2.1"][32:], rtol=0, atol=0
        )

    def sent(name: str, value: torch.Tensor, cid: int) -> torch.Tensor:
        scale = 10.0 if name.endswith("conv2.basis") else 1.0
        return torch.full_like(value, scale * (cid + 1))

    results = [
        ClientResult(t.cid, {k: sent(k, v, t.cid) for k, v in t.payload.items()}, n, 1, 0.0)
        for t, n in zip(tasks, (10, 30, 10, 30), strict=True)  # sizes must not weigh
    ]
    new = strategy.aggregate(1, state, trained(tasks, results)).state
    for block, r2 in (("layer1.0", 16), ("layer2.1", 32), ("layer4.1", 128)):
        bank = new[f"basis/{block}"]
        assert bank.shape[0] == 2 * r2
        assert torch.all(bank[:r2] == 2.5) and torch.all(bank[r2:] == 25.0), block
    bn = [n for n in new if ".bn" in n and not n.endswith("num_batches_tracked")]
    assert {n.split("/")[0] for n in bn} == {"cap0.5", "cap1"}
    assert any(n.endswith("running_var") for n in bn)
    for name in bn:
        expected = 1.5 if name.startswith("cap0.5/") else 3.5
        assert torch.all(new[name] == expected), name
