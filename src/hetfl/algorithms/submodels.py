"""Shared pieces of the width-sliced methods (HeteroFL, FjORD, and later FLANC, FedFA):
width levels and their assignment to clients (`WidthLevels`, a FedAvg with levels),
label-split head masks and evaluation models.

The functions work over a scalable family's specs; each method module composes the ones
it needs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from hetfl.algorithms.fedavg import FedAvg, Weighting
from hetfl.core.init import build_model
from hetfl.core.roles import head_tensor_names
from hetfl.core.spec import IndexMap, MapEntry, Spec
from hetfl.core.state import State, extract
from hetfl.core.training import LocalTraining
from hetfl.core.types import ClientInfo, EvalModel, ModelFamily


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


def at_width(base: Spec, ratio: float, **changes: object) -> Spec:
    """`base` with every slot at `ratio`."""
    return base.replace(widths=(ratio,) * len(base["widths"]), **changes)


def label_split(
    family: ModelFamily, spec: Spec, imap: IndexMap, state: State, labels: Sequence[int]
) -> IndexMap:
    """The map with the head's entries masked to the rows of `labels` (HeteroFL's
    label-split aggregation: a client contributes only its own classes' output rows)."""
    with torch.device("meta"):
        head = head_tensor_names(build_model(family, spec))
    out: IndexMap = []
    for e in imap:
        if e.local in head:
            shape = e.global_shape_of(state[e.global_name].shape)
            mask = torch.zeros(shape, dtype=torch.bool)
            rows = [c for c in labels if c < shape[0]]
            mask[rows] = True
            e = MapEntry(e.local, e.global_name, e.index, mask)
        out.append(e)
    return out


def eval_model_at(
    family: ModelFamily,
    eval_spec: Spec,
    imap: IndexMap,
    state: State,
    *,
    name: str,
    stats_pass: bool,
) -> EvalModel:
    """An evaluation model built for `eval_spec` from the global tensors `imap` selects;
    tensors the map does not cover (running statistics of a static-BN model)
    start at their defaults and are re-estimated by the stats pass."""
    tensors = dict(build_model(family, eval_spec).state_dict())
    tensors.update(extract(state, imap))
    return EvalModel(name=name, spec=eval_spec, tensors=tensors, stats_pass=stats_pass, group=name)


class WidthLevels(FedAvg):
    """FedAvg over width levels of the configured (full-width) model: each client gets a
    level in fixed proportions at set-up (`level_of`: in client id order, narrowest level
    first); subclasses say what a level's spec is (`level_spec`) and how it trains and is
    evaluated. `levels` and `proportions` are kept sorted together (`check_levels`)."""

    def __init__(
        self,
        family: ModelFamily,
        *,
        clients_per_round: int,
        train: LocalTraining,
        levels: Sequence[float],
        proportions: Sequence[float] | None = None,
        weighting: Weighting = "samples",
        private_norm: bool = False,
        private_head: bool = False,
    ) -> None:
        super().__init__(
            family,
            clients_per_round=clients_per_round,
            train=train,
            weighting=weighting,
            private_norm=private_norm,
            private_head=private_head,
        )
        self.levels, self.proportions = check_levels(levels, proportions)
        self.base = full_width_base(family, self.name)
        self.level_of: dict[int, float] = {}

    def level_spec(self, ratio: float) -> Spec:
        raise NotImplementedError(f"{type(self).__name__} must say what a level's spec is")

    def setup(
        self,
        clients: Sequence[ClientInfo],
        generator: torch.Generator,
        rounds: int | None = None,
    ) -> None:
        self.level_of = assign_in_proportion(
            [c.cid for c in clients], self.levels, self.proportions
        )
        super().setup(clients, generator, rounds)

    def spec_for(self, info: ClientInfo) -> Spec:
        return self.level_spec(self.level_of.get(info.cid, max(self.levels)))
