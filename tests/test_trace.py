"""The per-client trace `clients.jsonl` (`hetfl.engine.trace`) against runs worked out by
hand: who was asked, what each client was charged, its result, its failure and its local
score, and that the rows add up to `metrics.jsonl`. Equality under the process executor,
after a resume and under Flower is checked beside the runs that already compare those
(test_executor_processes.py, test_system.py, test_deploy_server.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from golden.harness import WIDTHS, configured
from hetfl.config import validate
from hetfl.core.client.program import Programs
from hetfl.core.rng import SERVER, torch_generator
from hetfl.core.server.assign import uniform_sample
from hetfl.core.training import LocalTraining
from hetfl.engine.outputs import read_metrics
from hetfl.engine.round_settings import RoundSettings
from hetfl.engine.trace import TRACE_KEYS, spec_object
from hetfl.runner import build_simulation
from hetfl.sim import Simulation
from strategies import fedavg

#: The digits MLP (64 -> 200 -> 200 -> 10): bytes of its tensors, MACs per training sample
#: (forward and backward, no input gradient for the first layer).
MLP_BYTES = 4 * (64 * 200 + 200 + 200 * 200 + 200 + 200 * 10 + 10)
MLP_TRAIN_MACS = 3 * (64 * 200 + 200 * 200 + 200 * 10) - 64 * 200


def _trace(run_dir: Path) -> list[dict]:
    return read_metrics(run_dir / "clients.jsonl")


def _asked(sim: Simulation, rnd: int, k: int) -> list[int]:
    """Whom the uniform sampler asks in round `rnd`: `k` of every client, drawn from the
    round's (seed, round, server, "sample") generator, every client being available."""
    rng = torch_generator(sim.settings.seed, rnd, SERVER, "sample")
    return [info.cid for info in uniform_sample(sim.known_clients(), k, rng)]


def _adds_up(rows: list[dict], metrics: list[dict]) -> None:
    """Each round's charges add up to the increase of the metrics counters, and its local
    accuracies average to the round's `local_acc`."""
    before = dict.fromkeys(("bytes_down", "bytes_up", "macs"), 0)
    for row in metrics:
        mine = [r for r in rows if r["round"] == row["round"]]
        for key, last in before.items():
            assert sum(r[key] or 0 for r in mine) == row[key] - last, (row["round"], key)
            before[key] = row[key]
        scored = [r["local_acc"] for r in mine if r["local_acc"] is not None]
        assert sum(scored) / len(scored) == pytest.approx(row["local_acc"], rel=1e-12)


def test_fedavg_rows_by_hand(tmp_path: Path) -> None:
    """FedAvg asks 4 of 6 digits clients a round; one client's inputs are NaN, so when it is
    asked it costs a whole round's traffic and compute and is excluded ("non-finite")."""
    raw = configured("fedavg", {"data.partition": {"kind": "iid"}, "train.rounds": 2})
    sim = build_simulation(validate(raw), tmp_path, show_progress=False)
    asked = {rnd: _asked(sim, rnd, 4) for rnd in (1, 2)}
    bad = asked[1][1]
    sim.clients[bad].x_train.fill_(float("nan"))
    sim.run()
    rows = _trace(tmp_path)
    assert all(tuple(r) == TRACE_KEYS for r in rows)
    assert [(r["round"], r["cid"]) for r in rows] == [(t, c) for t in (1, 2) for c in asked[t]]
    mlp = spec_object(sim.strategy.global_spec)
    for r in rows:
        n = sim.clients[r["cid"]].n_train
        assert r["sampled"] and r["spec"] == mlp and r["fields"] == {} and r["sim"] is None
        # every asked client received the model, returned one and trained on all its data
        assert (r["bytes_down"], r["bytes_up"]) == (MLP_BYTES, MLP_BYTES)
        assert r["macs"] == n * MLP_TRAIN_MACS
        if r["cid"] == bad:
            assert r["failure"] == "non-finite"
            assert r["samples"] is r["steps"] is r["loss"] is r["local_acc"] is None
        else:
            assert r["failure"] is None and r["group"] is None
            assert (r["samples"], r["steps"]) == (n, math.ceil(n / 32))
            assert math.isfinite(r["loss"]) and 0 <= r["local_acc"] <= 1
    _adds_up(rows, read_metrics(tmp_path / "metrics.jsonl"))


