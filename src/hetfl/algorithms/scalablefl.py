"""ScalableFL: Nitta, Suzuki, Rodríguez Mulet, Yaguchi and Hirai, "Scalable Federated
Learning for Clients with Different Input Image Sizes and Numbers of Output Categories"
(arXiv 2311.08716 v1), §III (Algorithms 1 and 2) and §V; readings of ambiguous text and
notes on the choices: docs/methods.md, "ScalableFL".

Reproduced: clients are grouped by (input side H, classes K); a group trains
c = ceil(log2(H / H0)) down-sampling stages of one global model at kappa = log10(K) /
log10(K0) times the base widths (§III-A, `hetfl.models.scaling`; `model.width` narrows
the base, e.g. a quarter-width ResNet-18 at this machine's scale), nested slices of the
per-layer maximum, with private BatchNorm and heads (FedBN + FedPer). A round (Algorithm 1)
samples max(1, round(xi * n_g)) clients per group (xi: `participation`, by default
clients_per_round over the clients); each trains `local_steps` mini-batches of momentum
SGD, weight decay on convolution and linear weights only (Table VIII); every shared
element is averaged over the clients holding it, weight 1 each (uncovered ones kept).
Each client's model is evaluated on its local test split: `groups["group=<H>px-<K>cls"]`,
`local_acc` (`global_acc` is null). `variant`: `heterofl-max` (-1) is §V's HeteroFL, all
at depth c_max (- 1), widths matched to each group's ScalableFL parameter count;
`individual` trains each client alone.

Choices where the paper is silent:
- depth counts halvings (a ResNet's ImageNet stem halves twice: c halvings are c - 1
  residual stages); H is the input's height; c >= 1 always;
- K counts the client's training classes, which must be 0..K-1 (`data.groups`); K = 1 is
  refused (kappa = 0);
- quotas round halves up, over the group's clients at set-up; a group with fewer clients
  available trains those;
- lr constant unless `train.lr_schedule` (Table VIII's cosine: `{kind: cosine}`); a fresh
  optimiser every round unless `train.keep_momentum`;
- private layers start at the client's own seeded initialisation;
- HeteroFL's widths: one ratio, else per-stage ratios when nearer (`match_tolerance`,
  `max_ratio`, `max_spread`); the gap left is in summary.json under "strategy";
- individual training has the federated runs' sampling, steps and settings.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Annotated, Any, Literal

from pydantic import Field

from hetfl.algorithms.parts.method_registry import ReducerOptions, register_algorithm
from hetfl.algorithms.parts.task_recipe import plain_recipe
from hetfl.algorithms.parts.widths import scalable_base
from hetfl.core.client.recipe import LocalRecipe
from hetfl.core.server.assign import GroupKey, GroupPlanner, GroupQuotas, PerGroup
from hetfl.core.server.evaluation import LocalModel, own_spec
from hetfl.core.server.maps import MapTransform, NothingShared, private_layers
from hetfl.core.server.strategy import Aggregation, Evaluation, Extras, Strategy
from hetfl.core.server.weighting import uniform
from hetfl.core.training import LocalTraining
from hetfl.core.types import ClientInfo, ModelFamily
from hetfl.models.scaling import ScaledModel, ScalingRule, check_depth_scalable

Variant = Annotated[
    Literal["scalablefl", "heterofl-max", "heterofl-max-1", "individual"],
    Field(
        description="scalablefl, the method; heterofl-max (-1), §V's HeteroFL, every group at "
        "depth c_max (- 1), widths matched to its parameter count; individual, each client alone"
    ),
]
#: §V's HeteroFL variants: how many halvings below c_max every group trains.
BELOW_MAX = {"heterofl-max": 0, "heterofl-max-1": 1}


class ScalableFLOptions(ReducerOptions):
    base_size: int = Field(8, ge=1, description="H0, the side of the last feature map (§III-A)")
    base_classes: int = Field(10, ge=2, description="K0, the class count of width ratio 1")
    participation: float | None = Field(
        None,
        gt=0,
        le=1,
        description="ξ, the share of each group sampled per round (default: "
        "train.clients_per_round / data.num_clients)",
    )
    variant: Variant = "scalablefl"
    match_tolerance: float = Field(
        0.01, ge=0, description="heterofl-max (-1): relative parameter gap one ratio may leave"
    )
    max_ratio: float = Field(4.0, gt=0, description="heterofl-max (-1): widest ratio tried")
    max_spread: float = Field(1.5, ge=1, description="heterofl-max (-1): per-stage ratio spread")


def group_key(info: ClientInfo) -> tuple[int, int]:
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


def group_name(group: GroupKey) -> str:
    """The name a group is reported under: `group=<H>px-<K>cls`."""
    return f"group={group[0]}px-{group[1]}cls"


def group_models(family: ModelFamily, opts: ScalableFLOptions) -> GroupPlanner[ScaledModel]:
    """Each group's model (§III-A; a group's input shape is its last member's), or for §V's
    HeteroFL comparison each one matched at the variant's fixed depth."""
    base = scalable_base(family, "scalablefl").replace(bn="batch", scaler=False)
    check_depth_scalable(base, "scalablefl")
    rule = ScalingRule(family, base, opts.base_size, opts.base_classes)
    below_max = BELOW_MAX.get(opts.variant)

    def plan(members: Mapping[GroupKey, Sequence[ClientInfo]]) -> dict[GroupKey, ScaledModel]:
        models = {g: rule.model(tuple(c[-1].input_shape), g[1]) for g, c in members.items()}
        if below_max is None:
            return models
        matching = {"max_ratio": opts.max_ratio, "max_spread": opts.max_spread}
        return rule.at_fixed_depth(models, below_max, tolerance=opts.match_tolerance, **matching)

    return plan


def judged_group(info: ClientInfo) -> str:
    """The group a client's local score is reported under (its group's name)."""
    return group_name(group_key(info))


def describe(variant: Variant, groups: PerGroup[ScaledModel]) -> dict[str, Any]:
    """Each group's clients and model (`ScaledModel.summary`: for the HeteroFL comparison
    also the ScalableFL count it was matched to and the gap left)."""
    plans = groups.plans.items()
    summaries = {
        group_name(g): {"clients": len(groups.members[g]), **m.summary()} for g, m in plans
    }
    return {"variant": variant, "groups": summaries}


@register_algorithm("scalablefl", ScalableFLOptions, needs="scalable")
def _make(
    family: ModelFamily, opts: ScalableFLOptions, *, clients_per_round: int, train: LocalTraining
) -> tuple[Strategy, LocalRecipe]:
    """Per-group quotas and models, private BN and heads (none shared when individual),
    weight 1 per client, judged by group; weight decay on convolution and linear weights
    only (Table VIII); plain local training: cross-entropy, or SSD's loss (§V-B)."""
    groups = PerGroup(group_key, group_models(family, opts))
    alone = opts.variant == "individual"
    transforms: list[MapTransform] = (
        [NothingShared()] if alone else private_layers(family, norm=True, head=True)
    )
    strategy = Strategy(
        family,
        train=replace(train, decay_norm_and_bias=False),
        sampler=GroupQuotas(group_key, opts.participation, clients_per_round),
        assignment=groups,
        aggregation=Aggregation(uniform, transforms=transforms, reducer=opts.reducer.build()),
        evaluation=Evaluation(local_eval=LocalModel(own_spec(group=judged_group))),
        extras=Extras(describe=lambda: describe(opts.variant, groups)),
    )
    return strategy, plain_recipe(family, "scalablefl")
