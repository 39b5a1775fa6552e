"""A defence's decisions in the run outputs (`hetfl.engine.decisions`): a tiny 4-client Krum
run worked out by hand (who is kept and dropped, the row's counts, the trace, the summary's
totals across a resume, the median fallback's row), which of a round's reductions decides
and how a split client's two parts combine, and that the median and trimmed mean report no
decisions."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import pytest
import torch

from golden.harness import configured
from hetfl.attacks.malicious import draw_malicious
from hetfl.config import validate
from hetfl.core.client.program import Program
from hetfl.core.server.defences import ClippingReducer, DecisionRecorder, KrumReducer
from hetfl.core.server.reducers import REDUCERS
from hetfl.core.spec import MapEntry, prefix_index
from hetfl.core.types import ClientOutput
from hetfl.engine.outputs import read_metrics
from hetfl.runner import build_simulation
from hetfl.sim import Simulation

#: Each client's upload in round order: its payload plus this offset on every element.
HONEST_OFFSETS = (1.0, 1.1, 1.2)
ATTACKER_OFFSET = 9.0


@dataclass
class Offset:
    """A program whose upload is the model it received plus `offset` everywhere (its
    training still runs, for its samples and loss: NaN inputs still fail it)."""

    honest: Program
    offset: float

    def __post_init__(self) -> None:
        self.cid, self.device = self.honest.cid, self.honest.device

    def fit(self, task, data, private, generator, *, info, channel=None) -> ClientOutput:
        out = self.honest.fit(task, data, private, generator, info=info, channel=channel)
        shifted = {k: task.payload[k] + self.offset for k in out.result.tensors}
        return replace(out, result=replace(out.result, tensors=shifted))

    def evaluate(self, task, data, private, models):
        return self.honest.evaluate(task, data, private, models)

    def trace_fields(self):
        return self.honest.trace_fields()


@dataclass(frozen=True)
class Offsets:
    """The wrapper putting each client's `Offset` around its (flagged) program."""

    by_cid: dict[int, float]

    def __call__(self, program: Program) -> Program:
        return Offset(program, self.by_cid[program.cid])


def _krum_run(run_dir: Path, rounds: int, offsets: dict[int, float]) -> Simulation:
    raw = configured(
        "fedavg",
        {
            "data.num_clients": 4,
            "data.partition": {"kind": "iid"},
            "model.name": "linear",
            "train.rounds": rounds,
            "train.clients_per_round": 4,
            "attack": {"kind": "scaled-poison", "fraction": 0.25, "lambda": 1},
            "options.fedavg.reducer": {"kind": "krum", "f": 0},
        },
    )
    sim = build_simulation(validate(raw), run_dir, show_progress=False)
    sim.programs.wrappers = (*sim.programs.wrappers, Offsets(offsets))
    return sim


