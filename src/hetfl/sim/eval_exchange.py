"""A round's evaluation as exchanges of the simulator's executor, and their answers summed.

Two exchanges however many models a round tests: `statistics_exchange`, every model's
statistics pass (a unit per model and client, `client_statistics`), then
`scoring_exchange`, every model's scoring in fixed batches of `EVAL_BATCH` and every
client's local evaluation (`evaluation_unit`); the second scores the models with the
statistics the first gives them, so it cannot start before. The units of one model carry
it as a `RoundModel`, which each process loads once per exchange, not once per unit. The
batches' losses are added in batch order (in float64) and the statistics parts in
client-id order, as `evaluate_model` and the pass do in one process, so the sums do not
depend on the executor or its number of workers.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence

from hetfl.core.client.bn_statistics import BNStatistics
from hetfl.core.client.program import Programs
from hetfl.core.client.scoring import EVAL_BATCH
from hetfl.core.pixels import PixelNorm
from hetfl.core.spec import Spec
from hetfl.core.types import ClientData, State
from hetfl.engine.global_eval import Score, Scoring
from hetfl.engine.statistics import add_bn_statistics
from hetfl.engine.steps import LocalScore
from hetfl.sim.executor import Executor
from hetfl.sim.tasks import (
    BatchScore,
    LocalScoreItem,
    RoundModel,
    ScoreItem,
    StatisticsItem,
    client_statistics,
    evaluation_unit,
)


def scoring_exchange(
    executor: Executor,
    programs: Programs,
    scorings: Sequence[Scoring],
    asked: Sequence[Sequence[LocalScoreItem]],
    pixels: PixelNorm | None,
) -> tuple[list[Score], list[list[LocalScore]]]:
    """Each scoring's (correct, summed loss, count) and each list of clients' local
    evaluations scored, from one exchange of `executor`."""
    exchange = uuid.uuid4().hex
    models: dict[str, RoundModel] = {}
    units: list[ScoreItem | LocalScoreItem] = []
    for s in scorings:
        em = s.model
        model = models.setdefault(em.name, RoundModel(exchange, em.name, em.spec, em.tensors))
        if model.tensors is not em.tensors:  # a process keeps one model per name
            raise ValueError(f"two of the round's evaluated models are named {em.name!r}")
        units += [
            ScoreItem(model, s.x[i : i + EVAL_BATCH], s.y[i : i + EVAL_BATCH], pixels)
            for i in range(0, int(s.y.shape[0]), EVAL_BATCH)
        ]
    units += [item for items in asked for item in items]
    answers = iter(executor.map(programs, evaluation_unit, units))
    scores: list[Score] = []
    for s in scorings:
        correct, loss_sum = 0, 0.0
        for _ in range(0, int(s.y.shape[0]), EVAL_BATCH):
            batch = next(answers)
            assert isinstance(batch, BatchScore)
            correct += batch.correct
            loss_sum += batch.loss_sum
        scores.append((correct, loss_sum, int(s.y.shape[0])))
    return scores, [[_local_score(item, next(answers)) for item in items] for items in asked]


def _local_score(item: LocalScoreItem, answer: BatchScore | tuple[float, float, int]) -> LocalScore:
    """A client's local evaluation (`score_client`'s answer) as its score."""
    assert not isinstance(answer, BatchScore), "a local evaluation answered a batch's score"
    correct, loss_sum, n = answer
    return LocalScore(item.task.cid, correct / n, loss_sum / n, item.task.group, n)


def statistics_exchange(
    executor: Executor,
    programs: Programs,
    models: Sequence[tuple[str, Spec, State]],
    clients: Mapping[int, ClientData],
    shares: Mapping[int, int],
    seed: int,
    pixels: PixelNorm | None,
) -> list[BNStatistics]:
    """The summed statistics of each (name, spec, tensors) model over every client's share
    (`hetfl.engine.statistics.stats_shares`, clients in id order, none empty), from one
    exchange of `executor`."""
    exchange = uuid.uuid4().hex
    items = [
        StatisticsItem(
            RoundModel(exchange, name, spec, tensors),
            clients[cid].x_train,
            share,
            seed,
            cid,
            pixels,
        )
        for name, spec, tensors in models
        for cid, share in shares.items()
    ]
    parts = iter(executor.map(programs, client_statistics, items))
    totals = []
    for _ in models:
        total: BNStatistics = {}
        for _ in shares:
            add_bn_statistics(total, next(parts))
        totals.append(total)
    return totals
