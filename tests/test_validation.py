"""The validation split (`data.validation`), from the held-out samples to model selection.

Tuning must never look at a test set: validation samples come from the clients' training
data, leave it, and are scored into `val_acc`; `summary.json` and `hetfl compare --select
val_acc` choose by them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hetfl.algorithms import ALGORITHMS
from hetfl.cli import main
from hetfl.config import ConfigError, validate
from hetfl.core.client.program import Programs
from hetfl.core.client.scoring import evaluate_model
from hetfl.core.rng import numpy_generator
from hetfl.core.training import LocalTraining
from hetfl.data import PARTITIONERS, build_clients, global_test, load_synthetic, validation_split
from hetfl.engine.outputs import ROW_KEYS, Target, make_row, read_metrics, summarise
from hetfl.engine.round_settings import RoundSettings
from hetfl.models import PlainFamily
from hetfl.report import find_runs, selection_rows
from hetfl.sim import Simulation
from hetfl.systems.costs import MacCounter

FRACTION = 0.25


@pytest.fixture(scope="module")
def synthetic():
    """Gaussian samples: every row of the training and test sets is distinct, so a
    sample is known by its bytes."""
    return load_synthetic(n_train=240, n_test=120, num_classes=4, shape=(1, 4, 4), seed=0)


def _parts(ds, n: int = 3) -> list[np.ndarray]:
    return PARTITIONERS.get("iid")(ds.y_train, n, np.random.default_rng(0))


def _rows(x: torch.Tensor) -> set[bytes]:
    return {r.numpy().tobytes() for r in x.flatten(1)}


# -- the held-out samples -----------------------------------------------------------------
def test_validation_split_rounds_half_up_and_keeps_one_sample_per_class():
    labels = np.array([0] * 5 + [1] * 5)
    part = np.arange(10)
    rng = np.random.default_rng

    kept, held = validation_split(part, labels, 0.25, rng(0), cid=0)
    assert held.size == 3 and kept.size == 7  # 2.5 rounds up (Python's round gives 2)
    assert np.array_equal(np.sort(np.concatenate([kept, held])), part)
    assert np.all(np.diff(kept) > 0) and np.all(np.diff(held) > 0)
    assert validation_split(part, labels, 0.01, rng(0), cid=0)[1].size == 1  # at least one
    kept, held = validation_split(part, labels, 0.99, rng(0), cid=0)
    assert held.size == 8 and set(labels[kept]) == {0, 1}  # one of each class stays
    with pytest.raises(ValueError, match="client 7 has 3 training samples, one per class"):
        validation_split(np.arange(3), np.arange(3), 0.5, rng(0), cid=7)


def test_validation_is_disjoint_from_train_and_test_and_fixed_per_seed(synthetic):
    parts = _parts(synthetic)
    plain = build_clients(synthetic, parts, test_per_client=20, seed=0)
    held = build_clients(synthetic, parts, test_per_client=20, seed=0, validation=FRACTION)
    again = build_clients(synthetic, parts, test_per_client=20, seed=0, validation=FRACTION)
    other = build_clients(synthetic, parts, test_per_client=20, seed=1, validation=FRACTION)
    test_rows = _rows(torch.from_numpy(synthetic.x_test))
    for part, c0, c, c2, c_other in zip(parts, plain, held, again, other, strict=True):
        # the drawn indices are those of the client's own "validation" generator ...
        _, val_idx = validation_split(
            part, synthetic.y_train, FRACTION, numpy_generator(0, 0, c.cid, "validation"), c.cid
        )
        assert c.x_val is not None and c.y_val is not None
        assert torch.equal(c.x_val, torch.from_numpy(synthetic.x_train[val_idx]))
        assert torch.equal(c.y_val, torch.from_numpy(synthetic.y_train[val_idx]))
        # ... which leave the training data: n_train shrinks by round(0.25 n)
        assert c.n_train == part.size - val_idx.size == part.size - round(FRACTION * part.size)
        train, val = _rows(c.x_train), _rows(c.x_val)
        assert not train & val and train | val == _rows(c0.x_train)
        assert not val & test_rows and not val & _rows(c.x_test)  # never a test sample
        assert torch.equal(c.x_test, c0.x_test) and c.labels == c0.labels  # tests unchanged
        assert torch.equal(c.x_val, c2.x_val)  # the same draw twice
        assert not torch.equal(c.x_val, c_other.x_val)  # another under another seed
    assert plain[0].x_val is None and plain[0].split("validation")[1].numel() == 0


def test_validation_fraction_is_checked_at_the_edge():
    assert validate({"data": {"validation": 0.1}}).data.validation == 0.1
    assert validate({}).data.validation is None
    with pytest.raises(ConfigError, match=r"data\.validation: .*less than 1 \(got 1\.0\)"):
        validate({"data": {"validation": 1.0}})


# -- scores in the metrics rows -------------------------------------------------------------
def _run(synthetic, tmp_path: Path, algo: str, validation: float | None) -> Simulation:
    clients = build_clients(
        synthetic, _parts(synthetic), test_per_client=20, seed=0, validation=validation
    )
    family = PlainFamily("mlp", synthetic.input_shape, synthetic.num_classes)
    train = LocalTraining(lr=0.1, epochs=1, batch_size=16)
    strategy, recipe = ALGORITHMS.get(algo).build(
        family, None, clients_per_round=3, train=train, macs=MacCounter(family)
    )
    sim = Simulation(
        strategy,
        Programs(family, recipe, seed=0),
        clients,
        global_test(synthetic),
        RoundSettings(rounds=1, seed=0, local_eval="all"),
        tmp_path,
    )
    sim.run()
    return sim


def test_val_acc_scores_the_global_model_on_the_pooled_validation_samples(synthetic, tmp_path):
    sim = _run(synthetic, tmp_path / "val", "fedavg", FRACTION)
    rows = read_metrics(tmp_path / "val" / "metrics.jsonl")
    assert all(set(r) == set(ROW_KEYS) for r in rows)
    (em,) = sim.strategy.eval_models(sim.state)
    model = sim.eval_models.model_for(em.spec)
    model.load_state_dict(em.tensors)
    x = torch.cat([c.x_val for c in sim.clients.values()])
    y = torch.cat([c.y_val for c in sim.clients.values()])
    correct, loss_sum, n = evaluate_model(model, x, y)
    assert n == sum(round(FRACTION * p.size) for p in _parts(synthetic))
    assert rows[-1]["val_acc"] == pytest.approx(correct / n)
    assert rows[-1]["val_loss"] == pytest.approx(loss_sum / n)

    _run(synthetic, tmp_path / "none", "fedavg", None)
    unset = read_metrics(tmp_path / "none" / "metrics.jsonl")
    assert all(r["val_acc"] is None and r["val_loss"] is None for r in unset)


def test_without_a_global_model_val_acc_is_the_mean_of_clients_own_splits(synthetic, tmp_path):
    """FedPer keeps a private head: each client's model is scored on its own validation
    split, and the unweighted mean is `val_acc` (as `local_acc` is on the test splits)."""
    sim = _run(synthetic, tmp_path, "fedper", FRACTION)
    row = read_metrics(tmp_path / "metrics.jsonl")[-1]
    assert row["global_acc"] is None
    accs, losses = [], []
    for cid, data in sim.clients.items():
        task = sim.strategy.eval_task(sim.infos[cid], sim.state, {})
        model = sim.eval_models.model_for(task.spec)
        model.load_state_dict({**sim.store.get(cid), **task.payload})
        correct, loss_sum, n = evaluate_model(model, data.x_val, data.y_val)
        accs.append(correct / n)
        losses.append(loss_sum / n)
    assert row["val_acc"] == pytest.approx(sum(accs) / 3)
    assert row["val_loss"] == pytest.approx(sum(losses) / 3)


# -- selection by validation ------------------------------------------------------------------
def _row(rnd: int, val_acc: float | None, global_acc: float) -> dict:
    """A metrics row with loss = 1 - accuracy, on validation and on test."""
    val_loss = None if val_acc is None else 1 - val_acc
    return make_row(round=rnd, global_acc=global_acc, test_loss=1 - global_acc, local_acc=None,
                    val_acc=val_acc, val_loss=val_loss, bytes_down=0, bytes_up=0, macs=0,
                    groups={})  # fmt: skip


def test_summary_picks_the_round_of_best_val_acc_not_of_best_test(tmp_path):
    rows = [_row(1, 0.5, 0.9), _row(2, 0.7, 0.6), _row(3, 0.7, 0.65), _row(4, 0.6, 0.95)]
    summary = summarise(rows, [Target("global_acc", 0.9)], {}, failures={}, rounds_aggregated=4)
    assert summary["best_by_val"] == {
        "round": 2, "val_acc": 0.7, "global_acc": 0.6, "pooled_acc": None, "local_acc": None,
        "test_loss": 0.4,
    }  # fmt: skip
    assert summary["best"]["val_acc"] == 0.7 and summary["best"]["val_loss"] == pytest.approx(0.3)
    assert summary["best"]["global_acc"] == 0.95
    unset = summarise([_row(1, None, 0.9)], [], {}, failures={}, rounds_aggregated=1)
    assert unset["best_by_val"] is None and unset["best"]["val_acc"] is None


def _point(sweep: Path, name: str, algorithm: str, seed: int, val: float, test: float) -> None:
    """A finished sweep point whose only round scores `val` on validation and `test` on
    the global test set (summary written by the engine's own `summarise`)."""
    path = sweep / name
    path.mkdir(parents=True)
    rows = [_row(1, val, test)]
    (path / "metrics.jsonl").write_text(json.dumps(rows[0]) + "\n")
    info = {"name": "sweep", "algorithm": algorithm, "seed": seed}
    (path / "summary.json").write_text(
        json.dumps(summarise(rows, [], info, failures={}, rounds_aggregated=1))
    )


@pytest.fixture
def tuned(tmp_path: Path) -> Path:
    """Validation and test disagree: fedavg's lr=0.1 is best on test (0.9) and has the
    single best validation run (0.95), but lr=0.01 has the higher mean over seeds (0.8
    against 0.75), so selection by mean validation accuracy must choose lr=0.01."""
    for seed, (v01, v001) in enumerate([(0.95, 0.8), (0.55, 0.8)]):
        _point(tmp_path, f"fedavg-s{seed}-lr=0.1", "fedavg", seed, v01, 0.9)
        _point(tmp_path, f"fedavg-s{seed}-lr=0.01", "fedavg", seed, v001, 0.6 + 0.1 * seed)
        _point(tmp_path, f"ada-fedalrc-s{seed}-lr=0.1", "ada-fedalrc", seed, 0.5, 0.7)
        _point(tmp_path, f"ada-fedalrc-s{seed}-lr=0.01", "ada-fedalrc", seed, 0.6, 0.4)
    return tmp_path


def test_compare_selects_the_setting_of_best_mean_val_acc_not_of_best_test(tuned, capsys):
    rows, selections = selection_rows(find_runs([tuned]))
    assert [(s.algorithm, s.setting, s.val_acc, s.seeds, s.candidates) for s in selections] == [
        ("ada-fedalrc", "lr=0.01", 0.6, 2, 2),
        ("fedavg", "lr=0.01", 0.8, 2, 2),
    ]
    by_run = {r["run"]: r for r in rows}
    assert set(by_run) == {"fedavg-lr=0.01", "ada-fedalrc-lr=0.01"}
    assert by_run["fedavg-lr=0.01"]["global_acc at best val"] == "0.6500 ± 0.0707"
    assert by_run["fedavg-lr=0.01"]["best val_acc"] == "0.8000 ± 0.0000"
    assert "best global_acc" not in by_run["fedavg-lr=0.01"]  # a test-picked number

    assert main(["compare", str(tuned), "--select", "val_acc"]) == 0
    out = capsys.readouterr().out
    assert "  fedavg: lr=0.01 (val_acc 0.8000 ± 0.0000; seeds 2, settings compared 2)" in out
    assert "| fedavg-lr=0.01 " in out and "fedavg-lr=0.1 " not in out


def test_select_needs_val_acc_in_every_run(tuned, capsys):
    _point(tuned, "fedprox-s0", "fedprox", 0, 0.5, 0.5)
    summary_path = tuned / "fedprox-s0" / "summary.json"
    summary = json.loads(summary_path.read_text())
    summary_path.write_text(json.dumps({**summary, "best_by_val": None}))
    assert main(["compare", str(tuned), "--select", "val_acc"]) == 2
    err = capsys.readouterr().err
    assert "needs a validation accuracy in every run, and 1 have none" in err
    assert "fedprox-s0" in err and "data.validation" in err
