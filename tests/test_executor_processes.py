"""The process executor: results equal the sequential executor's bit for bit, faults fail
only their clients, and no process outlives a run.

The tests share one pool of two workers (`pool`); each simulation hands it its own data
and programs."""

from __future__ import annotations

import copy
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch

from golden.harness import BY_NAME, assert_same_as_sequential, run_scenario
from hetfl.config import validate
from hetfl.core.client.program import Program, Programs
from hetfl.core.server.assign import one_spec
from hetfl.core.types import ClientData, ClientOutput, ClientTask
from hetfl.engine.heap import _malloc_trim
from hetfl.engine.outputs import read_metrics
from hetfl.engine.round_settings import RoundSettings
from hetfl.runner import build_simulation
from hetfl.sim import ProcessExecutor, SequentialExecutor, Simulation, make_executor
from strategies import fedavg
from test_store_spill import _rss_bytes, fragment_heap

#: Golden scenarios that must also hold under two worker processes: every kind of local
#: training, a stats pass, kept state, private layers, failures, the simulated clock,
#: split learning (a client and its server session in one worker) and a server phase
#: (FedGKT's, run in the parent on the workers' uploads).
UNDER_PROCESSES = [
    "fedavg",
    "fednova-momentum",
    "heterofl-dynamic",
    "heterofl-fedbuff",
    "fjord-distill",
    "fedalrc-deep",
    "fedavg-failing-client",
    "fedavg-deadline",
    "fedbn",
    "fedper-local-eval-all",
    "split-server-program",
    "splitfed",
    "fedgkt",
]


@pytest.fixture(scope="module")
def pool():
    with ProcessExecutor(2) as executor:
        yield executor


@pytest.mark.parametrize("name", UNDER_PROCESSES)
def test_golden_scenario_under_two_worker_processes_is_bit_for_bit(
    name, pool, tmp_path, golden_runs
):
    """Compared with the sequential executor's run of the scenario in this pytest run (on
    this machine, whatever its numerics), never with the fixture."""
    got = run_scenario(BY_NAME[name], tmp_path, pool)
    assert_same_as_sequential(golden_runs[name], got, "under two worker processes")


# -- faults ------------------------------------------------------------------------------------
class KillsItsWorker:
    """A client program wrapper: client `cid`'s training kills the process it runs in."""

    def __init__(self, cid: int) -> None:
        self.cid = cid

    def __call__(self, program: Program) -> Program:
        return _Killing(program, self.cid)


class _Killing:
    def __init__(self, program: Program, cid: int) -> None:
        self.program, self.cid = program, cid

    def fit(self, task: ClientTask, data: ClientData, *args, **kwargs) -> ClientOutput:
        if task.cid == self.cid:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.program.fit(task, data, *args, **kwargs)

    def evaluate(self, *args, **kwargs):
        return self.program.evaluate(*args, **kwargs)


def _config(**extra) -> dict:
    raw = copy.deepcopy(BY_NAME["fedavg"].config)
    raw["train"]["clients_per_round"] = 6
    raw["train"]["rounds"] = 2
    raw.update(extra)
    return raw


def test_a_worker_killed_mid_round_fails_only_its_client_and_is_replaced(pool, tmp_path):
    sim = build_simulation(validate(_config()), tmp_path, show_progress=False)
    sim.programs.wrappers = (KillsItsWorker(3),)
    sim.executor = pool
    restarts = pool.restarts
    sim.run()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["clients"] for r in rows] == [5, 5]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["failures"] == {"raised": 2}
    assert pool.restarts == restarts + 2
    assert 3 not in sim.store and all(c in sim.store for c in (0, 1, 2, 4, 5))
    # the others trained as they do when client 3 is absent in process
    ref = build_simulation(validate(_config()), tmp_path / "ref", show_progress=False)
    ref.programs.wrappers = (_Raises(3),)
    ref.run()
    for cid in (0, 1, 2, 4, 5):
        for k, v in ref.store.get(cid).items():
            assert torch.equal(v, sim.store.get(cid)[k])


