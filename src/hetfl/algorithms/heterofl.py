"""HeteroFL: Diao, Ding and Tarokh, "HeteroFL: Computation and Communication Efficient
Federated Learning for Heterogeneous Clients" (ICLR 2021), §3, and the authors' code
(diaoenmao/HeteroFL-Computation-and-Communication-Efficient-Federated-Learning-for-
Heterogeneous-Clients: `fed.py`, `train_classifier_fed.py`, `modules/modules.py`), which
settles what the text leaves open (named per point below).

Reproduced: width levels (default 1, 1/2, 1/4, 1/8, 1/16) of one global model, each client
training the nested slice `[:ceil(r * out), :ceil(r * in)]` of every hidden layer (input
channels and output classes full); assignment `fixed` (by proportion) or `dynamic` (every
sampled client redraws its level every round); static BatchNorm (batch statistics in
training, nothing but the affine aggregated) with the scaler (activations divided by r in
training only); masked cross-entropy (logits of the classes a client lacks set to 0) and
label-split aggregation of the head rows; gradient-norm clipping at 1 (the authors' code;
`train.clip_grad_norm`, when set, runs instead, and the run's start banner and
`summary.json` say which value ran); aggregation with
weight 1 per client on each element it covers (not sample counts), uncovered elements kept;
evaluation of every level on the global test set after a statistics pass over the
clients' training data (`hetfl.engine.statistics`), reported under `groups` as `width=r`
(the widest level is `global_acc`); local accuracy as the authors' code measures it
(train_classifier_fed.py: `stats`, then `test` with each client's label split): the
full-rate model with those same statistics, its logits masked to the client's classes
(`local_eval_model: global-masked`).

Choices where the paper is silent or the code differs from the text:

- `fixed` assignment gives the levels to clients in id order, narrowest first, in exact
  proportions (the code draws them with replacement, so the realised proportions vary
  with the seed);
- the masked loss and the label split use the classes in the client's *training* data,
  which is what "the client's label set" is in every partition HetFL has; with IID data
  both are no-ops, so they are on by default;
- `local_eval_model: own-level` evaluates each client's own level instead (the widest
  level under `dynamic` assignment) with its label mask, after a statistics pass over the
  client's own training data: how well a client's sub-model serves it, a different
  number from the paper's. It is what runs with private layers (`private_norm`,
  `private_head`), which the full-rate global model cannot hold; `describe()` (the start
  banner, `summary.json`) says so;
- `weighting: samples` is available (recorded in the resolved config) for comparisons
  with FjORD's sample-count weighting;
- `dynamic` assignment is refused with private layers (`private_norm`, `private_head`):
  a client keeps them at the width it last trained, which a width redrawn every round
  does not fit.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Literal

from pydantic import model_validator

from hetfl.algorithms.base import register_algorithm
from hetfl.algorithms.fedavg import FedAvgOptions
from hetfl.algorithms.width_eval import FullRateMasked, LevelModels, OwnLevel
from hetfl.algorithms.widths import WidthAssignment, at_width, check_levels, full_width_base
from hetfl.core.assign import UniformSampling
from hetfl.core.evaluation import GlobalEval, LocalEval, WholeModel
from hetfl.core.local.parts import LocalRecipe
from hetfl.core.local.terms import MaskedCrossEntropy
from hetfl.core.maps import LabelSplit, MapTransform, private_layers
from hetfl.core.server_update import Averaged
from hetfl.core.spec import Spec
from hetfl.core.strategy import Strategy
from hetfl.core.training import LocalTraining
from hetfl.core.types import ModelFamily
from hetfl.core.weighting import WeightingName, weighting

Assignment = Literal["fixed", "dynamic"]
#: How local accuracy is measured: the full-rate global model (after the global statistics
#: pass) with the client's label mask, or the client's own level with statistics from its
#: own training data.
LocalEvalModel = Literal["global-masked", "own-level"]
DEFAULT_LEVELS = (1.0, 0.5, 0.25, 0.125, 0.0625)
#: The gradient-norm clipping of the authors' code, used when `train.clip_grad_norm` is unset.
DEFAULT_CLIP = 1.0


class HeteroFLOptions(FedAvgOptions):
    weighting: WeightingName = "uniform"
    levels: tuple[float, ...] = DEFAULT_LEVELS
    proportions: tuple[float, ...] | None = None
    assignment: Assignment = "fixed"
    label_split: bool = True
    local_eval_model: LocalEvalModel = "global-masked"

    @model_validator(mode="before")
    @classmethod
    def _clipping_is_a_train_setting(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and "clip_grad_norm" in data:
            raise ValueError(
                "clip_grad_norm is not a heterofl option: set train.clip_grad_norm instead; "
                f"left unset, HeteroFL clips at {DEFAULT_CLIP}"
            )
        return data

    @model_validator(mode="after")
    def _private_layers_need_a_fixed_width(self) -> HeteroFLOptions:
        if self.assignment == "dynamic" and (self.private_norm or self.private_head):
            raise ValueError(
                f"assignment 'dynamic' with private_norm={self.private_norm}, "
                f"private_head={self.private_head}: private layers stay on a client at the "
                "width it last trained and cannot follow a width that changes every round; "
                "use assignment 'fixed' with private layers, or drop them"
            )
        return self


def heterofl_strategy(
    family: ModelFamily, opts: HeteroFLOptions, clients_per_round: int, train: LocalTraining
) -> Strategy:
    """Width levels with static BN and the scaler; label-split masks (not with a private
    head); every level evaluated after a statistics pass unless private layers leave no
    complete global model; local accuracy as `local_eval_model` says (`own-level` with
    private layers, which the full-rate global model cannot hold)."""
    levels, proportions = check_levels(opts.levels, opts.proportions)
    base = full_width_base(family, "heterofl")

    def level_spec(ratio: float) -> Spec:
        return at_width(base, ratio, bn="static", scaler=True)

    def eval_spec(ratio: float) -> Spec:
        return at_width(base, ratio, bn="batch", scaler=False)

    dynamic = opts.assignment == "dynamic"
    assignment = WidthAssignment(levels, proportions, level_spec, dynamic=dynamic)
    private = opts.private_norm or opts.private_head
    transforms: list[MapTransform] = private_layers(
        family, norm=opts.private_norm, head=opts.private_head
    )
    if opts.label_split and not opts.private_head:
        transforms.append(LabelSplit(family))
    widest = max(levels)
    global_eval: GlobalEval = (
        WholeModel() if private else LevelModels(levels, level_spec, eval_spec, stats_pass=True)
    )
    local_eval: LocalEval = (
        OwnLevel(
            (lambda info: widest) if dynamic else assignment.level,
            level_spec,
            eval_spec,
            label_mask=opts.label_split,
        )
        if private or opts.local_eval_model == "own-level"
        else FullRateMasked(widest, level_spec, eval_spec, label_mask=opts.label_split)
    )
    if train.clip_grad_norm is None:
        train = replace(train, clip_grad_norm=DEFAULT_CLIP)
    local = (
        "own-level (private layers cannot load into the full-rate global model)"
        if private
        else opts.local_eval_model
    )
    described = {"clip_grad_norm": train.clip_grad_norm, "local_eval_model": local}
    return Strategy(
        family,
        train=train,
        sampler=UniformSampling(clients_per_round),
        assignment=assignment,
        transforms=transforms,
        weighting=weighting(opts.weighting),
        server_update=Averaged(),
        global_eval=global_eval,
        local_eval=local_eval,
        describe=lambda: dict(described),
        reducer=opts.reducer_settings().factory(),
    )


@register_algorithm(
    "heterofl",
    "HeteroFL (Diao et al. 2021): width levels of one model, static BN, label split",
    HeteroFLOptions,
    needs_scalable=True,
)
def _make(
    family: ModelFamily, opts: HeteroFLOptions, *, clients_per_round: int, train: LocalTraining
) -> tuple[Strategy, LocalRecipe]:
    strategy = heterofl_strategy(family, opts, clients_per_round, train)
    return strategy, LocalRecipe(
        forward=MaskedCrossEntropy()
    ) if opts.label_split else LocalRecipe()
