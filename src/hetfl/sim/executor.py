"""Executors: how the simulator runs a round's client trainings.

`Simulation.train` hands the round's jobs to an `Executor` and gets one `TaskOutcome` per
job back, in the jobs' order (client-id order); everything with an effect on the run, the
byte and MAC counters, the result checks, the simulated clock and the client stores, is
done afterwards, once, by the engine. An executor therefore only computes: it never
touches counters, the clock or a store, and what it receives is plain (the task, the
client's `ClientInfo`, its private state, its training generator, what the server program
kept for it) so that an executor in other processes can run the same jobs.

`SequentialExecutor` runs the jobs one after another in this process, in order. It also
runs split learning: a server program's sessions are opened, fed per batch through a
`Channel` and closed in the job order, interleaved with the clients' training, as the
server program expects. An executor that runs clients in parallel may refuse server
programs and leave split learning to the sequential one.

Results do not depend on the executor: each job's generator is derived from (seed, round,
client, "train") and each client's private state is its own, so the outcomes are the same
whatever order or place the jobs run in.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from hetfl.core.client import Programs
from hetfl.core.server_program import Channel, ChannelCounts, ServerProgram, ServerResult
from hetfl.core.types import ClientData, ClientInfo, ClientOutput, ClientTask, Problem, State


@dataclass(frozen=True)
class ClientJob:
    """One client's training this round, as an executor receives it.

    `private` is the client's kept state (empty before its first valid round),
    `generator` its (seed, round, client, "train") generator, `server_private` what the
    round's server program kept for it (empty without a server program)."""

    task: ClientTask
    info: ClientInfo
    private: State
    generator: torch.Generator
    server_private: State


@dataclass(frozen=True)
class TaskOutcome:
    """What running one job produced, for the engine to charge, check, clock and store.

    `output` is the client's answer, or a `Problem` of kind "raised" when its training
    raised. `wall_s` is the measured seconds of its training (0 when it raised);
    `served` its server session's result and `channel` what crossed its channel (None
    without a server program; `served` is also None when the client raised)."""

    task: ClientTask
    output: ClientOutput | Problem
    wall_s: float = 0.0
    served: ServerResult | None = None
    channel: ChannelCounts | None = None


class Executor(Protocol):
    """Runs a round's jobs and returns their outcomes, one per job, in the jobs' order."""

    def run(
        self,
        programs: Programs,
        jobs: Sequence[ClientJob],
        clients: Mapping[int, ClientData],
        server: ServerProgram | None,
    ) -> list[TaskOutcome]:
        """Train every job's client with its program (`programs.program_for(cid)`) on its
        data `clients[cid]`; with a `server` program, each client trains against its own
        session of it."""
        ...


class SequentialExecutor:
    """Every job in order, in this process (the simulator's default)."""

    def run(
        self,
        programs: Programs,
        jobs: Sequence[ClientJob],
        clients: Mapping[int, ClientData],
        server: ServerProgram | None,
    ) -> list[TaskOutcome]:
        return [self._run_one(programs, job, clients[job.task.cid], server) for job in jobs]

    def _run_one(
        self,
        programs: Programs,
        job: ClientJob,
        data: ClientData,
        server: ServerProgram | None,
    ) -> TaskOutcome:
        """One client's training; an exception becomes a "raised" outcome, since a failing
        client must not stop the run."""
        session = None if server is None else server.open(job.task, job.server_private)
        channel = None if session is None else Channel(session)
        linked = {} if channel is None else {"channel": channel}
        started = time.perf_counter()
        try:
            program = programs.program_for(job.task.cid)
            out = program.fit(job.task, data, job.private, job.generator, info=job.info, **linked)
        except Exception as exc:
            raised = Problem("raised", f"raised {type(exc).__name__}: {exc}")
            return TaskOutcome(job.task, raised, channel=_counts(channel))
        wall_s = time.perf_counter() - started
        served = None if session is None else session.close()
        return TaskOutcome(job.task, out, wall_s, served, _counts(channel))


def _counts(channel: Channel | None) -> ChannelCounts | None:
    return None if channel is None else channel.counts()
