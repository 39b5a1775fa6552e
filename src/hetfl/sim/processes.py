"""The process executor: a round's units spread over worker processes on one machine.

On a CPU, processes are the lever: two one-thread processes train a small CNN 1.5-1.9x
faster than one two-thread process (intra-op threading scales poorly at small batches).
This executor keeps `workers` processes (`hetfl.sim.worker`) for the run:

- Started by `forkserver`, never by `fork` after torch has run parallel work; the fork
  server preloads torch and HetFL once, so a worker (and a restarted one) starts warm. A
  worker imports the run's `plugins` (`hetfl.core.plugins`) before it receives anything.
- Started as soon as the executor is built, by a thread, so that the fork server's imports
  and the workers' start overlap the run's loading of its data: the first exchange (or
  `share`) waits for that start, and raises its error if it failed; `close` waits for it
  too, so a run stopped while its data loads leaves no worker behind. The start is done
  when every worker has said it is ready (its set-up done, `hetfl.sim.worker`), so no
  worker's start-up lands in round 1; a worker that ends before it is ready fails the start.
- The run's data (clients' samples, the test and validation sets) is placed once in one
  shared-memory block (`share`); the engine keeps views of it and they travel by reference.
- The programs go to each worker once; within one exchange (a round's trainings, one
  evaluation) a tensor, such as the round's global weights in every task, goes to each
  worker once; each answer comes back as one flat buffer (`hetfl.sim.wire`).
- Units go to workers largest expected cost first (a client's training samples x MACs
  of its spec), each worker taking the next when it answers; answers are returned in the
  units' order, so the engine sees what the sequential executor gives it.

Results do not depend on the executor: a unit computes the same bits wherever it runs,
since every process runs units with the same intra-op thread count (`threads`) and each
client's randomness comes from its own generator.

Faults: a unit that raises in a worker is the unit's error (training units turn their own
exceptions into a "raised" outcome, as in process); a worker that dies (killed, out of
memory) fails the unit it was running (for a training unit: that client fails this round,
with the signal in its reason), is replaced, and the other units go on. Ctrl-C reaches the
parent only (workers ignore it) and `close` stops every worker; a worker whose parent dies
sees its pipe close and exits.

Split learning (a round with a server program) runs in the workers too: the round's
server program travels with each client's unit (`train_with_server`), which opens that
client's session in the worker and feeds it per batch through an in-process channel, so
a client and its server side compute in the same process, whichever side the simulated
clock says they ran on. Server programs must therefore pickle (`CopiesSide`'s do).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import signal
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing import forkserver
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, TypeVar

import torch
import torch.multiprocessing

from hetfl.core.client.program import Programs
from hetfl.core.server_program import ServerProgram
from hetfl.core.types import ClientData
from hetfl.sim.tasks import ClientJob, TaskOutcome, train_as_units
from hetfl.sim.wire import Receiver, Sender, SharedBuffer
from hetfl.sim.worker import serve

T = TypeVar("T")
R = TypeVar("R")

#: What the fork server imports once, so that every worker starts with it imported: the
#: worker loop, and what unpickling a run's programs imports (models, methods' parts).
PRELOAD = ["hetfl.sim.worker", "hetfl.models", "hetfl.algorithms"]
#: Seconds a stopping worker gets before it is killed.
STOP_GRACE_S = 5.0


class WorkerDied(RuntimeError):
    """A worker process ended while it ran a unit."""


@dataclass
class _Worker:
    process: BaseProcess
    sender: Sender
    receiver: Receiver
    programs: Programs | None = None  # the programs it holds

    @property
    def conn(self) -> Connection:
        return self.sender.conn


class ProcessExecutor:
    """Runs units in `workers` worker processes of `threads` intra-op threads each.

    `plugins`: the run's, which every worker imports first. Use as a context manager, or
    call `close()`; the workers start now, in the background (`_await_start`)."""

    def __init__(
        self,
        workers: int,
        threads: int = 1,
        *,
        device: str = "cpu",
        deterministic: bool = True,
        plugins: Sequence[str] = (),
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if torch.device(device).type != "cpu":
            raise ValueError(
                f"the process executor runs on the CPU, got device {device!r}: use "
                "executor 'sequential' (or 'vectorised') on an accelerator"
            )
        self.workers, self.threads = workers, threads
        self.device, self.deterministic = device, deterministic
        self.plugins = tuple(plugins)
        self._context = mp.get_context("forkserver")
        self._context.set_forkserver_preload(PRELOAD)
        self._pool: list[_Worker] = []
        self._block: SharedBuffer | None = None
        self._programs: Programs | None = None
        self.restarts = 0
        self._start_error: BaseException | None = None
        # A worker's start waits for the fork server's imports: a thread waits, not the caller.
        self._starting: threading.Thread | None = threading.Thread(
            target=self._start_workers, name="hetfl-worker-start", daemon=True
        )
        self._starting.start()

    def _start_workers(self) -> None:
        """The pool's first start (in the `_starting` thread): the fork server, then every
        worker; an error is kept for `_await_start` to raise in the caller's thread."""
        try:
            forkserver.ensure_running()
            self._fill()
        except BaseException as error:
            self._start_error = error

    def _await_start(self) -> None:
        """Wait for the background start (once); a start that failed stops the workers
        it started and raises here."""
        starting, self._starting = self._starting, None
        if starting is None:
            return
        starting.join()
        if self._start_error is not None:
            self._kill()
            raise RuntimeError(
                f"the process executor's {self.workers} worker process(es) did not start: "
                f"{self._start_error!r}; use executor 'sequential' to run without them"
            ) from self._start_error

    # -- the Executor protocol -----------------------------------------------------------
    def share(self, data: T) -> T:
        """`data` rebuilt on one shared-memory block that every worker maps; the engine
        keeps the returned copy (its tensors are views of the block), so the data is held
        once on the machine, and views of it travel by reference."""
        self._await_start()
        self._block, placed = SharedBuffer.place(data)
        for w in self._pool:
            self._send_block(w)
        return placed

    def run(
        self,
        programs: Programs,
        jobs: Sequence[ClientJob],
        clients: Mapping[int, ClientData],
        server: ServerProgram | None,
    ) -> list[TaskOutcome]:
        return train_as_units(self.map, programs, jobs, clients, server)

    def map(
        self,
        programs: Programs,
        unit: Callable[[Any, T], R],
        items: Sequence[T],
        costs: Sequence[float] | None = None,
        on_death: Callable[[T, str], R] | None = None,
    ) -> list[R]:
        """`unit(ctx, item)` for every item, in the workers, answers in the items' order.
        `on_death(item, why)` answers for an item whose worker died running it (default:
        the run stops with `WorkerDied`)."""
        if not items:
            return []
        self._await_start()
        self._start(programs)
        try:
            answers = self._exchange(unit, items, costs, on_death)
        except BaseException:
            self._kill()  # answers may be in flight: start afresh at the next exchange
            raise
        return [answers[i] for i in range(len(items))]

    def _exchange(
        self,
        unit: Callable[[Any, T], R],
        items: Sequence[T],
        costs: Sequence[float] | None,
        on_death: Callable[[T, str], R] | None,
    ) -> dict[int, R]:
        order = sorted(range(len(items)), key=lambda i: (-(costs[i] if costs else 0.0), i))
        pending = list(reversed(order))  # pop() takes the largest first
        answers: dict[int, R] = {}
        running: dict[int, int] = {}  # worker slot -> item index
        for w in self._pool:
            w.sender.reset()
            w.sender.send(("exchange",))
        for slot in range(len(self._pool)):
            if pending:
                running[slot] = self._give(slot, pending.pop(), unit, items)
        while running:
            ready = wait([self._pool[s].conn for s in running])
            for slot in [s for s in running if self._pool[s].conn in ready]:
                index = running.pop(slot)
                try:
                    answers[index] = self._answer(slot, index)
                except WorkerDied as died:
                    self._replace(slot)
                    if on_death is None:
                        raise
                    answers[index] = on_death(items[index], str(died))
                if pending:
                    running[slot] = self._give(slot, pending.pop(), unit, items)
        return answers

    def close(self) -> None:
        """Stop every worker (asked first, killed if it has not stopped within a grace)."""
        with contextlib.suppress(RuntimeError):  # a failed start: nothing left to stop
            self._await_start()
        pool, self._pool = self._pool, []
        for w in pool:
            with contextlib.suppress(OSError):
                w.sender.send(("stop",))
        for w in pool:
            w.process.join(STOP_GRACE_S)
            if w.process.is_alive():
                w.process.kill()
                w.process.join()
            w.conn.close()

    def _kill(self) -> None:
        """Stop every worker now, busy or not (after an error or Ctrl-C)."""
        pool, self._pool = self._pool, []
        for w in pool:
            w.process.kill()
        for w in pool:
            w.process.join()
            w.conn.close()

    def __enter__(self) -> ProcessExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def describe(self) -> str:
        return f"processes ({self.workers} workers x {self.threads} thread(s))"

    # -- the pool --------------------------------------------------------------------------
    def _start(self, programs: Programs) -> None:
        """Every worker alive (one that died while idle is replaced) and holding
        `programs`."""
        for w in [w for w in self._pool if not w.process.is_alive()]:
            w.conn.close()
            self.restarts += 1
        self._pool = [w for w in self._pool if w.process.is_alive()]
        self._fill()
        self._programs = programs
        for w in self._pool:
            self._hand_programs(w)

    def _hand_programs(self, w: _Worker) -> None:
        if w.programs is not self._programs and self._programs is not None:
            w.sender.send(("programs", self._programs))
            w.programs = self._programs

    def _fill(self) -> None:
        """Workers started until the pool is full, all started before any is waited for,
        so that they set up side by side."""
        fresh = [self._spawn() for _ in range(self.workers - len(self._pool))]
        self._pool += fresh
        for w in fresh:
            _await_ready(w)

    def _spawn(self) -> _Worker:
        parent, child = self._context.Pipe()
        process = self._context.Process(
            target=serve,
            args=(child, self.threads, self.device, self.deterministic, self.plugins),
            daemon=True,
            name="hetfl-worker",
        )
        process.start()
        child.close()
        worker = _Worker(process, Sender(parent, self._block), Receiver(parent, self._block))
        if self._block is not None:
            self._send_block(worker)
        return worker

    def _send_block(self, w: _Worker) -> None:
        assert self._block is not None
        w.sender.shared = w.receiver.shared = self._block
        w.sender.send(("block",))
        w.conn.send(self._block.block)

    def _replace(self, slot: int) -> None:
        old = self._pool[slot]
        old.process.join(STOP_GRACE_S)
        old.conn.close()
        fresh = self._spawn()
        _await_ready(fresh)
        self._hand_programs(fresh)
        fresh.sender.send(("exchange",))
        self._pool[slot] = fresh
        self.restarts += 1

    def _give(self, slot: int, index: int, unit: Callable[..., Any], items: Sequence[Any]) -> int:
        self._pool[slot].sender.send(("unit", index, unit, items[index]))
        return index

    def _answer(self, slot: int, index: int) -> Any:
        w = self._pool[slot]
        try:
            kind, answered, value = w.receiver.recv()
        except (EOFError, OSError):
            w.process.join(STOP_GRACE_S)
            raise WorkerDied(_death(w.process.exitcode)) from None
        assert answered == index, f"worker answered unit {answered}, was given {index}"
        if kind == "error":
            raise RuntimeError(f"a unit failed in a worker process:\n{value}")
        return value


def _await_ready(w: _Worker) -> None:
    """Wait for a started worker's "ready" (`hetfl.sim.worker.serve`)."""
    try:
        said = w.conn.recv()
    except (EOFError, OSError):
        w.process.join(STOP_GRACE_S)
        raise WorkerDied(_death(w.process.exitcode)) from None
    if said != "ready":
        raise RuntimeError(f"a worker process said {said!r} before it was ready")


def _death(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return f"its worker process was killed by {signal.Signals(-exitcode).name}"
    return f"its worker process exited with code {exitcode}"