def test_a_krum_run_by_hand_its_rows_trace_and_totals_across_a_resume(tmp_path: Path) -> None:
    """4 clients, one malicious (M), Krum with f = 0: each score sums the distances to the
    n - 2 = 2 nearest others. Uploads are the payload + 1.0, 1.1, 1.2 (honest, in id order)
    and + 9 (M), so the mean squared distances are 0.01 (1.0-1.1, 1.1-1.2), 0.04 (1.0-1.2)
    and 64, 62.41, 60.84 to M: scores 0.05, 0.02, 0.05 and 123.25. Round 1 keeps the 1.1
    client alone (the new model is the old one + 1.1) and drops three, M among them.
    Resumed for round 2 with the other two honest clients' inputs NaN (excluded): 2 results,
    not more than 2f + 2 = 2, so the round falls back to the median and keeps both."""
    (attacker,) = draw_malicious(range(4), 0.25, seed=0)
    honest = [c for c in range(4) if c != attacker]
    offsets = {**dict(zip(honest, HONEST_OFFSETS, strict=True)), attacker: ATTACKER_OFFSET}
    first = _krum_run(tmp_path, 1, offsets)
    first.setup()
    before = dict(first.state)
    first.run()
    for name, value in first.state.items():
        assert torch.equal(value, before[name] + 1.1), name
    second = _krum_run(tmp_path, 2, offsets)
    for cid in (honest[0], honest[2]):
        second.clients[cid].x_train.fill_(float("nan"))
    summary = second.run(resume=True)

    rows = read_metrics(tmp_path / "metrics.jsonl")
    common = {"kind": "krum", "clipped": 0, "malicious_clipped": 0}
    assert rows[0]["defence"] == {
        **common,
        "kept": 1,
        "dropped": 3,
        "fallback": False,
        "malicious_kept": 0,
        "malicious_dropped": 1,
    }
    assert rows[1]["failed"] == 2 and rows[1]["defence"] == {
        **common,
        "kept": 2,
        "dropped": 0,
        "fallback": True,
        "malicious_kept": 1,
        "malicious_dropped": 0,
    }
    trace = {(r["round"], r["cid"]): r["defence"] for r in read_metrics(tmp_path / "clients.jsonl")}
    assert trace == {
        (1, honest[0]): "dropped",
        (1, honest[1]): "kept",
        (1, honest[2]): "dropped",
        (1, attacker): "dropped",
        (2, honest[0]): None,  # excluded: no decision
        (2, honest[1]): "kept",
        (2, honest[2]): None,
        (2, attacker): "kept",
    }
    assert summary["defence"] == {
        "kind": "krum",
        "rounds": 2,
        "fallback_rounds": 1,
        "kept": 3,
        "clipped": 0,
        "dropped": 3,
        "malicious_kept": 1,
        "malicious_clipped": 0,
        "malicious_dropped": 1,
        "honest_dropped": 2,
    }


W = [MapEntry("v", "w", prefix_index(2))]
REF = {"w": torch.zeros(2)}


def test_the_server_updates_reduction_decides_a_round_reduced_twice() -> None:
    """FedNova reduces the weights (its BatchNorm buffers), then the normalised deltas (its
    parameters), through the same defence; the second reduction's decisions are the
    round's. Krum (f = 0, one nearest other) keeps the first of the tied close pair:
    client 7 in the first reduction, client 3 in the second."""
    recorder = DecisionRecorder(partial(KrumReducer, f=0, m=1, kind="krum"))
    for uploads in ([[0.0, 0.0], [0.1, 0.1], [5.0, 5.0]], [[5.0, 5.0], [0.0, 0.0], [0.1, 0.1]]):
        reducer = recorder(REF)
        for v in uploads:
            reducer.add({"v": torch.tensor(v)}, W)
        reducer.result(REF)
    decided = recorder.decided([7, 3, 5], [7, 3, 5])
    assert decided is not None and decided.kind == "krum" and not decided.fallback
    assert decided.by_client == {3: "kept", 5: "dropped", 7: "dropped"}
    with pytest.raises(ValueError, match="decided 3 contributions, but 2 clients"):
        recorder.decided([7, 3, 5], [7, 3])


def test_a_split_clients_two_contributions_are_one_client() -> None:
    """Split learning's first reduction holds a client's tensors and its server session's
    (`first` names each contribution's client): clipped in one part, kept in the other, the
    client is kept; clipped in both, clipped."""
    recorder = DecisionRecorder(partial(ClippingReducer, bound=1.0))
    reducer = recorder(REF)
    for v in ([3.0, 4.0], [0.1, 0.0], [3.0, 4.0], [0.0, 3.0]):  # norms 5, 0.1, 5, 3
        reducer.add({"v": torch.tensor(v)}, W)
    reducer.result(REF)
    decided = recorder.decided([1, 1, 2, 2], [1, 2])
    assert decided is not None and decided.by_client == {1: "kept", 2: "clipped"}


@pytest.mark.parametrize("kind", [{"kind": "median"}, {"kind": "trimmed-mean", "trim": 0.25}])
def test_the_median_and_trimmed_mean_decide_nothing(kind: dict) -> None:
    """They keep every client: no decisions, so a row's `defence` is null."""
    from hetfl.core.kinds import choose

    recorder = DecisionRecorder(choose(REDUCERS, kind).build())
    reducer = recorder(REF)
    for v in ([0.0, 0.0], [1.0, 1.0], [9.0, 9.0]):
        reducer.add({"v": torch.tensor(v)}, W)
    reducer.result(REF)
    assert recorder.decided([0, 1, 2], [0, 1, 2]) is None