class _Raises:
    def __init__(self, cid: int) -> None:
        self.cid = cid

    def __call__(self, program: Program) -> Program:
        return _RaisingAt(program, self.cid)


class _RaisingAt(_Killing):
    def fit(self, task: ClientTask, data: ClientData, *args, **kwargs) -> ClientOutput:
        if task.cid == self.cid:
            raise RuntimeError("gone")
        return self.program.fit(task, data, *args, **kwargs)


def _fails(ctx, item: int) -> int:
    if item == 2:
        raise ValueError("unit 2 is broken")
    return item * 10


def test_a_unit_that_raises_in_a_worker_stops_the_exchange_with_its_traceback(pool):
    programs = build_simulation(validate(_config()), Path("unused"), show_progress=False).programs
    with pytest.raises(RuntimeError, match=r"(?s)failed in a worker process.*unit 2 is broken"):
        pool.map(programs, _fails, [0, 1, 2, 3])
    assert pool.map(programs, _fails, [0, 1, 3]) == [0, 10, 30]  # the pool recovers


def _workers() -> set[int | None]:
    return {p.pid for p in mp.active_children() if p.name == "hetfl-worker" and p.is_alive()}


def test_the_workers_start_with_the_executor_not_at_its_first_unit():
    """Built, they start while the run loads its data: once the data is shared (which
    waits for their start), two more workers are running, before any unit was sent."""
    before = _workers()
    with ProcessExecutor(2) as executor:
        executor.share({"x": torch.zeros(3)})
        assert len(_workers() - before) == 2
    assert _workers() == before  # and `close` stopped them


def test_a_start_that_fails_says_so_when_the_executor_is_first_used(monkeypatch):
    def cannot_fork(self):
        raise OSError("Resource temporarily unavailable")

    monkeypatch.setattr(ProcessExecutor, "_spawn", cannot_fork)
    executor = ProcessExecutor(2)
    with pytest.raises(RuntimeError, match=r"2 worker process\(es\) did not start: OSError"):
        executor.share({"x": torch.zeros(3)})
    executor.close()  # nothing left to stop


def test_a_worker_that_died_while_idle_is_replaced_at_the_next_exchange(pool):
    programs = build_simulation(validate(_config()), Path("unused"), show_progress=False).programs
    assert pool.map(programs, _times_ten, [1, 2]) == [10, 20]
    victim = pool._pool[0].process
    os.kill(victim.pid, signal.SIGKILL)
    victim.join()
    restarts = pool.restarts
    assert pool.map(programs, _times_ten, [3, 4, 5]) == [30, 40, 50]
    assert pool.restarts == restarts + 1 and all(w.process.is_alive() for w in pool._pool)


def test_answers_come_in_the_items_order_whatever_the_costs(pool):
    programs = build_simulation(validate(_config()), Path("unused"), show_progress=False).programs
    items = list(range(7))
    assert pool.map(programs, _times_ten, items, costs=[1, 9, 3, 7, 5, 0, 2]) == [
        i * 10 for i in items
    ]


def _times_ten(ctx, item: int) -> int:
    return item * 10


#: What a worker keeps between units in `_fragment_heap` (module state, in the worker).
_KEPT: list[bytearray] = []


def _resident_bytes(ctx, item: int) -> int:
    return _rss_bytes()


def _fragment_heap(ctx, item: int) -> int:
    """160 MiB freed among blocks that stay (a round's activations around what outlives
    them); the worker's resident bytes after."""
    fragment_heap(_KEPT)
    return _rss_bytes()


