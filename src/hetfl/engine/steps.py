"""The steps of a round that do not depend on how clients are reached.

The simulator calls clients in process, the Flower adapter (`hetfl.deploy`) over the
network; both charge costs, check results, evaluate and write metrics rows the same way,
through these functions, so that a run reports the same numbers whichever engine ran it.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import torch

from hetfl.core.client.bn_statistics import has_batch_norm
from hetfl.core.model_cache import ModelCache
from hetfl.core.pixels import PixelNorm
from hetfl.core.server.defences import RoundDecisions
from hetfl.core.server.strategy import Strategy
from hetfl.core.state import state_bytes
from hetfl.core.types import (
    ClientData,
    ClientInfo,
    ClientResult,
    ClientTask,
    ClientTimes,
    EvalSplit,
    EvalTask,
    Failure,
    Problem,
    ServerResult,
    State,
    Trained,
    TrainedRound,
)
from hetfl.engine.outputs import make_row
from hetfl.engine.validate import result_problem
from hetfl.systems.costs import MacCounter

Groups = dict[str, dict[str, float | int]]


@dataclass
class Counters:
    """Cumulative quantities since round 1; checkpointed. `failures` counts excluded
    clients by `FailureKind`; `rounds_aggregated` the rounds that aggregated any result;
    `defence` a defence's decisions (`hetfl.engine.decisions.add_round`); `breakdown` a
    coverage-aware rule's elements beyond its breakdown point (`hetfl.engine.breakdown`)."""

    bytes_down: int = 0
    bytes_up: int = 0
    macs: int = 0
    wall_time_s: float = 0.0
    sim_time_s: float = 0.0
    failures: dict[str, int] = field(default_factory=dict)
    rounds_aggregated: int = 0
    defence: dict[str, Any] = field(default_factory=dict)
    breakdown: dict[str, Any] = field(default_factory=dict)

    def count_round(self, outcome: RoundOutcome) -> None:
        """Add a trained round's charges, its failures and whether it aggregated anything."""
        for charge in outcome.charges.values():
            self.bytes_down += charge.bytes_down
            self.bytes_up += charge.bytes_up
            self.macs += charge.macs
        for kind, n in Counter(f.kind for f in outcome.failures).items():
            self.failures[kind] = self.failures.get(kind, 0) + n
        self.rounds_aggregated += bool(outcome.results)


@dataclass
class Charge:
    """What one client cost in one round, as the counters count it (see the simulator's
    counting conventions, `hetfl.sim.engine`): bytes sent down and up, MACs of training."""

    bytes_down: int = 0
    bytes_up: int = 0
    macs: int = 0


@dataclass
class RoundOutcome:
    """A round's training as an engine saw it. `results` are the valid results in client-id
    order; `server_results` is None in rounds without a server program (split learning);
    `times` holds the simulated times of the clients that returned (device profiles);
    `charges` what each asked client cost (`charge`), which `Counters.count_round` adds up
    and the per-client trace reports (`hetfl.engine.trace`); `phase_macs` and
    `phase_wall_s` the priced and measured work of the strategy's server phase, which the
    clock places after the clients (`hetfl.core.server.phase`); `defence` what the
    method's defence decided once the round is aggregated (None without one)."""

    results: list[ClientResult] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    server_results: list[ServerResult] | None = None
    times: dict[int, ClientTimes] = field(default_factory=dict)
    charges: dict[int, Charge] = field(default_factory=dict)
    phase_macs: int = 0
    phase_wall_s: float = 0.0
    defence: RoundDecisions | None = None

    def charge(self, cid: int, *, bytes_down: int = 0, bytes_up: int = 0, macs: int = 0) -> None:
        """Charge client `cid` for what it sent, received or computed this round."""
        charge = self.charges.setdefault(cid, Charge())
        charge.bytes_down += bytes_down
        charge.bytes_up += bytes_up
        charge.macs += macs

    def trained_round(self, tasks: Sequence[ClientTask]) -> TrainedRound:
        """The hand-off to `Strategy.aggregate`: each valid result with the task it answered."""
        by_cid = {t.cid: t for t in tasks}
        served = self.server_results
        return TrainedRound(
            tuple(Trained(by_cid[r.cid], r) for r in self.results),
            tuple(self.failures),
            None if served is None else tuple(served),
        )


def every_client_failed(rnd: int, outcome: RoundOutcome) -> str:
    """The console line for a round in which every asked client failed: nothing was
    aggregated, so the global model did not move."""
    kinds = Counter(f.kind for f in outcome.failures)
    counts = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
    return (
        f"warning: round {rnd}: every client failed ({counts}); nothing was aggregated "
        f"and the global model is unchanged"
    )


def task_bytes(task: ClientTask) -> int:
    """The bytes a task sends down: its payload and the download delivered with it (a
    server phase's answer, charged in the round it is delivered)."""
    return state_bytes(task.payload) + state_bytes(task.download)


