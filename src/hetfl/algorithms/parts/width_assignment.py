"""Which width level each client trains: `WidthAssignment` (a `hetfl.core.server.assign.Assignment`)
and its draws, shared by HeteroFL, FjORD and FLANC: fixed proportions, a level redrawn per
client and round, FLANC's joint draw until every level appears, and declared capacities
quantised to the levels.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Annotated, Literal, get_args

import torch
from pydantic import Field

from hetfl.algorithms.parts.widths import LevelSpec, shares
from hetfl.core.spec import Spec
from hetfl.core.types import ClientInfo


def assign_in_proportion(
    cids: Sequence[int], levels: Sequence[float], proportions: Sequence[float] | None
) -> dict[int, float]:
    """Fixed assignment: clients in id order take the levels in the given proportions,
    the count of each level rounded so that the counts add up to the number of clients
    (client ids are exchangeable: partitions are drawn at random)."""
    order = sorted(cids)
    cum, bounds = 0.0, []
    for q in shares(levels, proportions):
        cum += q
        bounds.append(math.floor(cum * len(order) + 0.5))
    out: dict[int, float] = {}
    start = 0
    for level, end in zip(levels, bounds, strict=True):
        out.update({cid: float(level) for cid in order[start:end]})
        start = end
    return out


def draw_level(
    levels: Sequence[float], proportions: Sequence[float] | None, rng: torch.Generator
) -> float:
    """One level drawn in the given proportions (HeteroFL's dynamic assignment)."""
    weights = torch.tensor(shares(levels, proportions), dtype=torch.float64)
    return float(levels[int(torch.multinomial(weights, 1, generator=rng))])


#: How a client's width level is chosen (`WidthAssignment`).
AssignmentMode = Literal["fixed", "dynamic", "dynamic-all-levels", "declared"]
ASSIGNMENT_MODES: tuple[str, ...] = get_args(AssignmentMode)

# The options the width-sliced methods share, each with its description written once.
Levels = Annotated[
    tuple[float, ...],
    Field(description="the width ratios in (0, 1] of the full model that clients train"),
]
Proportions = Annotated[
    tuple[float, ...] | None,
    Field(
        description="the share of clients (fixed) or of draws (dynamic) of each level, paired "
        "with levels in their order (default: equal shares)"
    ),
]
Assignment = Annotated[
    AssignmentMode,
    Field(
        description="how a client's level is chosen: fixed, dealt at set-up in proportion, "
        "narrowest first by client id; dynamic, redrawn per client and round; "
        "dynamic-all-levels, the round's clients redrawn together until every level appears; "
        "declared, the client's capacity quantised down to a level"
    ),
]
Capacities = Annotated[
    tuple[float, ...] | None,
    Field(
        description="declared: the capacity of the i-th client in client-id order, used when "
        "it declares none itself (attrs['capacity'])"
    ),
]


def quantise_capacity(capacity: float, levels: Sequence[float], cid: int) -> float:
    """The largest level not above a client's continuous `capacity`: FLANC's
    pre-clustering of capacities (Mei et al., "Resource-Adaptive Federated Learning with
    All-In-One Neural Composition", NeurIPS 2022, supplementary §4.2 and §5, Table 3: a
    device runs the widest model it can afford). A capacity below every level is an error
    naming the client: no model fits it."""
    if not (isinstance(capacity, int | float) and math.isfinite(capacity)):
        raise ValueError(f"client {cid} declares capacity {capacity!r}; need a finite number")
    fitting = [q for q in levels if q <= capacity + 1e-12]
    if not fitting:
        raise ValueError(
            f"client {cid} declares capacity {capacity:g}, below the smallest level "
            f"{min(levels):g}: no model of the levels {sorted(levels)} fits it; add a smaller "
            "level or leave the client out"
        )
    return float(max(fitting))


def draw_every_level(
    levels: Sequence[float], proportions: Sequence[float] | None, n: int, rng: torch.Generator
) -> list[float]:
    """`n` levels drawn independently in the given proportions, redrawn until every level
    appears (as many distinct levels as `n` allows): the draw of FLANC's code
    (HarukiYqM/All-In-One-Neural-Composition, `trainer_FL.py: train`, "we sample all model
    size for all methods"). Levels with a zero proportion are never drawn."""
    weights = torch.tensor(shares(levels, proportions), dtype=torch.float64)
    want = min(n, int((weights > 0).sum()))
    while True:
        drawn = torch.multinomial(weights, n, replacement=True, generator=rng).tolist()
        if len(set(drawn)) == want:
            return [float(levels[i]) for i in drawn]


def check_every_level_fits(mode: str, levels: Sequence[float], clients_per_round: int) -> None:
    """Refuse `dynamic-all-levels` with fewer clients per round than levels: every level
    could never appear in a round."""
    if mode == "dynamic-all-levels" and clients_per_round < len(levels):
        raise ValueError(
            f"assignment 'dynamic-all-levels' draws every one of the {len(levels)} levels "
            f"{sorted(levels)} each round, but train.clients_per_round is {clients_per_round}; "
            f"ask at least {len(levels)} clients per round, or use assignment 'dynamic'"
        )


class WidthAssignment:
    """Width levels of the configured (full-width) model, chosen by `mode`:

    - `fixed`: each client gets a level in fixed proportions at set-up
      (`assign_in_proportion`: in client id order, narrowest first);
    - `dynamic`: a sampled client trains a level redrawn every round in those proportions
      (HeteroFL's dynamic assignment: Diao et al., "HeteroFL", §3);
    - `dynamic-all-levels`: the round's clients draw their levels together, redrawn until
      every level appears (`draw_every_level`, FLANC's code);
    - `declared`: a client's continuous capacity (`attrs["capacity"]`, or `capacities[i]`
      for the i-th client in id order when it declares none) quantised to the largest level
      not above it (`quantise_capacity`), fixed for the run.

    Its largest spec is the widest level's (`KnowsLargest`, for `LargestClaims`, which
    gives it to a client claiming the largest model in every mode).

    `levels` and `proportions` as `check_levels` returns them."""

    def __init__(
        self,
        levels: Sequence[float],
        proportions: Sequence[float] | None,
        level_spec: LevelSpec,
        *,
        mode: AssignmentMode = "fixed",
        capacities: Sequence[float] | None = None,
    ) -> None:
        if mode not in ASSIGNMENT_MODES:
            raise ValueError(f"assignment {mode!r} is not one of {', '.join(ASSIGNMENT_MODES)}")
        self.levels, self.proportions = list(levels), proportions
        self.level_spec, self.mode = level_spec, mode
        self.capacities = None if capacities is None else list(capacities)
        self.level_of: dict[int, float] = {}
        self._clients: list[int] = []

    @property
    def dynamic(self) -> bool:
        """Whether a client's level changes from round to round."""
        return self.mode in ("dynamic", "dynamic-all-levels")

    def setup(self, clients: Sequence[ClientInfo]) -> None:
        self._clients = [c.cid for c in clients]
        if self.mode == "declared":
            self.level_of = self._declared_levels(clients)
        else:
            self.level_of = assign_in_proportion(self._clients, self.levels, self.proportions)

    def largest_spec(self) -> Spec:
        """The widest level's spec."""
        return self.level_spec(max(self.levels))

    def give_largest(self, cid: int) -> None:
        """Client `cid` trains the widest level (a claim, `LargestClaims`)."""
        self.level_of[cid] = max(self.levels)

    def _declared_levels(self, clients: Sequence[ClientInfo]) -> dict[int, float]:
        out: dict[int, float] = {}
        for i, info in enumerate(sorted(clients, key=lambda c: c.cid)):
            capacity = info.attrs.get("capacity")
            if capacity is None and self.capacities is not None and i < len(self.capacities):
                capacity = self.capacities[i]
            if capacity is None:
                given = "none" if self.capacities is None else len(self.capacities)
                raise ValueError(
                    f"assignment 'declared': client {info.cid} declares no capacity (attrs "
                    f"'capacity') and the option capacities lists {given} value(s) for "
                    f"{len(clients)} clients"
                )
            out[info.cid] = quantise_capacity(capacity, self.levels, info.cid)
        return out

    def level(self, info: ClientInfo) -> float:
        """A client's fixed level: the widest for a client unknown at set-up, except under
        `declared`, where only a declared capacity sets a level (an error naming it)."""
        if info.cid in self.level_of:
            return self.level_of[info.cid]
        if self.mode == "declared":
            raise ValueError(
                f"assignment 'declared': client {info.cid} was not among the clients at "
                f"set-up ({len(self._clients)} clients), so it has no declared capacity and "
                "no level; declare every client before the run starts"
            )
        return max(self.levels)

    def spec_of(self, info: ClientInfo) -> Spec:
        return self.level_spec(self.level(info))

    def spec_in_round(self, round: int, info: ClientInfo, rng: torch.Generator) -> Spec:
        return self.specs_in_round(round, [info], rng)[0]

    def specs_in_round(
        self, round: int, infos: Sequence[ClientInfo], rng: torch.Generator
    ) -> list[Spec]:
        """The specs of a round's sampled clients, in their order."""
        if self.mode == "dynamic-all-levels":
            drawn = draw_every_level(self.levels, self.proportions, len(infos), rng)
        elif self.mode == "dynamic":
            drawn = [draw_level(self.levels, self.proportions, rng) for _ in infos]
        else:
            return [self.spec_of(info) for info in infos]
        return [self.level_spec(p) for p in drawn]

    def trained_levels(self) -> list[float]:
        """The levels some client may train, narrowest first."""
        if self.dynamic:
            return list(self.levels)
        return sorted({self.level_of[cid] for cid in self._clients})

    def possible_specs(self) -> list[Spec]:
        if self.dynamic:
            return [self.level_spec(r) for r in self.levels]
        return [self.level_spec(self.level_of[cid]) for cid in self._clients]
