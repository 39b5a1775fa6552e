"""Width levels of a scalable model, shared by the width-sliced methods (HeteroFL, FjORD,
and later FLANC, FedFA): levels checked and paired with their proportions, the full-width
base spec a level is cut from (`full_width_base`, `level_specs`) and the assignment of levels
to clients (`WidthAssignment`, a `hetfl.core.assign.Assignment`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from hetfl.core.spec import Spec
from hetfl.core.types import ClientInfo, ModelFamily


def check_levels(
    levels: Sequence[float], proportions: Sequence[float] | None
) -> tuple[list[float], list[float] | None]:
    """Width levels narrowest first, each with its proportion (None = equal shares), checked.

    Levels and proportions are sorted as pairs, so that a level keeps its share whatever
    order a config lists them in (`levels: [1.0, 0.5], proportions: [0.7, 0.3]` puts 70 %
    of the clients at width 1 for every method)."""
    if not levels:
        raise ValueError("levels must list at least one width ratio")
    for p in levels:
        if not (math.isfinite(p) and 0 < p <= 1):
            raise ValueError(f"width levels must be in (0, 1], got {list(levels)}")
    if len(set(levels)) != len(levels):
        raise ValueError(f"width levels must be distinct, got {list(levels)}")
    if proportions is None:
        return sorted(float(p) for p in levels), None
    if len(proportions) != len(levels):
        raise ValueError(
            f"proportions needs one value per level ({len(levels)}), got {list(proportions)}"
        )
    if any(not (q >= 0 and math.isfinite(q)) for q in proportions) or sum(proportions) <= 0:
        raise ValueError(f"proportions must be >= 0 with a positive sum, got {proportions}")
    pairs = sorted((float(p), float(q)) for p, q in zip(levels, proportions, strict=True))
    return [p for p, _ in pairs], [q for _, q in pairs]


def shares(levels: Sequence[float], proportions: Sequence[float] | None) -> list[float]:
    """Normalised proportions (equal when None)."""
    raw = list(proportions) if proportions is not None else [1.0] * len(levels)
    total = float(sum(raw))
    return [q / total for q in raw]


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


def full_width_base(family: ModelFamily, method: str) -> Spec:
    """The family's base spec, which width-sliced methods treat as the full (ratio 1) model."""
    base = family.global_spec([])
    widths = base.get("widths")
    if widths is None:
        raise ValueError(
            f"{method} needs a scalable model (model.name one of the scalable families; see "
            "`hetfl list`); the configured model has one fixed architecture"
        )
    if any(w != 1.0 for w in widths):
        raise ValueError(
            f"{method} slices the configured model by its own width levels; leave model.width "
            f"at 1 (the global model), got {widths}"
        )
    return base


#: A level's spec: the width ratio r -> the spec of the model at that width.
LevelSpec = Callable[[float], Spec]


def level_specs(base: Spec, **changes: object) -> LevelSpec:
    """The level spec of `base`: r -> `base` with every width slot at r and `changes`
    (a method's normalisation and scaler)."""

    def at(ratio: float) -> Spec:
        return base.replace(widths=(ratio,) * len(base["widths"]), **changes)

    return at


class WidthAssignment:
    """Width levels of the configured (full-width) model: each client gets a level in fixed
    proportions at set-up (`assign_in_proportion`: in client id order, narrowest first);
    with `dynamic`, a sampled client trains a level redrawn every round in those
    proportions instead (HeteroFL's dynamic assignment: Diao et al., "HeteroFL", §3).
    `levels` and `proportions` as `check_levels` returns them."""

    def __init__(
        self,
        levels: Sequence[float],
        proportions: Sequence[float] | None,
        level_spec: LevelSpec,
        *,
        dynamic: bool,
    ) -> None:
        self.levels, self.proportions = list(levels), proportions
        self.level_spec, self.dynamic = level_spec, dynamic
        self.level_of: dict[int, float] = {}
        self._clients: list[int] = []

    def setup(self, clients: Sequence[ClientInfo]) -> None:
        self._clients = [c.cid for c in clients]
        self.level_of = assign_in_proportion(self._clients, self.levels, self.proportions)

    def level(self, info: ClientInfo) -> float:
        """A client's fixed level (the widest for a client unknown at set-up)."""
        return self.level_of.get(info.cid, max(self.levels))

    def spec_of(self, info: ClientInfo) -> Spec:
        return self.level_spec(self.level(info))

    def spec_in_round(self, round: int, info: ClientInfo, rng: torch.Generator) -> Spec:
        if self.dynamic:
            return self.level_spec(draw_level(self.levels, self.proportions, rng))
        return self.spec_of(info)

    def possible_specs(self) -> list[Spec]:
        if self.dynamic:
            return [self.level_spec(r) for r in self.levels]
        return [self.level_spec(self.level_of[cid]) for cid in self._clients]
