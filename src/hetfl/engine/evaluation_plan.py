"""One job: a run's evaluation as a plan, the named, typed asks of every evaluated round,
built once at set-up from what the method declares and the config, and the one function
that carries a round's plan out (`run_plan`).

Every method special case of the evaluation (a statistics pass, FedGKT's scoring on its
clients' own splits or of its joined models on the global test set, FedFA's
trained-before-aggregation scores, validation, a backdoor's attack success) is an ask
here, decided before round 1 rather than by branches of the round loop, so that the whole
of what a run measures can be read (and imposed) at once.
The asks are scored together, in the plan's order, by one exchange of the engine
(`RoundLoop.score_round`); each fills the metrics it names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple, Protocol

import torch

from hetfl.core.types import EvalModel, EvalSplit, EvalTask, State
from hetfl.engine.global_eval import ProbeSamples, Score, Scoring, plan_global
from hetfl.engine.round_settings import RoundSettings, StatsPassRule
from hetfl.engine.steps import (
    GlobalScores,
    LocalScore,
    Pooled,
    RoundOutcome,
    mean_local_accuracy,
    mean_local_scores,
    pooled_accuracy,
)


@dataclass(frozen=True)
class GlobalTest:
    """The method's global models (`Strategy.eval_models`) on the global test set, each
    after its statistics pass as `stats_pass` rules (`auto`: when the method asks for
    one): `global_acc`, `test_loss`, `groups`."""

    stats_pass: StatsPassRule = "auto"
    name = "global test"


@dataclass(frozen=True)
class GlobalValidation:
    """The main global model on every client's validation samples pooled: `val_acc`,
    `val_loss`."""

    name = "global validation"


@dataclass(frozen=True)
class ProbeScore:
    """The main global model on a probe's samples (`hetfl.core.probe`): its `metric`."""

    metric: str

    @property
    def name(self) -> str:
        return f"probe {self.metric}"


@dataclass(frozen=True)
class PooledOwnSplits:
    """Every trained client judged on its own `split` by the method's pooled task
    (`Strategy.pooled_task`: FedGKT's joined models), pooled by samples: `pooled_acc`,
    `pooled_loss` on the test split, `val_acc`, `val_loss` on the validation split; each
    joined model after its client's statistics pass as `stats_pass` rules."""

    split: EvalSplit
    stats_pass: StatsPassRule = "auto"

    @property
    def name(self) -> str:
        return f"pooled {self.split}"


@dataclass(frozen=True)
class PooledGlobalTest:
    """Every trained client's model by the method's pooled task (`Strategy.pooled_task`:
    FedGKT's extractor joined to the server model) on the run's global test set, the same
    seeded `eval.test_samples` subsample every global model is scored on, each joined model
    after its client's statistics pass as `stats_pass` rules: `global_acc`, `test_loss`,
    the unweighted means over the clients (each client's model is a model of the method;
    FedML's FedGKT server likewise averages over its clients' test features)."""

    stats_pass: StatsPassRule = "auto"
    name = "pooled global test"


@dataclass(frozen=True)
class LocalSplits:
    """Each locally evaluated client (`eval.local_eval`) on its own `split` by the method's
    local task, unweighted over clients: `local_acc` (and its groups) on the test split,
    `local_acc_stats` after the client's own statistics pass (`stats_pass`), `val_acc`,
    `val_loss` on the validation split for a method with no global model. `unless_scored`:
    asked only when the round scored nothing else (pooled clients without a sample)."""

    split: EvalSplit
    stats_pass: bool = False
    unless_scored: bool = False

    @property
    def name(self) -> str:
        return f"local {self.split}" + (" stats" if self.stats_pass else "")


@dataclass(frozen=True)
class TrainedBeforeAggregation:
    """Each trained client's model of the round, before aggregation, on its test split
    (`eval.local_trained`, `RoundLoop.trained_scores`): `local_acc_trained`."""

    name = "trained before aggregation"


