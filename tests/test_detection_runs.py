"""Detection runs end to end: a detector's clients scored by mAP on their local splits,
reported as `local_map` and per group (issue 53)."""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from golden.harness import BY_NAME
from hetfl.algorithms import ALGORITHMS
from hetfl.assembly import build_parts
from hetfl.config import ConfigError, set_dotted, validate
from hetfl.core.client.detection_scoring import DetectionScoring, evaluate_detector, scored_with
from hetfl.core.client.program import Programs
from hetfl.core.model_cache import ModelCache
from hetfl.core.rng import torch_generator
from hetfl.core.training import LocalTraining
from hetfl.core.types import EvalTask
from hetfl.data.detection_views import DetectionGroup, detection_clients
from hetfl.data.synthetic_detection import synthetic_detection
from hetfl.engine.outputs import ROW_KEYS, read_metrics
from hetfl.engine.steps import Counters, GlobalScores, RoundOutcome, metrics_row
from hetfl.models import ScalableFamily
from hetfl.models.ssd import default_boxes
from hetfl.paired import paired_differences
from hetfl.report import comparison_rows, find_runs
from hetfl.runner import build_simulation

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _family() -> ScalableFamily:
    return ScalableFamily(
        {
            "family": "ssd-stage-cnn",
            "input_shape": (3, 32, 32),
            "num_classes": 4,
            "stages": 3,
            "heads": 2,
        }
    )


def test_a_detector_client_is_scored_by_map_on_its_whole_split():
    """`ClientProgram.evaluate` with ScalableFL's detector recipe answers (mAP x count,
    summed SSD loss, count), the mAP over the client's whole local test split, each
    interpolation as `eval.map_interpolation` sets it."""
    data = synthetic_detection(n_train=16, n_test=8, num_classes=4, side=32, seed=3)
    (client,) = detection_clients(data, [DetectionGroup(32, 4, 1)], seed=0)
    family = _family()
    train = LocalTraining(lr=0.02, steps=1, batch_size=8)
    strategy, recipe = ALGORITHMS.get("scalablefl").build(
        family, {"base_size": 4, "base_classes": 4}, clients_per_round=1, train=train
    )
    assert isinstance(recipe.scoring, DetectionScoring)
    info = client.info()
    state = strategy.setup([info], torch_generator(0, 0, -1, "init"), rounds=1)
    (task,) = strategy.plan(1, state, [info], torch_generator(0, 1, -1, "sample"))
    evaluation = EvalTask(0, task.spec, task.payload, task.index_map)
    cache = ModelCache(family)
    for interpolation in ("all-point", "11-point"):
        programs = Programs(family, scored_with(recipe, interpolation), seed=0)
        score, loss_sum, n = programs.program_for(0).evaluate(evaluation, client, {}, cache)
        model = cache.model_for(task.spec)  # as loaded by the evaluation
        expected = evaluate_detector(
            model,
            client.x_test,
            client.y_test,
            recipe.forward,
            default_boxes(task.spec),
            4,
            pixels=client.pixels,
            interpolation=interpolation,
        )
        assert expected[0] is not None and n == expected[2] == client.x_test.shape[0]
        assert score / n == pytest.approx(expected[0]) and loss_sum == pytest.approx(expected[1])


def test_a_detection_row_names_its_maps_and_leaves_the_accuracies_null():
    """The scores a detection round gives in accuracy's place: the mean over clients is
    `local_map`, a group's entry is its `map`."""
    groups = {"group=16px-2cls": {"acc": 0.25, "n": 2}, "group=32px-4cls": {"acc": 0.5, "n": 1}}
    scores = GlobalScores(groups=groups)
    row = metrics_row(1, RoundOutcome(), scores, 1 / 3, Counters(), detection=True)
    assert row["local_map"] == pytest.approx(1 / 3) and row["global_map"] is None
    assert row["local_acc"] is None and row["global_acc"] is None
    assert row["groups"] == {
        "group=16px-2cls": {"map": 0.25, "n": 2},
        "group=32px-4cls": {"map": 0.5, "n": 1},
    }
    plain = metrics_row(1, RoundOutcome(), GlobalScores(groups=groups), 0.5, Counters())
    assert plain["local_acc"] == 0.5 and plain["local_map"] is None


def test_a_recipe_scored_otherwise_keeps_its_scoring():
    recipe = ALGORITHMS.get("fedavg").build(
        ScalableFamily({"family": "stage-cnn", "input_shape": (3, 16, 16), "num_classes": 2}),
        {},
        clients_per_round=1,
        train=LocalTraining(),
    )[1]
    assert scored_with(recipe, "11-point") is recipe and recipe.scoring is None


# -- the config path ------------------------------------------------------------------------
#: The golden scenario's short ScalableFL detection run: two 16 px, 2-class clients and
#: one 32 px, 3-class one.
DETECTION = BY_NAME["scalablefl-detection"].config


def _with(dotted: Mapping[str, Any]) -> dict[str, Any]:
    raw = copy.deepcopy(DETECTION)
    for key, value in dotted.items():
        set_dotted(raw, key, value)
    return raw


