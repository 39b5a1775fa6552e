"""Asynchronous aggregation (`system.asynchronous`, `hetfl.sim.asynchronous`): FedAsync's
mixing and FedBuff's buffered step against a direct per-element computation, the staleness
functions by hand, the clock's events (staleness, lost clients), resume bit for bit, the
refusals. Sequential against worker processes is the golden scenario `heterofl-fedbuff`
under `tests/test_executor_processes.py`."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from golden.harness import BY_NAME
from hetfl.config import ConfigError, validate
from hetfl.core.types import ClientResult, ClientTask, Trained, TrainedRound
from hetfl.engine.outputs import read_metrics
from hetfl.runner import build_simulation
from hetfl.sim.asynchronous import AsyncSimulation
from hetfl.systems.asynchrony import AsyncSettings

#: The golden FedBuff scenario: HeteroFL at levels 1, 1/2, 1/4 on digits, 6 clients.
FEDBUFF = BY_NAME["heterofl-fedbuff"].config


def _config(**asynchronous: Any) -> dict[str, Any]:
    raw = copy.deepcopy(FEDBUFF)
    raw["system"]["asynchronous"].update(asynchronous)
    return raw


def _sim(raw: dict[str, Any], run_dir: Path) -> AsyncSimulation:
    sim = build_simulation(validate(raw), run_dir, show_progress=False)
    assert isinstance(sim, AsyncSimulation)
    return sim


# -- the staleness functions ----------------------------------------------------------------
def test_staleness_weights_by_hand():
    poly = AsyncSettings("fedasync", 4, mixing=0.5, staleness="polynomial", staleness_exponent=0.5)
    assert poly.weight(0) == 0.5
    assert poly.weight(3) == pytest.approx(0.5 * 4**-0.5)  # a (t - tau + 1)^-a
    hinge = AsyncSettings(
        "fedasync", 4, mixing=0.8, staleness="hinge", staleness_exponent=2.0, staleness_hinge=1
    )
    assert [hinge.weight(d) for d in (0, 1)] == [0.8, 0.8]  # free up to b
    assert hinge.weight(4) == pytest.approx(0.8 / (2.0 * 3 + 1))  # 1 / (a (d - b) + 1)
    assert AsyncSettings("fedasync", 4, mixing=0.3, staleness="constant").weight(9) == 0.3
    buff = AsyncSettings("fedbuff", 4, buffer_size=2)
    assert [buff.weight(d) for d in (0, 3)] == [1.0, 0.5]  # 1 / sqrt(1 + staleness)
    assert [buff.steps_after(k) for k in (1, 2)] == [False, True]
    assert AsyncSettings("fedasync", 4).steps_after(1)


# -- the server steps against a direct computation ------------------------------------------
def _uploads(sim: AsyncSimulation, cids: list[int]) -> tuple[list[ClientTask], TrainedRound]:
    """Tasks of `cids` on the current state and results that move every tensor by seeded
    noise (integer tensors unchanged)."""
    infos = [i for i in sim.known_clients() if i.cid in cids]
    tasks = sim.strategy.plan(1, sim.state, infos, torch.Generator().manual_seed(1))
    assert sorted(t.cid for t in tasks) == cids
    g = torch.Generator().manual_seed(7)
    trained = []
    for task in sorted(tasks, key=lambda t: t.cid):
        tensors = {
            n: v + torch.randn(v.shape, generator=g) if v.is_floating_point() else v.clone()
            for n, v in task.payload.items()
        }
        trained.append(Trained(task, ClientResult(task.cid, tensors, 10, 1, 0.0)))
    return tasks, TrainedRound(tuple(trained))


def _direct(state, trained: TrainedRound, uploads, rate: float):
    """x + rate (mean over covering clients of u_i - x), element by element, from each
    task's index map (prefix slices, label-split masks) and uniform weights: HeteroFL's
    per-element count, written out."""
    sums = {n: torch.zeros_like(v, dtype=torch.float64) for n, v in state.items()}
    counts = {n: torch.zeros_like(v, dtype=torch.float64) for n, v in state.items()}
    for item, u in zip(trained.trained, uploads, strict=True):
        for e in item.task.index_map:
            local = u[e.local].double()
            mask = torch.ones_like(local) if e.mask is None else e.mask.double()
            sums[e.global_name][e.index] += local * mask
            counts[e.global_name][e.index] += mask
    out = {}
    for n, x in state.items():
        if not x.is_floating_point():
            continue
        covered = counts[n] > 0
        mean = torch.where(covered, sums[n] / counts[n].clamp(min=1), x.double())
        out[n] = x.double() + rate * (mean - x.double())
    return out


def test_fedasync_mixes_one_stale_update_on_the_elements_it_covers(tmp_path):
    sim = _sim(_config(mode="fedasync", mixing=0.6, staleness="polynomial"), tmp_path)
    sim.setup()
    before = {n: v.clone() for n, v in sim.state.items()}
    _, trained = _uploads(sim, [4])  # client 4: a sub-model, not the full width
    sim._staleness = {4: 3}
    new = sim.combine(5, trained).state
    a_t = 0.6 * (3 + 1) ** -0.5
    expected = _direct(before, trained, [trained.trained[0].result.tensors], a_t)
    moved = 0
    for n, want in expected.items():
        torch.testing.assert_close(new[n].double(), want, rtol=0, atol=1e-6)
        moved += int((new[n] != before[n]).sum())
    untouched = sum(int((new[n] == before[n]).sum()) for n in expected)
    assert moved > 0 and untouched > 0  # a sub-model: some elements stay as they were


def test_fedbuff_steps_along_the_mean_of_staleness_weighted_deltas(tmp_path):
    sim = _sim(_config(server_lr=0.7), tmp_path)
    sim.setup()
    cids = [0, 2, 5]  # three levels (fixed assignment by id)
    _, trained = _uploads(sim, cids)
    sim._staleness = {0: 0, 2: 1, 5: 3}
    # the model moved since the clients downloaded: deltas are from what each was sent
    sim.state = {n: v + 0.25 if v.is_floating_point() else v.clone() for n, v in sim.state.items()}
    before = {n: v.clone() for n, v in sim.state.items()}
    new = sim.combine(4, trained).state
    weights = {0: 1.0, 2: 1 / math.sqrt(2), 5: 0.5}
    uploads = []
    for item in trained.trained:  # x_local + w (y - sent), written out
        imap = {e.local: e for e in item.task.index_map}
        uploads.append(
            {
                local: before[imap[local].global_name][imap[local].index]
                + weights[item.task.cid] * (y - item.task.payload[local])
                for local, y in item.result.tensors.items()
            }
        )
    expected = _direct(before, trained, uploads, 0.7)
    for n, want in expected.items():
        torch.testing.assert_close(new[n].double(), want, rtol=0, atol=1e-6)


# -- runs on the clock ------------------------------------------------------------------------
def _short(raw: dict[str, Any], rounds: int, checkpoint_every: int = 1) -> dict[str, Any]:
    raw = copy.deepcopy(raw)
    raw["train"]["rounds"] = rounds
    raw["checkpoint_every"] = checkpoint_every
    return raw


def test_steps_hear_of_updates_in_simulated_time_with_their_staleness(tmp_path):
    sim = _sim(_short(_config(mode="fedasync"), 4), tmp_path)
    sim.run()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    times = [r["sim_time_s"] for r in rows]
    assert all(t > 0 for t in times) and times == sorted(times)
    assert [r["clients"] for r in rows] == [1, 1, 1, 1]  # FedAsync: one update a step
    trace = [r for r in read_metrics(tmp_path / "clients.jsonl") if r["sampled"]]
    assert all(r["fields"]["staleness"] >= 0 for r in trace)
    assert any(r["fields"]["staleness"] > 0 for r in trace)  # 4 in flight: some are stale
    # the step's time is the moment its update arrived: its start plus its own total_s
    kept = [r for r in trace if r["failure"] is None]
    assert len(kept) == 4
    assert max(r["sim"]["total_s"] for r in kept) <= times[-1]


def test_a_client_whose_device_leaves_before_finishing_is_lost_and_counted(tmp_path):
    # every device reachable for the first 0.005 s of each 1,000 s: clients, which take
    # about 0.01 s, are lost until the fastest slot fits; the clock waits for reachability
    behaviour = {
        str(d): {"active": [0.0], "inactive": [0.005], "finish_time": 1000.0} for d in range(6)
    }
    behaviour["0"] = {"active": [0.0], "inactive": [900.0], "finish_time": 1000.0}
    capacity = {str(d): {"computation": 60.0, "communication": 5000.0} for d in range(6)}
    (tmp_path / "b.json").write_text(json.dumps(behaviour))
    (tmp_path / "c.json").write_text(json.dumps(capacity))
    raw = _short(_config(buffer_size=2), 2)
    raw["system"]["trace"] = {
        "capacity": str(tmp_path / "c.json"),
        "behaviour": str(tmp_path / "b.json"),
    }
    sim = _sim(raw, tmp_path / "run")
    summary = sim.run()
    trace = [r for r in read_metrics(tmp_path / "run" / "clients.jsonl") if r["sampled"]]
    lost = [r for r in trace if r["failure"] == "lost"]
    assert lost and summary["failures"]["lost"] == len(lost)
    assert all(r["samples"] is None for r in lost)  # nothing of theirs aggregated
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert sum(r["failed"] for r in rows) == len(lost)
    assert rows[-1]["sim_time_s"] >= 1000.0  # the server waited for devices to come back


def test_resume_equals_an_uninterrupted_run(tmp_path):
    raw = _config()
    whole = _sim(_short(raw, 4, 2), tmp_path / "whole")
    whole.run()
    _sim(_short(raw, 2, 2), tmp_path / "part").run()
    resumed = _sim(_short(raw, 4, 2), tmp_path / "part")
    resumed.run(resume=True)
    for k, v in whole.state.items():
        assert torch.equal(v, resumed.state[k]), k
    assert resumed.dispatches == whole.dispatches
    assert [e.order for e in resumed.in_flight] == [e.order for e in whole.in_flight]

    def rows(path: Path, name: str) -> list[dict[str, Any]]:
        return [
            {k: v for k, v in r.items() if k != "wall_time_s"} for r in read_metrics(path / name)
        ]

    for name in ("metrics.jsonl", "clients.jsonl"):
        assert rows(tmp_path / "whole", name) == rows(tmp_path / "part", name)


@pytest.mark.parametrize("name", ["fjord-distill", "nefl"])
def test_fjord_and_nefl_step_under_fedbuff(name, tmp_path):
    raw = copy.deepcopy(BY_NAME[name].config)  # their golden scenarios, on one profile
    raw["system"] = {
        "profiles": [{"name": "p", "rate": 1.0e9, "down_mbps": 10.0, "up_mbps": 10.0}],
        "asynchronous": {"mode": "fedbuff", "concurrency": 3, "buffer_size": 2},
    }
    raw["train"]["rounds"] = 2
    sim = _sim(raw, tmp_path)
    sim.setup()
    start = {n: v.clone() for n, v in sim.state.items()}
    sim.run()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["clients"] for r in rows] == [2, 2]
    assert 0 < rows[0]["sim_time_s"] < rows[1]["sim_time_s"]
    assert any(not torch.equal(v, start[n]) for n, v in sim.state.items())


# -- refusals -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"algorithm": "fedavg"}, "not defined for algorithm 'fedavg'"),
        ({"algorithm": "fedfa"}, "how staleness should compose"),
        ({"system.asynchronous.buffer_size": 5}, "must be at most concurrency (4)"),
        ({"system.asynchronous.concurrency": 7}, "is more than data.num_clients = 6"),
        ({"system.overcommit": 1.3}, "no rounds to over-commit"),
        ({"system.asynchronous.mode": "async"}, "mode"),
        ({"system.asynchronous.mixing": 1.5}, "mixing"),
    ],
)
def test_bad_asynchronous_configs_fail_clearly(change, message):
    raw = copy.deepcopy(FEDBUFF)
    for key, value in change.items():
        *path, last = key.split(".")
        node = raw
        for p in path:
            node = node[p]
        node[last] = value
    with pytest.raises(
        (ConfigError, ValueError), match=message.replace("(", r"\(").replace(")", r"\)")
    ):
        validate(raw)
