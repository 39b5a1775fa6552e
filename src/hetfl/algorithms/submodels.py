"""Shared pieces of the width-sliced methods (HeteroFL, FjORD, and later FLANC, FedFA):
width levels and their assignment to clients (`WidthAssignment`), label-split head masks
(`LabelSplit`) and evaluation parts (`LevelModels`, `FullRateMasked`, `OwnLevel`).

The functions and parts work over a scalable family's specs; each method module composes
the ones it needs into a `Strategy` (`hetfl.core.strategy`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import torch

from hetfl.core.evaluation import Layout
from hetfl.core.init import build_model
from hetfl.core.roles import head_tensor_names
from hetfl.core.spec import IndexMap, MapEntry, Spec
from hetfl.core.state import State, extract
from hetfl.core.types import ClientInfo, EvalModel, EvalTask, ModelFamily


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
    family: ModelFamily,
    spec: Spec,
    imap: IndexMap,
    state: Mapping[str, torch.Tensor],
    labels: Sequence[int],
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


# -- strategy parts ------------------------------------------------------------------------
#: A level's spec: the width ratio r -> the spec of the model at that width.
LevelSpec = Callable[[float], Spec]


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


class LabelSplit:
    """A map transform: a sampled client's head entries masked to its own classes (`label_split`);
    without a client (initialisation, evaluation) the map is unchanged."""

    def __init__(self, family: ModelFamily) -> None:
        self.family = family

    def shared(self, imap: IndexMap, spec: Spec) -> IndexMap:
        return imap

    def for_client(
        self, imap: IndexMap, spec: Spec, client: ClientInfo, state: Mapping[str, torch.Tensor]
    ) -> IndexMap:
        return label_split(self.family, spec, imap, state, client.labels)


def level_name(ratio: float) -> str:
    """The name (and group) of a level's evaluated model: `width=r`."""
    return f"width={ratio:g}"


class LevelModels:
    """Every level's model on the global test set, widest first (`width=r`; the widest is
    `global_acc`): the global tensors of the level's training spec, loaded into its
    evaluation spec, after a statistics pass when `stats_pass` (static BatchNorm)."""

    def __init__(
        self,
        levels: Sequence[float],
        level_spec: LevelSpec,
        eval_spec: LevelSpec,
        *,
        stats_pass: bool,
    ) -> None:
        self.levels, self.level_spec, self.eval_spec = list(levels), level_spec, eval_spec
        self.stats_pass = stats_pass

    def eval_models(self, layout: Layout, state: Mapping[str, torch.Tensor]) -> list[EvalModel]:
        return [
            eval_model_at(
                layout.family,
                self.eval_spec(r),
                layout.shared_map(self.level_spec(r)),
                dict(state),
                name=level_name(r),
                stats_pass=self.stats_pass,
            )
            for r in sorted(self.levels, reverse=True)
        ]


class FullRateMasked:
    """A client judged by the full-rate model exactly as the global evaluation tested it
    (its BatchNorm statistics from the server-side pass), its logits masked to the client's
    classes when `label_mask` (HeteroFL's code: `train_classifier_fed.py`, `stats` then
    `test` with each client's label split): the client runs no statistics pass."""

    def __init__(
        self, widest: float, level_spec: LevelSpec, eval_spec: LevelSpec, *, label_mask: bool
    ) -> None:
        self.widest, self.level_spec, self.eval_spec = widest, level_spec, eval_spec
        self.label_mask = label_mask

    def eval_task(
        self,
        layout: Layout,
        info: ClientInfo,
        state: Mapping[str, torch.Tensor],
        evaluated: Mapping[str, State],
    ) -> EvalTask:
        name = level_name(self.widest)
        if name not in evaluated:
            raise RuntimeError(
                f"HeteroFL's local_eval_model 'global-masked' judges clients with the evaluated "
                f"full-rate model {name!r}, which this round's evaluation did not give "
                f"(it gave {sorted(evaluated)}); the engine passes eval_task the models it tested"
            )
        return EvalTask(
            cid=info.cid,
            spec=self.eval_spec(self.widest),
            payload=dict(evaluated[name]),
            index_map=layout.shared_map(self.level_spec(self.widest)),
            label_mask=info.labels if self.label_mask else None,
        )


class OwnLevel:
    """A client judged by its own level (`level_of(info)`) after a statistics pass over its
    own training data, its logits masked to its classes when `label_mask`; reported under
    `local width=r`."""

    def __init__(
        self,
        level_of: Callable[[ClientInfo], float],
        level_spec: LevelSpec,
        eval_spec: LevelSpec,
        *,
        label_mask: bool,
    ) -> None:
        self.level_of, self.level_spec, self.eval_spec = level_of, level_spec, eval_spec
        self.label_mask = label_mask

    def eval_task(
        self,
        layout: Layout,
        info: ClientInfo,
        state: Mapping[str, torch.Tensor],
        evaluated: Mapping[str, State],
    ) -> EvalTask:
        ratio = self.level_of(info)
        imap = layout.shared_map(self.level_spec(ratio))
        return EvalTask(
            cid=info.cid,
            spec=self.eval_spec(ratio),
            payload=extract(state, imap),
            index_map=imap,
            group=f"local width={ratio:g}",
            stats_pass=True,
            label_mask=info.labels if self.label_mask else None,
        )