def test_a_detection_config_builds_its_groups_of_clients(tmp_path):
    """`data.dataset: synthetic-detection` with `data.groups` gives each group's clients
    images at its side, objects of its first K classes only, from IID shares of
    `samples` x clients training and `test_per_client` x clients test scenes."""
    parts = build_parts(validate(DETECTION), show_progress=False)
    clients = sorted(parts.clients, key=lambda c: c.cid)
    assert [tuple(c.x_train.shape[1:]) for c in clients] == [(3, 16, 16)] * 2 + [(3, 32, 32)]
    assert [c.num_classes for c in clients] == [2, 2, 3]
    for c in clients:
        labels = c.y_train[..., 0]
        assert int(labels.max()) == c.num_classes - 1 and bool((labels >= -1).all())
        # scenes without an object of the group's classes are left out
        assert c.y_train.shape[0] <= 24 and c.y_test.shape[0] <= 12
    scoring = parts.programs.recipe.scoring
    assert isinstance(scoring, DetectionScoring) and scoring.interpolation == "all-point"
    voc2007 = build_parts(
        validate(_with({"eval.map_interpolation": "11-point"})), show_progress=False
    )
    assert voc2007.programs.recipe.scoring.interpolation == "11-point"


@pytest.mark.parametrize(
    ("dotted", "message"),
    [
        ({"data.dataset": "digits", "data.groups": None}, "is an object detector"),
        ({"model.name": "stage-cnn"}, "is not a detector"),
        ({"algorithm": "fedavg", "options": {}}, "does not train a detector"),
        ({"data.groups": [{"clients": 2, "size": 16}]}, "image side and class count"),
        ({"data.validation": 0.2}, "leave validation out"),
        ({"data.partition": {"kind": "dirichlet", "alpha": 0.5}}, "leave partition out"),
        ({"eval.local_trained": True}, "local test splits only"),
        ({"data.groups": [{"clients": 3, "size": 16, "classes": 2}]}, "draws its scenes"),
        ({"eval.map_interpolation": "10-point"}, "map_interpolation"),
    ],
)
def test_bad_detection_settings_are_refused(dotted, message):
    with pytest.raises(ConfigError, match=message):
        validate(_with(dotted))


# -- a short run ----------------------------------------------------------------------------
def _rows(path: Path, name: str) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k != "wall_time_s"} for r in read_metrics(path / name)]


def test_a_short_detection_run_learns_and_resumes_as_it_ran(tmp_path):
    """Three rounds of ScalableFL on the synthetic shapes: local mAP rises above its
    round-1 value in every group (0.05 to 0.12 here); stopped after round 2 and resumed,
    the run ends with the same state, rows and trace."""
    longer = {"train.rounds": 3, "train.local_steps": 8, "train.momentum": 0.9}
    whole = build_simulation(validate(_with(longer)), tmp_path / "whole", show_progress=False)
    whole.run()
    rows = _rows(tmp_path / "whole", "metrics.jsonl")
    assert [r["round"] for r in rows] == [1, 2, 3]
    first, last = rows[0], rows[-1]
    assert last["local_map"] > first["local_map"] and last["local_acc"] is None
    assert set(last["groups"]) == {"group=16px-2cls", "group=32px-3cls"}
    for group, entry in last["groups"].items():
        assert entry["map"] > first["groups"][group]["map"], group
    shown = comparison_rows(find_runs([tmp_path / "whole"]))[0]  # `hetfl compare`'s row
    assert "local_map client sd group=32px-3cls" in shown and "local_acc client sd" not in shown
    assert shown["final local_map"].startswith(f"{last['local_map']:.4f}")
    assert shown["final group=32px-3cls"].startswith(
        f"{last['groups']['group=32px-3cls']['map']:.4f}"
    )
    part = _with({**longer, "train.rounds": 2})
    build_simulation(validate(part), tmp_path / "part", show_progress=False).run()
    resumed = build_simulation(validate(_with(longer)), tmp_path / "part", show_progress=False)
    resumed.run(resume=True)
    for k, v in whole.state.items():
        assert torch.equal(v, resumed.state[k]), k
    for name in ("metrics.jsonl", "clients.jsonl"):
        assert _rows(tmp_path / "whole", name) == _rows(tmp_path / "part", name)


def test_a_paired_comparison_reads_local_map_and_each_groups_map(tmp_path):
    """ScalableFL - individual over seeds 0-2 on local_map: d = 0.02, 0.04, 0.03, mean 3
    points; on the 16 px group's map (ScalableFL's 0.1 higher still): d = 0.12, 0.14, 0.13,
    mean 13 points."""
    for method, maps in (("scalablefl", (0.30, 0.32, 0.31)), ("individual", (0.28, 0.28, 0.28))):
        for seed, value in enumerate(maps):
            row = dict.fromkeys(ROW_KEYS)
            group = value + (0.1 if method == "scalablefl" else 0.0)
            row.update(round=1, local_map=value, groups={"group=16px-2cls": {"map": group}})
            path = tmp_path / f"{method}-s{seed}"
            path.mkdir()
            (path / "metrics.jsonl").write_text(json.dumps(row) + "\n")
            (path / "summary.json").write_text(json.dumps({"seed": seed, "final": row}))
    found = {
        d.metric: d for d in paired_differences(find_runs([tmp_path]), "scalablefl", "individual")
    }
    assert set(found) == {"local_map", "group=16px-2cls"}
    assert found["local_map"].mean == pytest.approx(0.03) and found["local_map"].n == 3
    assert found["group=16px-2cls"].mean == pytest.approx(0.13)
