"""Robust defences over heterogeneous sub-models: norm clipping, Krum and Multi-Krum, each
a reducer (`hetfl.core.state.Reducer`) computed in global coordinates over the elements each
client covers.

- **Norm clipping** (Sun et al., "Can You Really Backdoor Federated Learning?", 2019, §3:
  norm thresholding of updates). A client's update is its values minus the previous global
  values (`fill="keep"`: weights), or its values (`fill="zero"`: the strategy reduces
  deltas), over the elements it covers; its L2 norm runs over those elements, each global
  element once. An update longer than the bound is scaled down to it: the bound is fixed
  (`bound`) or the median of the round's update norms (`bound: median`). The clipped values
  are then reduced by the method's weighted mean, as the `Accumulator` reduces them.
- **Krum and Multi-Krum** (Blanchard et al., "Machine Learning with Adversaries: Byzantine
  Tolerant Gradient Descent", NeurIPS 2017, §4). With n clients of which at most f are
  Byzantine, a client's score is the sum of its squared distances to its n − f − 2 nearest
  others; Multi-Krum keeps the m clients of lowest score (Krum: m = 1; default m = n − f)
  and reduces them by the method's weighted mean. The paper's clients all have one shape;
  here the distance between two clients runs over the global elements **both** cover,
  normalised by their count (a mean squared difference), so that a client with a larger
  sub-model is not farther for covering more. A client covering an element several times
  (FedFA's grafted repeats) counts once there, with the mean of its values (`place`). Two
  clients that share no element are at an infinite distance. Ties go to the earlier client
  (the strategy adds clients in id order).
- **The run-time fallback.** Krum needs n > 2f + 2 (Blanchard et al., Proposition 1):
  configs are checked at set-up against the clients per round, but a round may return
  fewer valid results (failures, deadlines); such a round is reduced by the coordinate-wise
  median (`hetfl.core.server.robust`) instead, and the reducer's `decisions` say so.

- **BatchNorm statistics, whatever the reducer** (`StatisticsGuard`). A mean of running
  variances is a variance only if each one is: one negative or non-finite running variance
  (or non-finite running mean) in an upload, averaged in, can make the global variance
  negative, and the global model then outputs NaN. Every reducer a round builds stands
  behind a guard that refuses such a client (its whole contribution: the rest of an upload
  that lies about its statistics is not trusted either), recorded "dropped" under the kind
  `STATISTICS_KIND` when the reducer itself decides nothing, or among the reducer's own
  decisions. The server's reducers see global names and values only, no model: a running
  statistic is known by the buffer names PyTorch's normalisation layers register
  (`running_mean`, `running_var`) and HetFL's per-level ones (`running_var_<level>`,
  `hetfl.models.slim`), the one place generic code reads a tensor's name.

Each reducer records its `decisions` (`Decisions`: its kind, per added client in the order
added "kept", "clipped" or "dropped", and whether it fell back). A strategy reduces through
a `DecisionRecorder`, which keeps every reducer a round builds (each behind its
`StatisticsGuard`) and gives the round's `RoundDecisions` by client id
(`hetfl.core.server.strategy.Strategy.aggregate`), for the run outputs
(`hetfl.engine.decisions`). The median and the trimmed mean keep every client and decide
nothing per client: they record no decisions unless the guard refuses a client.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from hetfl.core.server.robust import (
    Beyond,
    Breakdown,
    CoordinateReducer,
    HeldClients,
    beyond_breakdown,
    median,
    warn_beyond,
)
from hetfl.core.spec import IndexMap, first_entries
from hetfl.core.state import (
    Fill,
    Reducer,
    ReducerFactory,
    State,
    check_fill,
    untouched,
)

Decision = Literal["kept", "clipped", "dropped"]
#: From the mildest to the severest: a client with two contributions to one reduction (split
#: learning's client and server parts) takes the milder decision.
SEVERITY: tuple[Decision, ...] = ("kept", "clipped", "dropped")


@dataclass
class Decisions:
    """What a defence of `kind` (its reducer kind's name) did with each added client, in
    the order added, and whether the reduction fell back to the median."""

    kind: str
    per_client: list[Decision] = field(default_factory=list)
    fallback: bool = False


@dataclass(frozen=True)
class RoundDecisions:
    """What a round's defence decided for each trained client (by client id), and whether
    any of its reductions fell back to the median."""

    kind: str
    by_client: dict[int, Decision]
    fallback: bool


#: The kind a round's decisions carry when only the `StatisticsGuard` decided (the reducer,
#: the mean or a coordinate-wise statistic, decides nothing per client).
STATISTICS_KIND = "batchnorm-statistics"


def _is_statistic(global_name: str, statistic: str) -> bool:
    leaf = global_name.rsplit(".", 1)[-1]
    return leaf == statistic or leaf.startswith(f"{statistic}_")


def invalid_statistics(local: Mapping[str, torch.Tensor], index_map: IndexMap) -> str | None:
    """What is wrong with the BatchNorm running statistics one contribution uploads (a
    negative or non-finite running variance, a non-finite running mean, over the elements
    its entries' masks upload), or None when they are valid or absent."""
    for entry in index_map:
        variance = _is_statistic(entry.global_name, "running_var")
        if not (variance or _is_statistic(entry.global_name, "running_mean")):
            continue
        values = local[entry.local].detach()
        if entry.mask is not None:
            values = values[entry.mask.to(values.device).bool()]
        if not bool(torch.isfinite(values).all()):
            return f"{entry.global_name!r} has non-finite values"
        if variance and bool((values < 0).any()):
            return f"{entry.global_name!r} has negative variances (min {float(values.min())})"
    return None


class StatisticsGuard:
    """A reducer in front of another (`inner`): refuses each contribution whose BatchNorm
    statistics are invalid (`invalid_statistics`), and those at the positions in `refuse`
    (a client refused by an earlier reduction of the round), and passes the others on."""

    def __init__(self, inner: Reducer, refuse: frozenset[int] = frozenset()) -> None:
        self.inner, self.refuse = inner, refuse
        self.refused: list[bool] = []

    def add(
        self,
        local: Mapping[str, torch.Tensor],
        index_map: IndexMap,
        weight: float | Mapping[str, float] = 1.0,
        scale: Mapping[str, float] | None = None,
    ) -> None:
        position = len(self.refused)
        bad = position in self.refuse or invalid_statistics(local, index_map) is not None
        self.refused.append(bad)
        if not bad:
            self.inner.add(local, index_map, weight, scale)

    def result(self, previous: Mapping[str, torch.Tensor], fill: Fill = "keep") -> State:
        return self.inner.result(previous, fill)

    @property
    def decisions(self) -> Decisions | None:
        """The inner reducer's decisions with a "dropped" at each refused position, or None
        when neither decided anything."""
        inner: Decisions | None = getattr(self.inner, "decisions", None)
        if inner is None and not any(self.refused):
            return None
        passed = iter(inner.per_client if inner is not None else [])
        per_client: list[Decision] = [
            "dropped" if bad else next(passed, "kept") for bad in self.refused
        ]
        if inner is None:
            return Decisions(STATISTICS_KIND, per_client)
        return Decisions(inner.kind, per_client, inner.fallback)


class DecisionRecorder:
    """A `ReducerFactory` around the method's: builds each reducer of a round through it,
    behind a `StatisticsGuard`, and keeps them, to read their decisions once the round is
    reduced. A reduction after the first (the server update's, one contribution per result:
    FedNova's normalised deltas, which carry no statistics) refuses the positions the first
    one refused, so that a refused client is refused in the whole round; `decided` checks
    that those positions were the same clients."""

    def __init__(self, factory: ReducerFactory) -> None:
        self.factory = factory
        self.built: list[StatisticsGuard] = []

    def __call__(self, reference: Mapping[str, torch.Tensor]) -> Reducer:
        earlier = self.built[0].refused if self.built else []
        refuse = frozenset(i for i, bad in enumerate(earlier) if bad)
        guard = StatisticsGuard(self.factory(reference), refuse)
        self.built.append(guard)
        return guard

    def beyond(self) -> Beyond | None:
        """The round's elements beyond the breakdown point: of the reductions whose reducer
        counts them (a coverage-aware rule's `beyond`), the one with the largest share (the
        first of equal ones); None when no reducer counts them."""
        counted = [b for g in self.built if (b := getattr(g.inner, "beyond", None)) is not None]
        return max(counted, key=lambda b: b.share, default=None)

    def decided(self, first: Sequence[int], later: Sequence[int]) -> RoundDecisions | None:
        """The round's decisions by client id, None when no reducer decided any. `first`
        names the client of each contribution of the round's first reduction (the
        strategy's: a split-learning client twice, its tensors and its server session's,
        which take the milder decision, `SEVERITY`), `later` those of every later one (the
        server update's, one per result). Where the server update reduces again (FedNova's
        normalised deltas), its decisions are the round's: that reduction moves the trainable
        parameters, the first one only what the update takes from the average (BatchNorm
        buffers). A client whose upload the first reduction's guard refused is "dropped",
        whatever else decided. The round fell back if any reduction did."""
        found = [
            (first if i == 0 else later, decisions)
            for i, reducer in enumerate(self.built)
            if (decisions := reducer.decisions) is not None
        ]
        if not found:
            return None
        if any(self.built[0].refused) and len(self.built) > 1 and list(first) != list(later):
            raise ValueError(
                "a client was refused for its BatchNorm statistics in a round whose later "
                "reductions take other contributions than the first (a split-learning server "
                "update): the refusal cannot follow the client there"
            )
        owners, last = found[-1]
        if len(owners) != len(last.per_client):
            raise ValueError(
                f"the {last.kind} reducer decided {len(last.per_client)} contributions, but "
                f"{len(owners)} clients contributed to it"
            )
        by_client: dict[int, Decision] = {}
        for cid, decision in zip(owners, last.per_client, strict=True):
            by_client[cid] = min(by_client.get(cid, "dropped"), decision, key=SEVERITY.index)
        for cid, bad in zip(first, self.built[0].refused, strict=True):
            if bad:  # a refused upload outweighs its split-learning server session's decision
                by_client[cid] = "dropped"
        return RoundDecisions(
            last.kind,
            dict(sorted(by_client.items())),
            any(decisions.fallback for _, decisions in found),
        )


def pairwise_distances(held: HeldClients) -> torch.Tensor:
    """(n, n) float64: the mean squared difference of two clients over the global elements
    both cover (infinite where they share none; 0 on the diagonal)."""
    n = len(held)
    sq = torch.zeros(n, n, dtype=torch.float64)
    shared = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        for j in range(i + 1, n):
            for name, vi in held.values[i].items():
                if name not in held.values[j]:
                    continue
                both = held.covered[i][name] & held.covered[j][name]
                diff = torch.where(both, vi - held.values[j][name], 0.0)
                sq[i, j] += float((diff * diff).sum())
                shared[i, j] += float(both.sum())
            sq[j, i], shared[j, i] = sq[i, j], shared[i, j]
    dist = torch.where(shared > 0, sq / shared.clamp(min=1), math.inf)
    dist.fill_diagonal_(0.0)
    return dist


def krum_scores(dist: torch.Tensor, f: int) -> torch.Tensor:
    """Each client's sum of distances to its n − f − 2 nearest others (Blanchard et al., §4)."""
    n = dist.shape[0]
    nearest = n - f - 2
    others = dist + torch.diag(torch.full((n,), math.inf, dtype=dist.dtype))
    return torch.sort(others, dim=1).values[:, :nearest].sum(dim=1)


def check_krum(f: int, n: int) -> None:
    """ValueError unless n > 2f + 2 (Krum's condition)."""
    if not n > 2 * f + 2:
        raise ValueError(
            f"Krum with f = {f} needs more than 2f + 2 = {2 * f + 2} clients per round, got "
            f"{n}; lower f (at most {max((n - 3) // 2, 0)}) or ask more clients per round"
        )


def shared_element_scores(held: HeldClients, f: int) -> torch.Tensor:
    """Krum's scores over the elements each pair shares (`pairwise_distances`): the naive
    baseline over heterogeneous sub-models."""
    return krum_scores(pairwise_distances(held), f)


#: How a Krum reducer scores its held clients, (clients, f) -> (n,) scores, lowest kept.
KrumScores = Callable[[HeldClients, int], torch.Tensor]


class KrumReducer:
    """Multi-Krum keeping `m` clients (Krum: m = 1; None: n − f), then the weighted mean;
    `kind` names it in its decisions, `scores` scores the clients (the naive
    `shared_element_scores`, or `hetfl.core.server.cell_krum.cell_scores`). With a
    `breakdown` (the coverage-aware kinds), each result counts in `beyond` the elements
    covered by k <= 2f clients, where f Byzantine clients can be half or more of the
    coverage (`beyond_breakdown`), and the run's first such result warns."""

    def __init__(
        self,
        reference: Mapping[str, torch.Tensor],
        f: int,
        m: int | None,
        kind: str = "multi-krum",
        scores: KrumScores = shared_element_scores,
        breakdown: Breakdown | None = None,
    ) -> None:
        self.held, self.f, self.m, self.kind = HeldClients(reference), f, m, kind
        self.scores, self.breakdown = scores, breakdown
        self.fallback = CoordinateReducer(reference, median)
        self.decisions = Decisions(kind)
        self.beyond: Beyond | None = None

    def add(
        self,
        local: Mapping[str, torch.Tensor],
        index_map: IndexMap,
        weight: float | Mapping[str, float] = 1.0,
        scale: Mapping[str, float] | None = None,
    ) -> None:
        self.held.add(local, index_map, weight, scale)
        self.fallback.add(local, index_map, weight, scale)

    def result(self, previous: Mapping[str, torch.Tensor], fill: Fill = "keep") -> State:
        check_fill(fill)
        n = len(self.held)
        if self.breakdown is not None:
            self.beyond = beyond_breakdown(self.held, self.f)
            if self.beyond.elements and not self.breakdown.warned:
                self.breakdown.warned = True
                warn_beyond(self.beyond, n, f"{self.kind} with f = {self.f}")
        if not n > 2 * self.f + 2:
            self.decisions = Decisions(self.kind, ["kept"] * n, fallback=True)
            return self.fallback.result(previous, fill)
        scores = self.scores(self.held, self.f)
        m = n - self.f if self.m is None else min(self.m, n)
        order = sorted(range(n), key=lambda i: (float(scores[i]), i))
        chosen = sorted(order[:m])
        self.decisions = Decisions(
            self.kind, ["kept" if i in chosen else "dropped" for i in range(n)]
        )
        return self.held.weighted_mean(chosen, previous, fill)


#: What a clipping rule measures a client's update on: `upload`, the values the method
#: reduces (after its round-level scaling, such as FedFA's α, and over every element an
#: entry repeats into, such as FedFA's grafted blocks: the naive rule); `trained`, each of
#: the client's tensors once, at the place it was downloaded from (its first map entry,
#: `first_entries`) and before any scaling: what its training changed.
Measure = Literal["upload", "trained"]


class ClippingReducer:
    """Updates clipped to `bound` (a float, or "median": the round's median norm), then the
    weighted mean. The norm is measured on the upload or on what the client trained
    (`measure`); the factor it gives is applied to the update the method reduces."""

    def __init__(
        self,
        reference: Mapping[str, torch.Tensor],
        bound: float | str,
        measure: Measure = "upload",
        kind: str = "norm-clip",
    ) -> None:
        self.held, self.bound, self.kind = HeldClients(reference), bound, kind
        self.measured = self.held if measure == "upload" else HeldClients(reference)
        self.decisions = Decisions(kind)

    def add(
        self,
        local: Mapping[str, torch.Tensor],
        index_map: IndexMap,
        weight: float | Mapping[str, float] = 1.0,
        scale: Mapping[str, float] | None = None,
    ) -> None:
        self.held.add(local, index_map, weight, scale)
        if self.measured is not self.held:
            self.measured.add(local, list(first_entries(index_map).values()), weight)

    def norms(self, previous: Mapping[str, torch.Tensor], fill: Fill) -> list[float]:
        """Each added client's update norm over the elements it covers (as measured)."""
        held = self.measured
        return [
            math.sqrt(sum(float((u * u).sum()) for u in held.update(i, previous, fill).values()))
            for i in range(len(held))
        ]

    def result(self, previous: Mapping[str, torch.Tensor], fill: Fill = "keep") -> State:
        check_fill(fill)
        norms = self.norms(previous, fill)
        if not norms:
            return {name: untouched(p, fill) for name, p in previous.items()}
        ordered, k = sorted(norms), len(norms)
        # the median norm: the mean of the two middle ones for an even count
        median_norm = (ordered[(k - 1) // 2] + ordered[k // 2]) / 2
        bound = median_norm if self.bound == "median" else float(self.bound)
        factors = {i: (bound / x if x > bound else 1.0) for i, x in enumerate(norms)}
        self.decisions = Decisions(
            self.kind, ["clipped" if factors[i] < 1.0 else "kept" for i in factors]
        )
        return self.held.weighted_mean(list(factors), previous, fill, factors)