@pytest.mark.skipif(_malloc_trim() is None, reason="the C library has no malloc_trim")
def test_a_worker_hands_its_freed_heap_back_when_the_next_exchange_starts():
    """Else the training's freed heap stays resident beside the evaluation's activations,
    in every worker at once (workload H of benchmarks/: 2.7 GiB of peak PSS, 2.4 with)."""
    programs = build_simulation(validate(_config()), Path("unused"), show_progress=False).programs
    with ProcessExecutor(1) as executor:
        (fragmented,) = executor.map(programs, _fragment_heap, [0])
        (next_exchange,) = executor.map(programs, _resident_bytes, [0])
    assert next_exchange < fragmented - (100 << 20)


def test_resume_under_another_number_of_workers_equals_an_uninterrupted_run(pool, tmp_path):
    whole = build_simulation(validate(_config()), tmp_path / "whole", show_progress=False)
    whole.executor = pool
    whole.run()
    first = validate({**_config(), "train": {**_config()["train"], "rounds": 1}})
    part = build_simulation(first, tmp_path / "part", show_progress=False)
    part.executor = pool
    part.run()
    with ProcessExecutor(1) as one:
        rest = build_simulation(validate(_config()), tmp_path / "part", show_progress=False)
        rest.executor = one
        rest.run(resume=True)
    strip = [
        {k: v for k, v in json.loads(line).items() if k != "wall_time_s"}
        for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()
    ]
    again = [
        {k: v for k, v in json.loads(line).items() if k != "wall_time_s"}
        for line in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()
    ]
    assert strip == again
    for k, v in whole.state.items():
        assert torch.equal(v, rest.state[k])
    assert _trace(tmp_path / "whole") == _trace(tmp_path / "part")


# -- split learning in the workers -------------------------------------------------------------
class RecordsPid:
    """A client-program wrapper: the client keeps the id of the process it trained in."""

    def __call__(self, program: Program) -> Program:
        return _PidClient(program)


class _PidClient(_Killing):
    def __init__(self, program: Program) -> None:
        self.program = program

    def fit(self, *args, **kwargs) -> ClientOutput:
        out = self.program.fit(*args, **kwargs)
        return replace(out, private={**out.private, "pid": torch.tensor(os.getpid())})


@dataclass(frozen=True)
class _PidSide:
    """A server side whose sessions keep the id of the process they ran in."""

    inner: Any

    def program(self, round, state, tasks):
        return _PidProgram(self.inner.program(round, state, tasks))

    def index_map(self, served):
        return self.inner.index_map(served)


@dataclass(frozen=True)
class _PidProgram:
    inner: Any
    parallel: bool = False

    def open(self, task, private):
        return _PidSession(self.inner.open(task, private))


@dataclass(frozen=True)
class _PidSession:
    inner: Any

    def batch(self, z, y):
        return self.inner.batch(z, y)

    def close(self):
        served = self.inner.close()
        return replace(served, private={**served.private, "pid": torch.tensor(os.getpid())})


def test_a_client_and_its_server_session_train_in_the_same_worker(pool, tmp_path):
    from test_server_program import CLIENT, TRAIN, _client_side, _clients, _SplitFamily, _SplitSide

    family = _SplitFamily()
    side = _PidSide(_SplitSide(family, parallel=False))
    split = fedavg(
        family, clients_per_round=3, train=TRAIN, assignment=one_spec(CLIENT), server_side=side
    )
    clients, test = _clients()
    programs = Programs(family, _client_side(), seed=0, wrappers=(RecordsPid(),))
    settings = RoundSettings(rounds=1, seed=0)
    sim = Simulation(split, programs, clients, test, settings, tmp_path, executor=pool)
    sim.run()
    workers = {w.process.pid for w in pool._pool}
    for cid in range(3):
        pid = int(sim.store.get(cid)["pid"])
        assert pid in workers and int(sim.server_store.get(cid)["pid"]) == pid


def _trace(run_dir: Path) -> list[dict]:
    return read_metrics(run_dir / "clients.jsonl")