Ask = (
    GlobalTest
    | GlobalValidation
    | ProbeScore
    | PooledOwnSplits
    | PooledGlobalTest
    | LocalSplits
    | TrainedBeforeAggregation
)
#: The asks scored by client tasks in the round's one exchange (`run_plan`).
ClientAsk = PooledOwnSplits | PooledGlobalTest | LocalSplits


@dataclass(frozen=True)
class EvaluationPlan:
    """The asks of every evaluated round, in the order they are scored."""

    asks: tuple[Ask, ...]

    def names(self) -> list[str]:
        return [a.name for a in self.asks]

    @property
    def scores_trained(self) -> bool:
        """Whether the trained models are scored before aggregation."""
        return any(isinstance(a, TrainedBeforeAggregation) for a in self.asks)


def build_plan(
    settings: RoundSettings,
    *,
    has_global: bool,
    pooled: bool,
    split_model: bool,
    validation: bool,
    static_bn: bool = False,
    method: str = "this method",
) -> EvaluationPlan:
    """The plan of a method that scores global models (`has_global`) or its clients' own
    splits (`pooled`), or neither (private layers: judged by local accuracy alone), under
    the run's settings; `validation` when clients hold validation splits. A pooled method
    is also scored on the global test set (`PooledGlobalTest`) with `pooled_global` or
    `require_global_test`. Refused, naming `method`, where the protocol cannot score it: a
    split model (whose client side classifies nothing) as trained, neither a global model
    nor a pooled task with `require_global_test`, global models that keep no running
    statistics (`static_bn`, HeteroFL's and FedFA's static BatchNorm) with the statistics
    pass forced off."""
    rule = settings.global_stats_pass
    if settings.local_trained and split_model:
        raise ValueError(
            "local_trained scores each client's trained model, but this method trains a "
            "split model whose client side ends before the classifier; turn it off"
        )
    if settings.require_global_test and not has_global and not pooled:
        raise ValueError(
            f"{method} cannot be scored by this evaluation protocol: eval.require_global_test "
            f"asks for a model on the global test set, but {method} has none (it is scored "
            "by local_acc alone); leave it out of the comparison or drop the requirement"
        )
    if rule == "off" and has_global and static_bn:
        raise ValueError(
            f"{method} cannot be scored by this evaluation protocol: eval.global_stats_pass "
            f"is off, but {method}'s global models keep no running BatchNorm statistics "
            "(static BatchNorm, estimated only by the pass); use auto or on"
        )
    asks: list[Ask] = []
    if has_global:
        asks.append(GlobalTest(rule))
        if validation:
            asks.append(GlobalValidation())
        asks += [ProbeScore(p.metric) for p in settings.probes]
    if pooled and (settings.pooled_global or settings.require_global_test):
        asks.append(PooledGlobalTest(rule))
    if pooled:  # the clients' own splits
        asks.append(PooledOwnSplits("test", rule))
        if validation:
            asks.append(PooledOwnSplits("validation", rule))
    if settings.local_eval != "none":
        asks.append(LocalSplits("test"))
        if settings.local_stats_pass:
            asks.append(LocalSplits("test", stats_pass=True))
        if validation and not has_global:  # no global model: each client's own
            asks.append(LocalSplits("validation", unless_scored=pooled))
    if settings.local_trained:
        asks.append(TrainedBeforeAggregation())
    return EvaluationPlan(tuple(asks))


#: `(rnd, outcome, evaluated, split, stats_pass) -> tasks`: each locally evaluated
#: client's task on its own split (`RoundLoop.local_tasks`).
LocalTasks = Callable[[int, RoundOutcome, Mapping[str, State], EvalSplit, bool], list[EvalTask]]


