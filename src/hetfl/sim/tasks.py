"""The units of work an executor runs, the same functions in process and in a worker.

Every executor runs these and only these, so that where a unit runs changes nothing in
what it computes. Each takes a `WorkerContext` (the run's programs and an evaluation model
cache of the process that runs it) and one plain, picklable item; data travels inside the
item as tensors (views of the run's shared data block under the process executor).

- `train_client`: one client's local training (`ClientProgram.fit`);
- `train_with_server`: the same against its session of the round's server program (split
  learning), client and server side in one process;
- `score_batch`: one fixed batch of a global evaluation (`EVAL_BATCH` samples,
  `hetfl.core.client.scoring`): the engine adds the batches' losses in batch order, as
  `evaluate_model` does in one process;
- `client_statistics`: one client's part of the static-BN statistics pass
  (`hetfl.engine.statistics`); the engine adds the parts in client-id order;
- `score_client`: one client's local evaluation (`ClientProgram.evaluate`);
- `evaluation_unit`: either of `score_batch` and `score_client`, by its item, so that a
  round's global and local evaluations go to the executor as one exchange.

A global model that units of one exchange share travels as a `RoundModel`: the process
that runs them loads it once (`WorkerContext.round_model`), not once per unit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from hetfl.core.client.bn_statistics import BNStatistics
from hetfl.core.client.program import Programs
from hetfl.core.client.scoring import score_batch_of
from hetfl.core.init import build_model
from hetfl.core.model_cache import ModelCache
from hetfl.core.pixels import PixelNorm, model_inputs
from hetfl.core.server.strategy import SetupQuery
from hetfl.core.server_program import Channel, ChannelCounts, ServerProgram
from hetfl.core.spec import Spec
from hetfl.core.types import (
    ClientData,
    ClientInfo,
    ClientOutput,
    ClientTask,
    EvalTask,
    Problem,
    ServerResult,
    State,
)
from hetfl.engine.statistics import client_bn_statistics


class RoundModel(NamedTuple):
    """A global model that units of one exchange share: `exchange` names the exchange
    (unique in the run), `name` the model in it (`EvalModel.name`)."""

    exchange: str
    name: str
    spec: Spec
    tensors: State


@dataclass
class WorkerContext:
    """What a process that runs units holds for the whole run: the programs, its own
    evaluation models (loaded per unit, never shared with the engine's), the models of
    its current exchange (`round_model`) and the set-up queries it has answered with
    (`setup_query`). `loads` counts the round models it has loaded."""

    programs: Programs
    eval_models: ModelCache = field(init=False)
    loads: int = field(init=False, default=0)
    _exchange: str = field(init=False, default="")
    _round_models: dict[str, nn.Module] = field(init=False, default_factory=dict)
    _setup_queries: dict[str, SetupQuery] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.eval_models = ModelCache(self.programs.family, self.programs.device)

    def round_model(self, ref: RoundModel) -> nn.Module:
        """`ref`'s model, loaded at its first unit in this process; the last exchange's
        models are dropped when units of another arrive. Units use it as they found it:
        scoring runs in eval mode, a statistics pass in train mode, which normalises by
        the batch's statistics, not the running ones it overwrites."""
        if ref.exchange != self._exchange:
            self._exchange, self._round_models = ref.exchange, {}
        model = self._round_models.get(ref.name)
        if model is None:
            model = build_model(self.programs.family, ref.spec).to(self.programs.device)
            model.load_state_dict(ref.tensors, strict=True)
            self._round_models[ref.name] = model
            self.loads += 1
        return model

    def setup_query(self, query: SetupQuery) -> SetupQuery:
        """The copy of `query` this process answers with: the first it received under the
        same `key` (which names everything an answer depends on besides the client's data
        and generator, so the copies answer alike), so that what a query builds for its
        first client (ZiCo's models) serves every client the process answers; a query
        without a key answers itself."""
        if query.key is None:
            return query
        return self._setup_queries.setdefault(query.key, query)


@dataclass(frozen=True)
class ClientJob:
    """One client's training this round, as an executor receives it.

    `private` is the client's kept state (empty before its first valid round),
    `generator` its (seed, round, client, "train") generator, `server_private` what the
    round's server program kept for it (empty without a server program), `cost` its
    expected work (training samples x MACs of training one sample of its spec), by which a
    parallel executor orders the round's jobs, largest first."""

    task: ClientTask
    info: ClientInfo
    private: State
    generator: torch.Generator
    server_private: State
    cost: float = 0.0


@dataclass(frozen=True)
class TaskOutcome:
    """What running one job produced, for the engine to charge, check, clock and store.

    `output` is the client's answer, or a `Problem` of kind "raised" when its training
    raised (or its worker process died). `wall_s` is the measured seconds of its training
    (0 when it raised); `served` its server session's result and `channel` what crossed
    its channel (None without a server program; `served` is also None when the client
    raised)."""

    task: ClientTask
    output: ClientOutput | Problem
    wall_s: float = 0.0
    served: ServerResult | None = None
    channel: ChannelCounts | None = None


def fit_client(
    programs: Programs, job: ClientJob, data: ClientData, channel: Channel | None = None
) -> tuple[ClientOutput | Problem, float]:
    """One client's training (against its server session's `channel` in split learning)
    and its measured seconds; an exception becomes a "raised" problem (and 0 s), since a
    failing client must not stop the run."""
    linked = {} if channel is None else {"channel": channel}
    started = time.perf_counter()
    try:
        program = programs.program_for(job.task.cid)
        out = program.fit(job.task, data, job.private, job.generator, info=job.info, **linked)
    except Exception as exc:
        return Problem("raised", f"raised {type(exc).__name__}: {exc}"), 0.0
    return out, time.perf_counter() - started


def train_client(ctx: WorkerContext, item: tuple[ClientJob, ClientData]) -> TaskOutcome:
    """One client's training without a server program."""
    job, data = item
    return TaskOutcome(job.task, *fit_client(ctx.programs, job, data))


def train_with_server(
    ctx: WorkerContext, item: tuple[ClientJob, ClientData, ServerProgram]
) -> TaskOutcome:
    """One client's training against its own session of the round's server program, both
    in the process that runs the unit (where each side ran in the simulated world is the
    clock's business, not the process's); the session is closed only when the client did
    not raise."""
    job, data, server = item
    session = server.open(job.task, job.server_private)
    channel = Channel(session)
    out, wall_s = fit_client(ctx.programs, job, data, channel)
    served = None if isinstance(out, Problem) else session.close()
    return TaskOutcome(job.task, out, wall_s, served, channel.counts())


def training_units(
    jobs: Sequence[ClientJob], clients: Mapping[int, ClientData], server: ServerProgram | None
) -> tuple[Callable[[WorkerContext, Any], TaskOutcome], list[Any]]:
    """A round's trainings as one unit and its items, for an executor that runs them
    elsewhere: `train_client` on (job, data), or `train_with_server` on (job, data,
    server) in split learning."""
    if server is None:
        return train_client, [(job, clients[job.task.cid]) for job in jobs]
    return train_with_server, [(job, clients[job.task.cid], server) for job in jobs]


def train_as_units(
    map_units: Callable[..., list[TaskOutcome]],
    programs: Programs,
    jobs: Sequence[ClientJob],
    clients: Mapping[int, ClientData],
    server: ServerProgram | None,
) -> list[TaskOutcome]:
    """`Executor.run` for an executor whose workers may die (processes, Ray actors): the
    round's trainings as units of its `map_units` (its `map`), ordered by the jobs' costs,
    a dead worker's unit answered by `died_while_training`."""
    unit, items = training_units(jobs, clients, server)
    costs = [job.cost for job in jobs]
    return map_units(programs, unit, items, costs=costs, on_death=died_while_training)


def died_while_training(item: tuple[Any, ...], why: str) -> TaskOutcome:
    """A training unit's outcome when the worker that ran it died (killed, out of memory):
    that client fails this round with `why` in its reason, as when it raises. The item is
    (job, data[, server])."""
    job: ClientJob = item[0]
    return TaskOutcome(job.task, Problem("raised", f"client {job.task.cid} failed: {why}"))


class BatchScore(NamedTuple):
    correct: int
    loss_sum: float


class ScoreItem(NamedTuple):
    model: RoundModel
    x: torch.Tensor
    y: torch.Tensor
    pixels: PixelNorm | None = None


def score_batch(ctx: WorkerContext, item: ScoreItem) -> BatchScore:
    x = model_inputs(item.x, item.pixels)
    return BatchScore(*score_batch_of(ctx.round_model(item.model), x, item.y))


class StatisticsItem(NamedTuple):
    model: RoundModel
    x_train: torch.Tensor
    share: int
    seed: int
    cid: int
    pixels: PixelNorm | None = None


def client_statistics(ctx: WorkerContext, item: StatisticsItem) -> BNStatistics:
    model = ctx.round_model(item.model)
    return client_bn_statistics(model, item.x_train, item.share, item.seed, item.cid, item.pixels)


class LocalScoreItem(NamedTuple):
    task: EvalTask
    data: ClientData
    private: State


def score_client(ctx: WorkerContext, item: LocalScoreItem) -> tuple[float, float, int]:
    program = ctx.programs.program_for(item.data.cid)
    return program.evaluate(item.task, item.data, item.private, ctx.eval_models)


def evaluation_unit(
    ctx: WorkerContext, item: ScoreItem | LocalScoreItem
) -> BatchScore | tuple[float, float, int]:
    """A global evaluation's batch or a client's local evaluation, by the item."""
    if isinstance(item, ScoreItem):
        return score_batch(ctx, item)
    return score_client(ctx, item)
