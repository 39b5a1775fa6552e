"""Two one-thread worker processes: the mechanism every two-process floor (`floor2` of A, B
and H) runs on, so that a floor written for two cores is the same harness on each workload.

Each worker builds its handler once (data loaded, models built: off the clock, as HetFL's
pool start-up is off the per-round clock) and then answers calls, a method name and its
arguments, until told to stop; the parent sends both workers their call and reads the
replies in worker order, so it combines them in a fixed order. What a worker does with a
call (which clients it trains, which evaluations it runs) is decided by `deal`, from the
worker's index, in the worker: both workers deal the same list the same way.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable, Hashable, Sequence
from multiprocessing.connection import Connection
from typing import Any, TypeVar

import torch

WORKERS = 2
T = TypeVar("T", bound=Hashable)


def deal(costs: Sequence[tuple[T, float]], parts: int = WORKERS) -> list[list[T]]:
    """The items split into `parts` lists whose summed costs balance: largest cost first,
    each to the least-loaded list (ties: the lower list); each list keeps the items' given
    order, so a worker's clients are still added in id order."""
    loads = [0.0] * parts
    owner: dict[T, int] = {}
    for item, cost in sorted(costs, key=lambda ic: -ic[1]):  # stable: equal costs keep order
        part = loads.index(min(loads))
        owner[item] = part
        loads[part] += cost
    return [[item for item, _ in costs if owner[item] == part] for part in range(parts)]


def _serve(conn: Connection, make: Callable[[], Any]) -> None:
    torch.set_num_threads(1)
    handler = make()
    conn.send("ready")
    while (call := conn.recv()) is not None:
        name, args = call
        conn.send(getattr(handler, name)(*args))


class WorkerPair:
    """`WORKERS` spawned processes of one intra-op thread, each serving `make()`'s methods
    (`make` must pickle: a top-level class or a `functools.partial` of one)."""

    def __init__(self, make: Callable[[], Any]) -> None:
        ctx = mp.get_context("spawn")
        self.pipes: list[Connection] = []
        self.procs: list[Any] = []
        for _ in range(WORKERS):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(child, make), daemon=True)
            proc.start()
            self.pipes.append(parent)
            self.procs.append(proc)

    def ready(self) -> None:
        """Wait until every worker has built its handler."""
        for conn in self.pipes:
            if conn.recv() != "ready":
                raise RuntimeError("a floor worker answered before it was ready")

    def call(self, name: str, args: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Worker i runs `name(*args[i])`; their results, in worker order."""
        for conn, a in zip(self.pipes, args, strict=True):
            conn.send((name, a))
        return [conn.recv() for conn in self.pipes]

    def close(self) -> None:
        for conn in self.pipes:
            conn.send(None)
        for proc in self.procs:
            proc.join()