class Evaluates(Protocol):
    """What `run_plan` needs of an engine's round loop (`hetfl.engine.rounds.RoundLoop`)."""

    @property
    def x_test(self) -> torch.Tensor: ...

    @property
    def y_test(self) -> torch.Tensor: ...

    @property
    def validation(self) -> Pooled: ...

    @property
    def probe_samples(self) -> ProbeSamples: ...

    def tested_models(self, rnd: int, stats_pass: StatsPassRule = "auto") -> list[EvalModel]: ...

    @property
    def local_tasks(self) -> LocalTasks: ...

    def pooled_tasks(self, rnd: int, split: EvalSplit) -> list[EvalTask]: ...

    def score_clients(self, rnd: int, tasks: Sequence[EvalTask]) -> list[LocalScore]: ...

    def score_round(
        self, rnd: int, scorings: Sequence[Scoring], task_lists: Sequence[Sequence[EvalTask]]
    ) -> tuple[list[Score], list[list[LocalScore]]]: ...


class Evaluated(NamedTuple):
    """A round's scores by the plan: the global ones, the local means, and each locally
    evaluated client's score on its test split (for the per-client trace)."""

    scores: GlobalScores
    local_acc: float | None
    local_acc_stats: float | None
    local: list[LocalScore]


def run_plan(plan: EvaluationPlan, loop: Evaluates, rnd: int, outcome: RoundOutcome) -> Evaluated:
    """Score round `rnd` as `plan` asks, every ask in one `score_round`; the trained
    models' scores (`TrainedBeforeAggregation`) were taken before aggregation."""
    asks = plan.asks
    tests = [a for a in asks if isinstance(a, GlobalTest)]
    tested = loop.tested_models(rnd, tests[0].stats_pass) if tests else []
    validation = loop.validation if GlobalValidation() in asks else ()
    probes = {a.metric: loop.probe_samples[a.metric] for a in asks if isinstance(a, ProbeScore)}
    scorings = plan_global(tested, (loop.x_test, loop.y_test), validation, probes)
    evaluated = {em.name: em.tensors for em in tested}
    clients: list[ClientAsk] = [
        a
        for a in asks
        if isinstance(a, PooledOwnSplits | PooledGlobalTest)
        or (isinstance(a, LocalSplits) and not a.unless_scored)
    ]
    task_lists = [_tasks(loop, a, rnd, outcome, evaluated) for a in clients]
    answers, answered = loop.score_round(rnd, scorings.scorings, task_lists)
    scores = scorings.scores(answers)
    done = Evaluated(scores, None, None, [])
    for ask, scored in zip(clients, answered, strict=True):
        done = _read(ask, scored, done)
    for late in asks:
        unscored = scores.global_acc is None and scores.pooled_acc is None
        if isinstance(late, LocalSplits) and late.unless_scored and unscored:
            tasks = _tasks(loop, late, rnd, outcome, evaluated)
            done = _read(late, loop.score_clients(rnd, tasks), done)
    return done


def _tasks(
    loop: Evaluates,
    ask: ClientAsk,
    rnd: int,
    outcome: RoundOutcome,
    evaluated: Mapping[str, State],
) -> list[EvalTask]:
    if isinstance(ask, PooledOwnSplits | PooledGlobalTest):
        split: EvalSplit = "global" if isinstance(ask, PooledGlobalTest) else ask.split
        tasks = loop.pooled_tasks(rnd, split)
        if ask.stats_pass == "auto":
            return tasks
        return [replace(t, stats_pass=ask.stats_pass == "on") for t in tasks]
    return loop.local_tasks(rnd, outcome, evaluated, ask.split, ask.stats_pass)


def _read(ask: ClientAsk, scored: list[LocalScore], done: Evaluated) -> Evaluated:
    """`done` with the metrics `ask` fills from its clients' scores."""
    scores = done.scores
    if isinstance(ask, PooledGlobalTest):
        scores.global_acc, scores.test_loss = mean_local_scores(scored)
    elif isinstance(ask, PooledOwnSplits):
        if ask.split == "test":
            scores.pooled_acc, scores.pooled_loss = pooled_accuracy(scored)
        else:
            scores.val_acc, scores.val_loss = pooled_accuracy(scored)
    elif ask.split == "validation":
        scores.val_acc, scores.val_loss = mean_local_scores(scored)
    elif ask.stats_pass:
        return done._replace(local_acc_stats=mean_local_scores(scored)[0])
    else:
        return done._replace(local_acc=mean_local_accuracy(scored, scores.groups), local=scored)
    return done
