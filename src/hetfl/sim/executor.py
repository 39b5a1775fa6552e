"""Executors: where the simulator's units of work run.

The engine hands an `Executor` its round's client trainings (`run`) and the units of its
evaluations (`map`: fixed batches of a global evaluation, clients' parts of a statistics
pass, clients' local evaluations; `hetfl.sim.tasks`), and gets the answers back in the
order it gave them (client-id order, batch order). Everything with an effect on the run,
the byte and MAC counters, the result checks, the simulated clock, the client stores and
the sums of the batches, is done afterwards, once, by the engine. An executor therefore
only computes: it never touches counters, the clock or a store, and what it receives is
plain and picklable, so that an executor in other processes runs the same units.

- `SequentialExecutor` runs every unit in this process, in order (the library's default).
  In split learning each client's unit (`train_with_server`) opens its session of the
  round's server program, feeds it per batch through a `Channel` and closes it.
- `ProcessExecutor` (`hetfl.sim.processes`) runs units in worker processes, on the CPU,
  split learning's included: a client and its server session run in the same worker.
- `RayExecutor` (`hetfl.sim.ray_executor`) runs the same units on Ray actors, on one
  machine or a cluster, split learning's included.
- `VectorisedExecutor` (`hetfl.sim.vectorised`) trains same-spec clients together with
  `torch.func.vmap`, for a GPU; it alone agrees with the others to about 1e-5 only.

Results do not depend on the executor (the vectorised one excepted): every unit runs with
the run's intra-op thread count (`threads`), each client's generator is derived from (seed,
round, client, purpose) and each client's private state is its own, so a unit computes the
same bits wherever it runs, and the engine combines answers in the same order whichever
executor ran them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from hetfl.core.client.program import Programs
from hetfl.core.server_program import ServerProgram
from hetfl.core.types import ClientData
from hetfl.sim.tasks import ClientJob, TaskOutcome, WorkerContext, train_client, train_with_server

T = TypeVar("T")
R = TypeVar("R")


class Executor(Protocol):
    """Runs units of work and returns their answers in the order they were given."""

    def share(self, data: T) -> T:
        """The run's data as this executor's units will read it (the process executor
        places it in shared memory): the engine keeps and uses the returned copy."""
        ...

    def run(
        self,
        programs: Programs,
        jobs: Sequence[ClientJob],
        clients: Mapping[int, ClientData],
        server: ServerProgram | None,
    ) -> list[TaskOutcome]:
        """Train every job's client with its program (`programs.program_for(cid)`) on its
        data `clients[cid]`; with a `server` program, each client trains against its own
        session of it. One outcome per job, in the jobs' order."""
        ...

    def map(
        self,
        programs: Programs,
        unit: Callable[[Any, T], R],
        items: Sequence[T],
        costs: Sequence[float] | None = None,
    ) -> list[R]:
        """`unit(ctx, item)` for every item (`ctx`: a `WorkerContext` of `programs`), the
        answers in the items' order; `costs` may order the work, never the answers."""
        ...

    def close(self) -> None:
        """Release what the executor holds (worker processes)."""
        ...

    def describe(self) -> str:
        """What the start banner says about it."""
        ...


class SequentialExecutor:
    """Every unit in order, in this process."""

    def __init__(self) -> None:
        self._ctx: WorkerContext | None = None

    def share(self, data: T) -> T:
        return data

    def run(
        self,
        programs: Programs,
        jobs: Sequence[ClientJob],
        clients: Mapping[int, ClientData],
        server: ServerProgram | None,
    ) -> list[TaskOutcome]:
        ctx = self._context(programs)
        if server is None:
            return [train_client(ctx, (job, clients[job.task.cid])) for job in jobs]
        return [train_with_server(ctx, (job, clients[job.task.cid], server)) for job in jobs]

    def map(
        self,
        programs: Programs,
        unit: Callable[[Any, T], R],
        items: Sequence[T],
        costs: Sequence[float] | None = None,
    ) -> list[R]:
        ctx = self._context(programs)
        return [unit(ctx, item) for item in items]

    def close(self) -> None:
        self._ctx = None

    def describe(self) -> str:
        return "sequential (in process)"

    def _context(self, programs: Programs) -> WorkerContext:
        if self._ctx is None or self._ctx.programs is not programs:
            self._ctx = WorkerContext(programs)
        return self._ctx