def charge_result(
    outcome: RoundOutcome,
    macs: MacCounter,
    task: ClientTask,
    result: ClientResult,
    input_shape: tuple[int, ...],
) -> Problem | None:
    """Charge a returned result's upload (its tensors and its declared non-parameter
    uploads) and training MACs to its client, then check it against its task.

    Both are charged before the check: an invalid result still crossed the network and
    still cost its client the compute. Returns why the result cannot be aggregated, or None.
    """
    outcome.charge(
        task.cid,
        bytes_up=state_bytes(result.tensors) + state_bytes(result.uploads),
        macs=macs.price(result.passes, input_shape),
    )
    return result_problem(result, task)


@dataclass
class GlobalScores:
    """The strategy's evaluated models on the global test set: the first one's accuracy and
    loss (None when the method has no global model), each grouped model's accuracy, each
    model's tensors as tested (after its statistics pass), by name, for the strategy's
    local evaluation (`Strategy.eval_task(info, state, evaluated)`); `val_acc`/`val_loss` are the
    main model's on the validation splits (None without); `probes` the main model's accuracy
    on each probe's samples by its metric (`hetfl.core.probe`: `attack_success`; absent,
    hence null, without the probe)."""

    global_acc: float | None = None
    test_loss: float | None = None
    #: A method without one global model, scored on its clients' own test splits pooled by
    #: samples (FedGKT): never `global_acc`, which always means the global test set.
    pooled_acc: float | None = None
    pooled_loss: float | None = None
    groups: Groups = field(default_factory=dict)
    models: dict[str, State] = field(default_factory=dict)
    val_acc: float | None = None
    val_loss: float | None = None
    probes: dict[str, float] = field(default_factory=dict)


#: The pooled validation samples of all clients: one (x, y) per input shape, clients in
#: id order (client views may resize some clients' images).
Pooled = Sequence[tuple[torch.Tensor, torch.Tensor]]


def run_pixels(clients: Sequence[ClientData]) -> PixelNorm | None:
    """The pixel statistics the run's clients share, which standardise the global test and
    pooled validation samples too (all clients come from one dataset)."""
    kinds = {c.pixels for c in clients}
    if len(kinds) > 1:
        raise ValueError(f"clients hold inputs with different pixel statistics: {kinds}")
    return kinds.pop() if kinds else None


