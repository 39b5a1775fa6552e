"""Elements beyond a coverage-aware rule's breakdown point in the run outputs
(`hetfl.engine.breakdown`): a round's count is its reductions' largest share, the naive
rules count nothing, and a tiny run's `summary.json` holds the run's largest and mean
share, worked out by hand, across a resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from golden.harness import configured
from hetfl.config import validate
from hetfl.core.kinds import choose
from hetfl.core.server.defences import DecisionRecorder
from hetfl.core.server.reducers import REDUCERS
from hetfl.core.server.robust import Beyond
from hetfl.core.spec import MapEntry, prefix_index
from hetfl.runner import build_simulation

REF = {"w": torch.zeros(4)}


def _reduce(recorder: DecisionRecorder, widths: list[int]) -> None:
    reducer = recorder(REF)
    for width in widths:
        reducer.add({"v": torch.ones(width)}, [MapEntry("v", "w", prefix_index(width))])
    reducer.result(REF)


def test_a_rounds_count_is_its_reductions_largest_share() -> None:
    """Fraction 0.2: A = ceil(0.2 n). First reduction, n = 5 clients of widths 4 4 4 4 2:
    A = 1, k = 5 5 4 4 > 2, nothing beyond (0 of 4). Second, n = 3 of widths 4 2 2: A = 1,
    k = 3 3 1 1: elements 2 and 3 beyond (2 of 4, share 0.5): the round's count."""
    recorder = DecisionRecorder(
        choose(REDUCERS, {"kind": "coverage-median", "fraction": 0.2}).build()
    )
    _reduce(recorder, [4, 4, 4, 4, 2])
    assert recorder.beyond() == Beyond(0, 4, 1, ())
    with pytest.warns(UserWarning, match=r"2 of the model's 4 reduced elements \(50 %, in w\)"):
        _reduce(recorder, [4, 2, 2])
    assert recorder.beyond() == Beyond(2, 4, 1, ("w",))


@pytest.mark.parametrize("kind", [{"kind": "median"}, {"kind": "krum", "f": 0}, {"kind": "mean"}])
def test_the_naive_rules_count_nothing(kind: dict) -> None:
    recorder = DecisionRecorder(choose(REDUCERS, kind).build())
    _reduce(recorder, [4, 4, 2, 2])
    assert recorder.beyond() is None


def _run(run_dir: Path, rounds: int, reducer: dict):
    raw = configured(
        "fedavg",
        {
            "data.num_clients": 4,
            "data.partition": {"kind": "iid"},
            "model.name": "linear",
            "train.rounds": rounds,
            "train.clients_per_round": 4,
            "attack": {"kind": "scaled-poison", "fraction": 0.25, "lambda": 1},
            "options.fedavg.reducer": reducer,
        },
    )
    return build_simulation(validate(raw), run_dir, show_progress=False)


def test_a_runs_summary_holds_its_largest_and_mean_share_across_a_resume(tmp_path: Path) -> None:
    """FedAvg, every client covers every element (N of them), coverage-median with fraction
    0.25. Round 1: 4 results, A = ceil(1) = 1, k = 4 > 2: none beyond. Resumed for round 2
    with two clients' inputs NaN (excluded): 2 results, A = ceil(0.5) = 1, k = 2 <= 2: every
    element beyond. Largest share 1 (round 2: N of N, 1 attacker), mean (0 + 1) / 2 = 0.5,
    1 of 2 rounds beyond, every tensor named. The mean rule's run records null."""
    reducer = {"kind": "coverage-median", "fraction": 0.25}
    first = _run(tmp_path, 1, reducer)
    first.run()
    second = _run(tmp_path, 2, reducer)
    for cid in (0, 1):
        second.clients[cid].x_train.fill_(float("nan"))
    with pytest.warns(UserWarning, match="reduced elements"):
        summary = second.run(resume=True)
    n = sum(t.numel() for t in second.state.values())
    assert summary["breakdown"] == {
        "rounds": 2,
        "rounds_beyond": 1,
        "max_share": 1.0,
        "mean_share": 0.5,
        "elements": n,
        "covered": n,
        "attackers": 1,
        "tensors": sorted(second.state),
    }
    assert _run(tmp_path / "mean", 1, {"kind": "mean"}).run()["breakdown"] is None