def test_heterofl_rows_by_hand(tmp_path: Path) -> None:
    """HeteroFL with levels 1 and 0.5 asks 3 of 6 clients a round and evaluates every client
    that has trained: a client's traffic is its level's model, both ways, and a client
    asked in round 1 only is evaluated in round 2 without training."""
    raw = configured(
        "heterofl",
        {
            **WIDTHS,
            "options.heterofl": {"levels": [1.0, 0.5], "assignment": "fixed"},
            "train.rounds": 2,
            "train.clients_per_round": 3,
            "eval.local_eval": "all",
        },
    )
    sim = build_simulation(validate(raw), tmp_path, show_progress=False)
    sim.run()
    rows = _trace(tmp_path)
    asked = {rnd: _asked(sim, rnd, 3) for rnd in (1, 2)}
    assert [r["cid"] for r in rows if r["round"] == 1] == asked[1]
    assert [r["cid"] for r in rows if r["round"] == 2] == sorted({*asked[1], *asked[2]})
    assert set(asked[1]) - set(asked[2])  # someone is only evaluated in round 2
    widths = set()
    for r in rows:
        if not r["sampled"]:
            assert r["round"] == 2 and r["cid"] not in asked[2]
            assert r["spec"] is r["bytes_down"] is r["samples"] is r["failure"] is None
            assert 0 <= r["local_acc"] <= 1
            continue
        # the level's model: every tensor of it is sent down and back (static BN keeps no
        # running statistics, so its state is its parameters)
        model = sim.programs.family.build(sim.strategy.assignment.spec_of(sim.infos[r["cid"]]))
        size = 4 * sum(p.numel() for p in model.parameters())
        assert r["spec"] == spec_object(sim.strategy.assignment.spec_of(sim.infos[r["cid"]]))
        assert r["bytes_down"] == r["bytes_up"] == size
        widths.update(r["spec"]["widths"])  # one ratio for every slot of the level
        assert r["samples"] == sim.clients[r["cid"]].n_train and r["failure"] is None
    assert widths == {1.0, 0.5}
    _adds_up(rows, read_metrics(tmp_path / "metrics.jsonl"))


class _Marked:
    """A client program wrapper that declares whether its client is marked (an attack would
    say `malicious`); it changes nothing else."""

    def __init__(self, marked: set[int], name: str = "malicious") -> None:
        self.marked, self.name = marked, name

    def __call__(self, program):
        return _MarkedProgram(program, self.name, program.cid in self.marked)


class _MarkedProgram:
    def __init__(self, program, name: str, marked: bool) -> None:
        self.program, self.name, self.marked = program, name, marked
        self.cid, self.device = program.cid, program.device

    def fit(self, *args, **kwargs):
        return self.program.fit(*args, **kwargs)

    def evaluate(self, *args, **kwargs):
        return self.program.evaluate(*args, **kwargs)

    def trace_fields(self):
        return {self.name: self.marked}


def _declaring(fed, tmp_path: Path, fields, wrapper: _Marked) -> Simulation:
    family, clients, test = fed
    train = LocalTraining(lr=0.1, batch_size=32)
    strategy = fedavg(family, clients_per_round=3, train=train, trace_fields=fields)
    programs = Programs(family, seed=0, wrappers=(wrapper,))
    settings = RoundSettings(rounds=1, seed=0)
    return Simulation(strategy, programs, clients, test, settings, tmp_path)


def test_methods_and_client_programs_declare_fields(synthetic_federation, tmp_path: Path):
    def tier(info, task):
        return {"tier": info.cid % 2, "asked": task is not None}

    _declaring(synthetic_federation, tmp_path, tier, _Marked({0, 5})).run()
    rows = _trace(tmp_path)
    assert len(rows) == 3
    for r in rows:
        assert r["fields"] == {"tier": r["cid"] % 2, "asked": True, "malicious": r["cid"] in (0, 5)}


@pytest.mark.parametrize(
    ("fields", "wrapper", "match"),
    [
        (lambda info, task: {"tier": 1}, _Marked(set(), name="tier"), r"\['tier'\].*both"),
        (lambda info, task: {"widths": [1, 2]}, _Marked(set()), r"'widths' = \[1, 2\]"),
        (lambda info, task: {"loss": float("nan")}, _Marked(set()), r"'loss' = nan"),
    ],
)
def test_declared_fields_that_cannot_be_written_are_errors(
    synthetic_federation, tmp_path: Path, fields, wrapper, match
):
    with pytest.raises(ValueError, match=match):
        _declaring(synthetic_federation, tmp_path, fields, wrapper).run()


def test_a_resume_cuts_the_trace_back_to_the_checkpoint(tmp_path: Path) -> None:
    """Rows of rounds after the checkpoint (a crash between writing the trace and the
    checkpoint, and a line cut short) are dropped; the resumed run writes them again."""
    raw = configured("fedavg", {"train.rounds": 2})
    whole = build_simulation(validate(raw), tmp_path / "whole", show_progress=False)
    whole.run()
    first = configured("fedavg", {"train.rounds": 1})
    build_simulation(validate(first), tmp_path / "part", show_progress=False).run()
    trace = tmp_path / "part" / "clients.jsonl"
    stale = '{"round": 2, "cid": 0}\n{"round": 2, "ci'
    trace.write_text(trace.read_text() + stale)
    build_simulation(validate(raw), tmp_path / "part", show_progress=False).run(resume=True)
    assert _trace(tmp_path / "part") == _trace(tmp_path / "whole")
    assert sorted({r["round"] for r in _trace(tmp_path / "part")}) == [1, 2]
