"""Experiment tracking: TensorBoard event files that hold every metric of metrics.jsonl,
read back with TensorBoard's own reader, and cut back with it on resume."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.util import tensor_util

from hetfl.config import ConfigError, validate
from hetfl.engine.outputs import read_metrics
from hetfl.engine.tracking import TENSORBOARD_DIR, make_sinks, scalars
from hetfl.runner import build_simulation, run_one

# HeteroFL at two widths: its rows carry per-width accuracies under `groups`.
CONFIG = {
    "name": "tb",
    "algorithm": "heterofl",
    "options": {"heterofl": {"levels": [1.0, 0.5], "assignment": "fixed"}},
    "data": {"dataset": "digits", "num_clients": 4, "test_per_client": 20},
    "model": {"name": "stage-cnn", "stages": 2, "bn": "static"},
    "train": {"rounds": 3, "clients_per_round": 2, "batch_size": 32, "local_steps": 2},
    "eval": {"stats_samples": 64},
    "executor": "sequential",
    "tracking": "tensorboard",
}
# Every number of such a row (round is the step; val_*, sim_time_s are null here).
TAGS = {
    "clients",
    "failed",
    "global_acc",
    "test_loss",
    "local_acc",
    "loss",
    "bytes_down",
    "bytes_up",
    "macs",
    "wall_time_s",
    "groups/width=1/acc",
    "groups/width=1/n",
    "groups/width=0.5/acc",
    "groups/width=0.5/n",
}


def _events(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """(step, value) of every scalar in the run's event files, by tag, as TensorBoard reads
    them; each tag must be marked for TensorBoard's scalar dashboard."""
    acc = event_accumulator.EventAccumulator(
        str(run_dir / TENSORBOARD_DIR), size_guidance={event_accumulator.TENSORS: 0}
    )
    acc.Reload()
    out = {}
    for tag in acc.Tags()[event_accumulator.TENSORS]:
        assert acc.SummaryMetadata(tag).plugin_data.plugin_name == "scalars", tag
        out[tag] = [
            (e.step, tensor_util.make_ndarray(e.tensor_proto).item()) for e in acc.Tensors(tag)
        ]
    return out


def _expected(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """The same, straight from metrics.jsonl's rows."""
    out: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for key, value in row.items():
            if key == "groups":
                for group, stats in value.items():
                    for stat, v in stats.items():
                        out.setdefault(f"groups/{group}/{stat}", []).append((row["round"], v))
            elif key != "round" and value is not None:
                out.setdefault(key, []).append((row["round"], value))
    return out


def test_events_hold_every_metric_of_every_row(tmp_path):
    run_dir = tmp_path / "run"
    run_one(validate(CONFIG), run_dir, show_progress=False)
    events = _events(run_dir)
    assert set(events) == TAGS
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert events == _expected(rows)  # exact: written in double precision
    assert all(steps == [1, 2, 3] for steps in ([s for s, _ in e] for e in events.values()))


def test_resumed_events_equal_an_uninterrupted_run(tmp_path):
    """Killed after round 3's row was written but before its checkpoint, then resumed from
    round 2's: round 3's stale events are gone, not duplicated."""
    cfg = validate(CONFIG)
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    run_one(cfg, whole, show_progress=False)

    sim = build_simulation(cfg, cut, show_progress=False)
    shown = sim.progress.round

    def killed_after_row_3(rnd, row):
        shown(rnd, row)
        if rnd == 3:
            raise KeyboardInterrupt

    sim.progress.round = killed_after_row_3
    with pytest.raises(KeyboardInterrupt):
        sim.run()
    assert [s for s, _ in _events(cut)["loss"]] == [1, 2, 3]  # round 3 is in the events
    run_one(cfg, cut, resume=True, show_progress=False)

    events, reference = _events(cut), _events(whole)
    assert events == _expected(read_metrics(cut / "metrics.jsonl"))
    assert [s for s, _ in events["wall_time_s"]] == [1, 2, 3]
    del events["wall_time_s"], reference["wall_time_s"]  # measured, so never equal
    assert events == reference


def test_scalars_flatten_nested_keys_and_skip_nulls_and_text():
    row = {
        "round": 4,
        "loss": 0.5,
        "val_acc": None,
        "groups": {"width=0.5": {"acc": 0.25, "n": 3}},
        "defence": {"kind": "krum", "kept": 1, "fallback": True, "malicious_kept": None},
    }
    assert list(scalars(row)) == [
        ("loss", 0.5),
        ("groups/width=0.5/acc", 0.25),
        ("groups/width=0.5/n", 3.0),
        ("defence/kept", 1.0),
        ("defence/fallback", 1.0),
    ]


def test_tensorboard_without_the_package_names_the_pip_command(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    with pytest.raises(ValueError, match=r"pip install 'hetfl\[tensorboard\]'"):
        make_sinks("tensorboard", tmp_path)
    assert make_sinks("none", tmp_path) == []


def test_an_unknown_tracker_lists_the_allowed_ones():
    with pytest.raises(
        ConfigError, match=r"tracking: Input should be 'none' or 'tensorboard' \(got 'wandb'\)"
    ):
        validate({"tracking": "wandb"})
