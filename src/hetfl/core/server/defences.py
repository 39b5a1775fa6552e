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

Each reducer records its `decisions` (`Decisions`: its kind, per added client in the order
added "kept", "clipped" or "dropped", and whether it fell back). A strategy reduces through
a `DecisionRecorder`, which keeps every reducer a round builds and gives the round's
`RoundDecisions` by client id (`hetfl.core.server.strategy.Strategy.aggregate_with_decisions`), for
the run outputs (`hetfl.engine.decisions`). The median and the trimmed mean keep every
client and decide nothing per client: they record no decisions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from hetfl.core.server.robust import CoordinateReducer, HeldClients, median
from hetfl.core.spec import IndexMap
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


class DecisionRecorder:
    """A `ReducerFactory` around the method's: builds each reducer of a round through it
    and keeps them, to read their decisions once the round is reduced."""

    def __init__(self, factory: ReducerFactory) -> None:
        self.factory = factory
        self.built: list[Reducer] = []

    def __call__(self, reference: Mapping[str, torch.Tensor]) -> Reducer:
        reducer = self.factory(reference)
        self.built.append(reducer)
        return reducer

    def decided(self, first: Sequence[int], later: Sequence[int]) -> RoundDecisions | None:
        """The round's decisions by client id, None when no reducer decided any. `first`
        names the client of each contribution of the round's first reduction (the
        strategy's: a split-learning client twice, its tensors and its server session's,
        which take the milder decision, `SEVERITY`), `later` those of every later one (the
        server update's, one per result). Where the server update reduces again (FedNova's
        normalised deltas), its decisions are the round's: that reduction moves the trainable
        parameters, the first one only what the update takes from the average (BatchNorm
        buffers). The round fell back if any reduction did."""
        found = [
            (first if i == 0 else later, decisions)
            for i, reducer in enumerate(self.built)
            if (decisions := getattr(reducer, "decisions", None)) is not None
        ]
        if not found:
            return None
        owners, last = found[-1]
        if len(owners) != len(last.per_client):
            raise ValueError(
                f"the {last.kind} reducer decided {len(last.per_client)} contributions, but "
                f"{len(owners)} clients contributed to it"
            )
        by_client: dict[int, Decision] = {}
        for cid, decision in zip(owners, last.per_client, strict=True):
            by_client[cid] = min(by_client.get(cid, "dropped"), decision, key=SEVERITY.index)
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


class KrumReducer:
    """Multi-Krum keeping `m` clients (Krum: m = 1; None: n − f), then the weighted mean;
    `kind` names it in its decisions."""

    def __init__(
        self,
        reference: Mapping[str, torch.Tensor],
        f: int,
        m: int | None,
        kind: str = "multi-krum",
    ) -> None:
        self.held, self.f, self.m, self.kind = HeldClients(reference), f, m, kind
        self.fallback = CoordinateReducer(reference, median)
        self.decisions = Decisions(kind)

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
        if not n > 2 * self.f + 2:
            self.decisions = Decisions(self.kind, ["kept"] * n, fallback=True)
            return self.fallback.result(previous, fill)
        scores = krum_scores(pairwise_distances(self.held), self.f)
        m = n - self.f if self.m is None else min(self.m, n)
        order = sorted(range(n), key=lambda i: (float(scores[i]), i))
        chosen = sorted(order[:m])
        self.decisions = Decisions(
            self.kind, ["kept" if i in chosen else "dropped" for i in range(n)]
        )
        return self.held.weighted_mean(chosen, previous, fill)


class ClippingReducer:
    """Updates clipped to `bound` (a float, or "median": the round's median norm), then the
    weighted mean."""

    def __init__(self, reference: Mapping[str, torch.Tensor], bound: float | str) -> None:
        self.held, self.bound = HeldClients(reference), bound
        self.decisions = Decisions("norm-clip")

    def add(
        self,
        local: Mapping[str, torch.Tensor],
        index_map: IndexMap,
        weight: float | Mapping[str, float] = 1.0,
        scale: Mapping[str, float] | None = None,
    ) -> None:
        self.held.add(local, index_map, weight, scale)

    def norms(self, previous: Mapping[str, torch.Tensor], fill: Fill) -> list[float]:
        """Each added client's update norm over the elements it covers."""
        return [
            math.sqrt(
                sum(float((u * u).sum()) for u in self.held.update(i, previous, fill).values())
            )
            for i in range(len(self.held))
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
            "norm-clip", ["clipped" if factors[i] < 1.0 else "kept" for i in factors]
        )
        return self.held.weighted_mean(list(factors), previous, fill, factors)
