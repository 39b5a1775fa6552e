"""ScalableFL: Nitta, Suzuki, Rodríguez Mulet, Yaguchi and Hirai, "Scalable Federated
Learning for Clients with Different Input Image Sizes and Numbers of Output Categories"
(arXiv 2311.08716 v1), §III (Algorithms 1 and 2) and §V; where the text is ambiguous, the
reading its tables support (below).

Reproduced:

- Architecture (§III-A): client j with input side H_j and K_j classes trains
  c_j = ceil(log2(H_j / H_0)) down-sampling stages of one global model, each
  kappa_j = log10(K_j) / log10(K_0) times as wide as the family's base widths (ceil, at
  least one channel; kappa may exceed 1 when K_j > K_0; the input channels are never
  scaled). The global model is the per-layer maximum over the clients (the scalable
  family's `global_spec`), so client weights are nested slices `G[:b_j, :a_j]` of its
  first c_j stages.
- Private BatchNorm (affine and running statistics) and private heads (FedBN + FedPer,
  FedAvg's `private_norm` and `private_head`): they stay on the client and never enter
  the global state.
- One round (Algorithm 1): the clients are grouped by (input size, number of classes)
  and `max(1, round(xi * n_group))` are sampled uniformly within each group (xi is
  `participation`, by default `clients_per_round` over the number of clients); each trains
  E mini-batches (`local_steps`) of momentum SGD with weight decay on convolution and
  linear weights only (Table VIII); the server averages every shared element over the
  sampled clients whose slice holds it, with weight 1 per client; uncovered elements (a
  stage no sampled client reaches) keep their value.
- Evaluation: every client's model with its private layers on its local test split (its
  classes, at its input size), reported per group as `groups["group=<H>px-<K>cls"]` and
  averaged as `local_acc` (there is no global model: `global_acc` is null).
- Comparisons of §V (option `variant`): `heterofl-max` and `heterofl-max-1` are §V's
  HeteroFL, the same pipeline with every client at the fixed depth c_max (or c_max - 1) and
  each group's widths chosen so that its model has the parameter count (shared and private)
  of its ScalableFL model (§V and Table VIII's hidden-channel ratios; no scaler, which §V
  does not mention and private BN makes irrelevant); `individual` trains each client's
  ScalableFL architecture alone.

Choices where the paper is silent:

- Depth counts halvings of the feature map (§III-A: c_j = ceil(log2(H_j / H_0)), read as the
  log of the ratio, as its example (128, 64, 32) -> (4, 3, 2) shows): a stage-cnn stage
  halves once; a ResNet with the ImageNet stem halves twice before its first stage (7x7/2
  conv and 3x3/2 max-pool, the paper's stage 1 and the pool of stage 2), so c stages are
  `stages = c - 1` residual stages there. H is the input's height. An input no larger than
  H0 still gets one stage (c = 0 would leave no model).
- K_j is the client's number of training classes, which must be exactly 0..K-1 (client
  views remap them, `data.groups`); a client with one class has kappa = 0 and is refused.
- The per-group count rounds halves up, n_group counts the group's clients at set-up, and
  a group with fewer clients available than its count trains those available.
- Table VIII's cosine decay over the rounds is `train.lr_schedule: {kind: cosine}`, the
  schedule every method shares (`hetfl.core.schedule`); by default the lr is constant, as in
  every other HetFL method. The optimiser (and its momentum) is fresh every round by default
  (HetFL's choice: the paper does not say); `train.keep_momentum` keeps each client's
  buffers as its private state instead.
- Private layers start at the client's own seeded initialisation (BN gamma = 1, beta = 0,
  fresh statistics) at its first participation.
- HeteroFL's widths (`hetfl.models.matching.match_parameters`, on exact counts): one ratio
  for every stage, the nearest achievable count; when that is still more than
  `match_tolerance` away, one ratio per stage (up to `max_ratio` times the base, within a
  factor `max_spread` of each other) if it comes nearer.
  The remaining gap per group is in `plans` (`GroupPlan.gap`) and in the run's
  `summary.json` under "strategy" (`describe`).
- Individual training uses the federated runs' sampling, local steps and settings, so
  every client gets the same compute as under ScalableFL; the paper instead tunes a
  separate learning rate, weight decay and 5k to 100k iterations (Table VIII).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
from pydantic import Field

from hetfl.algorithms.base import ReducerOptions, register_algorithm
from hetfl.algorithms.submodels import full_width_base
from hetfl.core.assign import GroupQuotas
from hetfl.core.evaluation import OwnModel
from hetfl.core.local.parts import LocalRecipe
from hetfl.core.maps import MapTransform, NothingShared, private_layers
from hetfl.core.server_update import Averaged
from hetfl.core.spec import Spec
from hetfl.core.strategy import Strategy
from hetfl.core.training import LocalTraining
from hetfl.core.types import ClientInfo, ModelFamily
from hetfl.core.weighting import uniform
from hetfl.models.matching import match_parameters, parameter_count
from hetfl.models.scalable import family_stages, input_reductions

Variant = Literal["scalablefl", "heterofl-max", "heterofl-max-1", "individual"]
#: A client group: (input side H, number of classes K).
Group = tuple[int, int]


# -- the architecture rules (§III-A) ----------------------------------------------------------
def scaled_depth(size: int, base_size: int) -> int:
    """c = ceil(log2(H / H0)), in integers: the smallest c >= 1 with H0 * 2**c >= H."""
    c = 1
    while base_size * 2**c < size:
        c += 1
    return c


def width_ratio(classes: int, base_classes: int) -> float:
    """kappa = log10(K) / log10(K0)."""
    return math.log10(classes) / math.log10(base_classes)


# -- the strategy ------------------------------------------------------------------------------
@dataclass(frozen=True)
class GroupPlan:
    """One client group's model: `depth` halvings (ScalableFL's c), its spec, its parameter
    count and the ScalableFL count it was matched to (`target`; equal for ScalableFL)."""

    size: int
    classes: int
    clients: int
    depth: int
    spec: Spec
    params: int
    target: int
    per_stage: bool = False

    @property
    def name(self) -> str:
        return f"group={self.size}px-{self.classes}cls"

    @property
    def gap(self) -> float:
        """Relative parameter-count difference to the target."""
        return (self.params - self.target) / self.target


def group_key(info: ClientInfo) -> Group:
    """(H, K) of a client, checked: labels 0..K-1, K >= 2."""
    classes = len(info.labels)
    if info.labels != tuple(range(classes)):
        raise ValueError(
            f"client {info.cid}: scalablefl needs labels 0..K-1 (a K-way private head), "
            f"got {info.labels}; give clients class subsets with data.groups"
        )
    if classes < 2:
        raise ValueError(
            f"client {info.cid} has {classes} class: its width ratio log10(K) / log10(K0) "
            "is 0, so it has no model; give every client at least 2 classes"
        )
    return int(info.input_shape[1]), classes


class GroupModels:
    """An assignment: each client group's model (`GroupPlan`), ScalableFL's from §III-A or,
    for §V's HeteroFL comparison (`variant` heterofl-max, heterofl-max-1), the fixed depth
    c_max (- 1) with widths matched to the ScalableFL parameter count."""

    def __init__(
        self,
        family: ModelFamily,
        *,
        base_size: int,
        base_classes: int,
        variant: Variant,
        match_tolerance: float,
        max_ratio: float,
        max_spread: float,
    ) -> None:
        if base_size < 1 or base_classes < 2:
            raise ValueError(
                f"base_size must be >= 1 and base_classes >= 2, got {base_size}, {base_classes}"
            )
        self.family, self.base_size, self.base_classes = family, base_size, base_classes
        self.variant, self.match_tolerance = variant, match_tolerance
        self.max_ratio, self.max_spread = max_ratio, max_spread
        self.base = full_width_base(family, "scalablefl").replace(bn="batch", scaler=False)
        reductions = input_reductions(self.base)
        if len(set(reductions)) < len(reductions):
            raise ValueError(
                f"scalablefl sets each client's depth, but {self.base['family']} has a fixed "
                "depth; use stage-cnn, resnet18 or preresnet"
            )
        self.plans: dict[Group, GroupPlan] = {}
        self._clients: list[ClientInfo] = []

    def setup(self, clients: Sequence[ClientInfo]) -> None:
        group_of = {c.cid: group_key(c) for c in clients}
        sizes = Counter(group_of.values())
        shapes = {group_of[c.cid]: tuple(c.input_shape) for c in clients}
        plans = {g: self.scaled_plan(g, shapes[g], sizes[g]) for g in sorted(sizes)}
        fixed = {"heterofl-max": 0, "heterofl-max-1": 1}.get(self.variant)
        if fixed is not None:
            c_max = max(plan.depth for plan in plans.values())
            if c_max - fixed < 1:
                raise ValueError(f"{self.variant} needs a depth >= 1; c_max is {c_max}")
            plans = {g: self.matched_plan(plan, c_max - fixed) for g, plan in plans.items()}
        self.plans = plans
        self._clients = list(clients)

    def scaled_plan(self, group: Group, shape: tuple[int, ...], clients: int) -> GroupPlan:
        """A group's ScalableFL model (§III-A): depth from the input size, width from the
        classes; its parameter count is its own target."""
        size, classes = group
        depth = scaled_depth(size, self.base_size)
        spec = self.base.replace(
            input_shape=tuple(shape),
            num_classes=classes,
            stages=family_stages(self.base, depth),
            widths=(width_ratio(classes, self.base_classes),) * len(self.base["widths"]),
        )
        count = parameter_count(self.family, spec)
        return GroupPlan(size, classes, clients, depth, spec, count, count)

    def matched_plan(self, plan: GroupPlan, depth: int) -> GroupPlan:
        """§V's HeteroFL model for a group: `depth` halvings, widths matched to the
        parameter count of its ScalableFL model (`plan`)."""
        at_depth = plan.spec.replace(stages=family_stages(self.base, depth))
        found = match_parameters(
            self.family,
            at_depth,
            plan.target,
            tolerance=self.match_tolerance,
            max_ratio=self.max_ratio,
            max_spread=self.max_spread,
        )
        spec = at_depth.replace(widths=found.widths)
        return replace(plan, depth=depth, spec=spec, params=found.params, per_stage=found.per_stage)

    def describe(self) -> dict[str, Any]:
        """Each group's model: depth (halvings), width ratios, parameters, and for the
        HeteroFL comparison the ScalableFL count it was matched to and the gap left."""
        return {
            "variant": self.variant,
            "groups": {
                plan.name: {
                    "clients": plan.clients,
                    "depth": plan.depth,
                    "widths": [round(w, 6) for w in plan.spec["widths"]],
                    "params": plan.params,
                    "target": plan.target,
                    "gap": round(plan.gap, 6),
                }
                for plan in self.plans.values()
            },
        }

    def plan_of(self, info: ClientInfo) -> GroupPlan:
        group = group_key(info)
        if group not in self.plans:
            raise KeyError(
                f"client {info.cid} is in group {group}, which no client had at set-up; the "
                "global model was sized for the groups known then"
            )
        return self.plans[group]

    def spec_of(self, info: ClientInfo) -> Spec:
        return self.plan_of(info).spec

    def spec_in_round(self, round: int, info: ClientInfo, rng: torch.Generator) -> Spec:
        return self.spec_of(info)

    def possible_specs(self) -> list[Spec]:
        return [self.spec_of(c) for c in self._clients]


class ScalableFLOptions(ReducerOptions):
    base_size: int = Field(8, ge=1, description="H0: the side of the last feature map")
    base_classes: int = Field(10, ge=2, description="K0: the classes of width ratio 1")
    participation: float | None = Field(
        None, gt=0, le=1, description="xi: share of each group sampled (default: per round)"
    )
    variant: Variant = "scalablefl"
    match_tolerance: float = Field(0.01, ge=0, description="heterofl: one ratio if this close")
    max_ratio: float = Field(4.0, gt=0, description="heterofl: widest ratio considered")
    max_spread: float = Field(
        1.5, ge=1, description="heterofl: per-stage ratios within this factor"
    )


def scalablefl_strategy(
    family: ModelFamily, opts: ScalableFLOptions, clients_per_round: int, train: LocalTraining
) -> Strategy:
    """Per-group quotas, per-group models, private BN and heads (nothing shared for
    individual training), weight 1 per client; clients judged under their group. Weight
    decay applies to convolution and linear weights only (Table VIII), whatever `train`
    says."""
    groups = GroupModels(
        family,
        base_size=opts.base_size,
        base_classes=opts.base_classes,
        variant=opts.variant,
        match_tolerance=opts.match_tolerance,
        max_ratio=opts.max_ratio,
        max_spread=opts.max_spread,
    )
    transforms: list[MapTransform] = (
        [NothingShared()]
        if opts.variant == "individual"
        else private_layers(family, norm=True, head=True)
    )
    return Strategy(
        family,
        train=replace(train, decay_norm_and_bias=False),
        sampler=GroupQuotas(group_key, opts.participation, clients_per_round),
        assignment=groups,
        transforms=transforms,
        weighting=uniform,
        server_update=Averaged(),
        local_eval=OwnModel(group=lambda info: groups.plan_of(info).name),
        describe=groups.describe,
        reducer=opts.reducer_settings().factory(),
    )


@register_algorithm(
    "scalablefl",
    "ScalableFL (Nitta et al. 2023): depth from input size, width from classes, "
    "private BN and heads",
    ScalableFLOptions,
    needs_scalable=True,
)
def _make(
    family: ModelFamily,
    opts: ScalableFLOptions,
    *,
    clients_per_round: int,
    train: LocalTraining,
) -> tuple[Strategy, LocalRecipe]:
    strategy = scalablefl_strategy(family, opts, clients_per_round, train)
    return strategy, LocalRecipe()