@pytest.mark.parametrize("name", ["fedavg-deadline", "heterofl-dynamic"])
def test_the_per_client_trace_is_the_sequential_executors(name, pool, tmp_path):
    """Per-client specs, charges, simulated times, failures and local scores: the same
    rows whichever executor ran the clients."""
    run_scenario(BY_NAME[name], tmp_path / "sequential")
    run_scenario(BY_NAME[name], tmp_path / "processes", pool)
    rows = _trace(tmp_path / "sequential")
    assert rows and rows == _trace(tmp_path / "processes")


# -- choosing an executor ---------------------------------------------------------------------
def _choose(name, monkeypatch, cores=2, **kw):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    args = dict(
        workers=None,
        threads=1,
        device="cpu",
        deterministic=True,
        clients_per_round=4,
        measured_clock=False,
    )
    return make_executor(name, **{**args, **kw})


def test_auto_takes_processes_only_where_they_can_help(monkeypatch):
    chosen, why = _choose("auto", monkeypatch)
    assert isinstance(chosen, ProcessExecutor) and chosen.workers == 2
    assert why == "processes (2 workers x 1 thread(s)) (auto)"
    for kw, reason in [
        ({"cores": 1}, "one core"),
        ({"clients_per_round": 1}, "one client per round"),
        ({"device": "cuda"}, "device cuda"),
        ({"measured_clock": True}, "clock measured"),
        ({"threads": 2}, "1 worker"),
    ]:
        chosen, why = _choose("auto", monkeypatch, **kw)
        assert isinstance(chosen, SequentialExecutor), kw
        assert reason in why
    chosen, why = _choose("processes", monkeypatch, workers=3)
    assert isinstance(chosen, ProcessExecutor) and chosen.workers == 3


def test_bad_executor_settings_are_refused_with_the_field():
    with pytest.raises(ValueError, match=r"workers = 2 is for executor 'processes'"):
        validate(_config(executor="sequential", workers=2))
    with pytest.raises(
        ValueError,
        match=r"Input should be 'sequential', 'processes', 'vectorised', 'ray' or 'auto'",
    ):
        validate(_config(executor="threads"))
    measured = {
        "preset": "dtfl",
        "clock": "measured",
    }
    with pytest.raises(ValueError, match=r"executor 'processes' with system.clock 'measured'"):
        validate(_config(executor="processes", system=measured))
    with pytest.raises(ValueError, match=r"runs on the CPU, got device 'cuda'"):
        ProcessExecutor(2, device="cuda")


# -- Ctrl-C ----------------------------------------------------------------------------------------
def _session_processes(sid: int) -> list[int]:
    """Every process of session `sid` (read from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid:
                found.append(int(entry.name))
    return found


def test_ctrl_c_leaves_no_process_behind(tmp_path):
    """`hetfl run` with two workers, interrupted once its workers run: the run stops and
    every process it started (workers, the fork server) is gone."""
    raw = _config(executor="processes", workers=2, output_dir=str(tmp_path), name="ctrl-c")
    raw["train"]["rounds"] = 50
    (tmp_path / "c.json").write_text(json.dumps(raw))
    run = subprocess.Popen(
        [sys.executable, "-m", "hetfl.cli", "run", str(tmp_path / "c.json"), "--quiet"],
        start_new_session=True,
        # A shell without job control starts background jobs with SIGINT ignored, and
        # Python keeps an ignored SIGINT; the run must see Ctrl-C as a terminal sends it.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")},
    )
    metrics = tmp_path / raw["name"] / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
        assert run.poll() is None, run.stderr.read().decode() if run.stderr else ""
        time.sleep(0.05)
    assert len(_session_processes(run.pid)) >= 4  # the run, the fork server, two workers
    os.killpg(run.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole foreground group
    run.wait()
    assert run.returncode != 0
    for _ in range(100):  # the fork server leaves once it sees the run's pipe close
        if not _session_processes(run.pid):
            break
        time.sleep(0.05)
    assert _session_processes(run.pid) == []