def pooled_validation(clients: Sequence[ClientData]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every client's validation split, in client id order, concatenated per input shape;
    empty when no client holds one."""
    by_shape: dict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for c in sorted(clients, key=lambda c: c.cid):
        x, y = c.split("validation")
        if y.numel():
            by_shape.setdefault(tuple(x.shape[1:]), []).append((x, y))
    return [
        (torch.cat([x for x, _ in splits]), torch.cat([y for _, y in splits]))
        for splits in by_shape.values()
    ]


def local_task(
    strategy: Strategy,
    info: ClientInfo,
    state: State,
    evaluated: Mapping[str, State],
    split: EvalSplit,
    stats_pass: bool,
) -> EvalTask:
    """The strategy's local-evaluation task for a client (`Strategy.eval_task`), on `split`;
    with `stats_pass`, the client re-estimates its model's BatchNorm statistics on its own
    training data first (`eval.stats_pass`: the model as loaded, for this evaluation only;
    its stored private state is not changed)."""
    task = strategy.eval_task(info, state, evaluated)
    return replace(task, split=split, stats_pass=task.stats_pass or stats_pass)


def trained_eval_task(
    task: ClientTask, result: ClientResult, info: ClientInfo, models: ModelCache
) -> EvalTask:
    """How `eval.local_trained` judges a client that trained this round, the same for every
    method: its model right after local training, before aggregation (the tensors it sent,
    which are weights, and the private tensors it kept), on its local test split, with the
    logits of the classes outside its training labels set to 0 (`info.labels`, a no-op for
    a client holding every class), after a statistics pass over its own training data when
    the model has BatchNorm layers (their running statistics are re-estimated; other
    normalisations, FjORD's per-width statistics, are used as trained). A model whose
    family names an `evaluation_spec` (a static-BN spec: the same model with running
    statistics and without HeteroFL's training-only scaler) is evaluated through it.

    FedFA (Park and Joe-Wong, ECML-PKDD 2024, §5.1) reports this "local accuracy of local
    models after local training and before aggregation"; `models` (the engine's evaluation
    cache) says whether the evaluated model has BatchNorm layers."""
    evaluation_spec = getattr(models.family, "evaluation_spec", None)
    spec = task.spec if evaluation_spec is None else evaluation_spec(task.spec)
    return EvalTask(
        cid=task.cid,
        spec=spec,
        payload=result.tensors,
        index_map=task.index_map,
        stats_pass=has_batch_norm(models.model_for(spec)),
        label_mask=info.labels,
    )


class LocalScore(NamedTuple):
    """Client `cid`'s model evaluated on one of its own splits (`EvalTask.split`), of `n`
    samples."""

    cid: int
    acc: float
    loss: float
    group: str | None
    n: int = 0


class LanguageScores(NamedTuple):
    """A language-model round's local scores, for its perplexities: the locally evaluated
    clients' (`local_ppl`) and the trained clients' right after training
    (`local_ppl_trained`, with `eval.local_trained`)."""

    local: Sequence[LocalScore]
    trained: Sequence[LocalScore]


def pooled_accuracy(scores: Sequence[LocalScore]) -> tuple[float | None, float | None]:
    """(accuracy, mean loss) over every sample of the clients' splits, each client weighted
    by its `n` (None when no sample was scored): `pooled_acc` and `pooled_loss`."""
    n = sum(s.n for s in scores)
    if not n:
        return None, None
    return sum(s.acc * s.n for s in scores) / n, sum(s.loss * s.n for s in scores) / n


def mean_local_accuracy(evaluated: Sequence[LocalScore], groups: Groups) -> float | None:
    """The unweighted mean of per-client local accuracies (None if no client was
    evaluated); each client group's mean and count are added to `groups`."""
    per_group: dict[str, list[float]] = {}
    for score in evaluated:
        if score.group is not None:
            per_group.setdefault(score.group, []).append(score.acc)
    for g, values in per_group.items():
        groups[g] = {"acc": sum(values) / len(values), "n": len(values)}
    return mean_local_scores(evaluated)[0]


def mean_local_scores(evaluated: Sequence[LocalScore]) -> tuple[float | None, float | None]:
    """The unweighted means over clients of accuracy and loss (None if none was evaluated)."""
    if not evaluated:
        return None, None
    n = len(evaluated)
    return sum(s.acc for s in evaluated) / n, sum(s.loss for s in evaluated) / n


def perplexity(loss: float) -> float:
    """exp(mean token cross-entropy): a language model's loss as a perplexity (a loss past
    exp's float range is an infinite perplexity)."""
    return math.exp(loss) if loss < _LARGEST_EXPONENT else math.inf


#: The largest x whose exp(x) a float holds (exp(709.78) is the largest double).
_LARGEST_EXPONENT = 709.0


def mean_local_perplexity(evaluated: Sequence[LocalScore]) -> float | None:
    """The unweighted mean over clients of each one's perplexity on its split, FedFA's
    "average local perplexity" (Park and Joe-Wong, ECML-PKDD 2024, §5, Table 3); None
    when no client was evaluated."""
    if not evaluated:
        return None
    return sum(perplexity(s.loss) for s in evaluated) / len(evaluated)


def metrics_row(
    rnd: int,
    outcome: RoundOutcome,
    scores: GlobalScores,
    local_acc: float | None,
    counters: Counters,
    sim_time_s: float | None = None,
    *,
    local_acc_trained: float | None = None,
    local_acc_stats: float | None = None,
    defence: dict[str, Any] | None = None,
    language: LanguageScores | None = None,
    detection: bool = False,
) -> dict[str, Any]:
    """One `metrics.jsonl` row; `loss` is the sample-weighted mean over valid results;
    `defence` the round's decisions (`hetfl.engine.decisions.defence_row`); `language`,
    for a language-model task (token inputs), the local scores the perplexities come
    from (else they are null); with `detection` (the recipe scores a detector), the scores
    are mAPs (`detection_scores`). `wall_time_s` is set by the engine once the round's time
    is known."""
    if detection:
        scores, local_acc, maps = detection_scores(scores, local_acc)
        local_acc_trained = local_acc_stats = None
    else:
        maps = {}
    ppl = {}
    if language is not None:
        ppl = {
            "global_ppl": None if scores.test_loss is None else perplexity(scores.test_loss),
            "local_ppl": mean_local_perplexity(language.local),
            "local_ppl_trained": mean_local_perplexity(language.trained),
        }
    results = outcome.results
    n_ex = sum(r.num_examples for r in results)
    loss = sum(r.loss * r.num_examples for r in results) / n_ex if n_ex else None
    return make_row(
        round=rnd,
        clients=len(results),
        failed=len(outcome.failures),
        global_acc=scores.global_acc,
        test_loss=scores.test_loss,
        pooled_acc=scores.pooled_acc,
        pooled_loss=scores.pooled_loss,
        local_acc=local_acc,
        local_acc_stats=local_acc_stats,
        local_acc_trained=local_acc_trained,
        loss=loss,
        bytes_down=counters.bytes_down,
        bytes_up=counters.bytes_up,
        macs=counters.macs,
        sim_time_s=sim_time_s,
        groups=scores.groups,
        val_acc=scores.val_acc,
        val_loss=scores.val_loss,
        defence=defence,
        **scores.probes,
        **ppl,
        **maps,
    )


def detection_scores(
    scores: GlobalScores, local_acc: float | None
) -> tuple[GlobalScores, None, dict[str, float | None]]:
    """A detection round's scores, which the scoring gave in accuracy's place
    (`hetfl.core.client.detection_scoring`), under their names: the global model's as
    `global_map`, the unweighted mean of the clients' mAPs on their local splits as
    `local_map`, each group's as its `map`; the accuracies are null."""
    groups = {
        g: {"map" if k == "acc" else k: v for k, v in e.items()} for g, e in scores.groups.items()
    }
    maps = {"global_map": scores.global_acc, "local_map": local_acc}
    return replace(scores, global_acc=None, pooled_acc=None, groups=groups), None, maps
