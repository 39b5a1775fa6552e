"""Evaluation on the simulated clock (`eval.every_sim_s`): a step is scored when its clock
passed a multiple of the grid, and then exactly as a run scored every step scores it, for
synchronous rounds and for FedAsync's one-update steps; the steps between are not scored
and change nothing else; a resumed run scores the steps an uninterrupted one does; the
settings that cannot go with it are refused by name."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from golden.harness import BY_NAME
from hetfl.config import ConfigError, validate
from hetfl.engine.outputs import read_metrics
from hetfl.runner import build_simulation

#: HeteroFL at levels 1, 1/2, 1/4 on digits, 6 clients on the trace fixture's devices.
TRACED = BY_NAME["heterofl-fedbuff"].config


def _config(mode: str | None, rounds: int, **eval_: Any) -> dict[str, Any]:
    raw = copy.deepcopy(TRACED)
    raw["train"]["rounds"] = rounds
    raw["checkpoint_every"] = 2
    raw["eval"] = {"local_eval": "none", **eval_}
    if mode is None:
        del raw["system"]["asynchronous"]
    else:
        raw["system"]["asynchronous"]["mode"] = mode
    return raw


def _run(raw: dict[str, Any], run_dir: Path, resume: bool = False) -> Any:
    sim = build_simulation(validate(raw), run_dir, show_progress=False)
    sim.run(resume=resume)
    return sim


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    return [
        {k: v for k, v in r.items() if k != "wall_time_s"}
        for r in read_metrics(run_dir / "metrics.jsonl")
    ]


def _grid_steps(times: list[float], grid: float) -> list[int]:
    """The steps a grid run scores, by hand from every step's end time: those whose clock
    passed a multiple of `grid` (from 0 before step 1), and the last."""
    starts = [0.0, *times[:-1]]
    return [
        i + 1
        for i, (a, b) in enumerate(zip(starts, times, strict=True))
        if math.floor(b / grid) > math.floor(a / grid) or i + 1 == len(times)
    ]


@pytest.mark.parametrize(("mode", "rounds"), [(None, 6), ("fedasync", 10)])
def test_the_grid_scores_the_steps_that_pass_a_multiple_as_every_step_scoring_does(
    mode, rounds, tmp_path
):
    every = _run(_config(mode, rounds), tmp_path / "every")
    all_rows = _rows(tmp_path / "every")
    times = [r["sim_time_s"] for r in all_rows]
    grid = 2 * times[-1] / rounds  # about every other step
    gridded = _run(_config(mode, rounds, every_sim_s=grid), tmp_path / "grid")
    steps = _grid_steps(times, grid)
    assert 1 < len(steps) < rounds  # some steps scored, some not
    assert _rows(tmp_path / "grid") == [all_rows[s - 1] for s in steps]
    for k, v in every.state.items():  # scoring fewer steps changed no training
        assert torch.equal(v, gridded.state[k]), k


def test_a_resumed_grid_run_scores_the_steps_an_uninterrupted_one_does(tmp_path):
    whole = _config("fedasync", 8)
    times = [r["sim_time_s"] for r in _rows(_run(whole, tmp_path / "every").run_dir)]
    grid = 3 * times[-1] / 8
    raw = _config("fedasync", 8, every_sim_s=grid)
    _run(raw, tmp_path / "whole")
    interrupted = build_simulation(validate(raw), tmp_path / "part", show_progress=False)
    checkpoint = interrupted._checkpoint

    def stop_after_round_4(rnd: int) -> None:
        checkpoint(rnd)
        if rnd == 4:
            raise KeyboardInterrupt

    interrupted._checkpoint = stop_after_round_4  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        interrupted.run()
    _run(raw, tmp_path / "part", resume=True)
    assert _rows(tmp_path / "part") == _rows(tmp_path / "whole")
    assert [r["round"] for r in _rows(tmp_path / "whole")] == _grid_steps(times, grid)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"system": None}, r"evaluates on the simulated clock, and this run has none"),
        ({"eval.every": 2}, r"every = 2 sets it in rounds: keep one"),
        ({"eval.local_trained": True}, r"set local_trained to false"),
        (
            {"train.lr_plateau": {"monitor": "global_acc"}},
            r"lr_plateau .*needs an evaluation every round.*eval.every_sim_s = 5",
        ),
        ({"eval.every_sim_s": 0}, r"every_sim_s"),
    ],
)
def test_settings_that_cannot_go_with_the_grid_are_refused(change, message):
    raw = _config(None, 2, every_sim_s=5.0)
    for key, value in change.items():
        *parents, last = key.split(".")
        node = raw
        for p in parents:
            node = node[p]
        if value is None:
            del node[last]
        else:
            node[last] = value
    with pytest.raises(ConfigError, match=message):
        validate(raw)
