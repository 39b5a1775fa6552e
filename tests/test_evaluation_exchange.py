"""A round's evaluation reaches the executor as few exchanges as its dependencies allow:
every tested model's statistics pass in one, then every model's global scoring and every
client's local evaluation in one; each process loads a model of the round once, not once
per unit; and the metrics equal the sequential executor's bit for bit under 1 and 2
worker processes."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from golden.harness import BY_NAME
from hetfl.config import validate
from hetfl.core.client.program import Programs
from hetfl.core.client.scoring import EVAL_BATCH
from hetfl.core.server_program import ServerProgram
from hetfl.core.types import ClientData
from hetfl.runner import build_simulation
from hetfl.sim import ProcessExecutor, SequentialExecutor
from hetfl.sim.executor import Executor
from hetfl.sim.tasks import ClientJob, TaskOutcome, WorkerContext


class CountsExchanges:
    """An executor that runs everything by `inner` and records each `map` call (one
    exchange): its unit's name and how many units it carried."""

    def __init__(self, inner: Executor) -> None:
        self.inner = inner
        self.exchanges: list[tuple[str, int]] = []

    def share(self, data: Any) -> Any:
        return self.inner.share(data)

    def run(
        self,
        programs: Programs,
        jobs: Sequence[ClientJob],
        clients: Mapping[int, ClientData],
        server: ServerProgram | None,
    ) -> list[TaskOutcome]:
        return self.inner.run(programs, jobs, clients, server)

    def map(
        self,
        programs: Programs,
        unit: Callable[[Any, Any], Any],
        items: Sequence[Any],
        costs: Sequence[float] | None = None,
    ) -> list[Any]:
        self.exchanges.append((unit.__name__, len(items)))
        return self.inner.map(programs, unit, items, costs)

    def close(self) -> None:
        self.inner.close()

    def describe(self) -> str:
        return self.inner.describe()


def _loads(ctx: WorkerContext, item: int) -> int:
    """How many round models the process that runs this unit has loaded (the seam)."""
    return ctx.loads


def _heterofl_round(tmp_path: Path, executor: Executor) -> tuple[CountsExchanges, Any]:
    """One round of HeteroFL at three widths on digits, each width tested after its
    statistics pass (a 200-sample share of every client's data), 4 sampled clients
    evaluated locally; run by `executor`."""
    raw = copy.deepcopy(BY_NAME["heterofl-dynamic"].config)
    raw["train"]["rounds"] = 1
    sim = build_simulation(validate(raw), tmp_path, show_progress=False)
    sim.executor.close()
    counting = CountsExchanges(executor)
    sim.executor = counting
    sim.run()
    return counting, sim


def _rows(sim: Any) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k != "wall_time_s"} for r in sim.metrics.read()]


@pytest.fixture(scope="module")
def sequential(tmp_path_factory):
    """The round run by the sequential executor: the reference for the metrics."""
    executor = SequentialExecutor()
    counting, sim = _heterofl_round(tmp_path_factory.mktemp("sequential"), executor)
    return executor, counting, sim


@pytest.mark.parametrize("workers", [0, 1, 2])
def test_a_multi_width_round_is_evaluated_in_two_exchanges_loading_each_model_once(
    workers, sequential, tmp_path
):
    """workers 0: the sequential executor (in process)."""
    if workers:
        executor: Executor = ProcessExecutor(workers)
        counting, sim = _heterofl_round(tmp_path, executor)
    else:
        executor, counting, sim = sequential
    try:
        widths, clients = 3, 6
        batches = math.ceil(int(sim.y_test.shape[0]) / EVAL_BATCH)
        rows = _rows(sim)
        sampled = rows[0]["clients"]  # local_eval "sampled": each client that trained
        assert sampled == 4
        assert [e for e in counting.exchanges if e[0] != "train_client"] == [
            ("client_statistics", widths * clients),  # every width's pass, a unit per client
            ("evaluation_unit", widths * batches + sampled),  # every scoring, every client
        ]
        # A process loads each of the 6 models (3 widths before and after their pass) at
        # most once, however many of their 18 + 3 units it ran; one process runs them all.
        probes = list(range(max(workers, 1)))  # the first unit of each worker, one each
        loads = executor.map(sim.programs, _loads, probes)
        assert all(n <= 2 * widths for n in loads)
        assert sum(loads) >= 2 * widths
        if workers <= 1:
            assert loads == [2 * widths]
    finally:
        if workers:
            executor.close()
    assert rows == _rows(sequential[2])
