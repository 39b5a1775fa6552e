"""HeteroFL: Diao, Ding and Tarokh, "HeteroFL: Computation and Communication Efficient
Federated Learning for Heterogeneous Clients" (ICLR 2021), §3, and the authors' code
(diaoenmao/HeteroFL-Computation-and-Communication-Efficient-Federated-Learning-for-
Heterogeneous-Clients: `fed.py`, `train_classifier_fed.py`, `modules/modules.py`), which
settles what the text leaves open. Notes on the choices: docs/methods.md, "HeteroFL".

Reproduced: width levels (`DEFAULT_LEVELS`) of one global model, a client training the
nested slice `[:ceil(r * out), :ceil(r * in)]` of every hidden layer; assignment `fixed`
(by proportion) or `dynamic` (redrawn per sampled client and round), and FLANC's
`dynamic-all-levels` and `declared` (`width_assignment.WidthAssignment`); static BatchNorm
(batch statistics in training, only the affine aggregated) with the scaler (activations /
r in training only); masked cross-entropy (absent classes' logits set to 0) and
label-split aggregation of the head rows; gradient-norm clipping at 1 (the code's; a set
`train.clip_grad_norm` runs instead); weight 1 per client on each element it covers,
uncovered ones kept; every level evaluated on the global test set after a statistics
pass over the clients' training data (`width=r`; the widest is `global_acc`); local
accuracy as `train_classifier_fed.py` measures it (`stats`, then `test` with each
client's label split): the full-rate model, logits masked to the client's classes.

Choices where the paper is silent or the code differs from the text:
- `fixed` gives the levels to clients in id order, narrowest first, in exact proportions
  (the code draws them with replacement);
- the masked loss and the label split use the client's training classes (no-ops on IID
  data, so on by default);
- `local_eval_model: own-level` judges each client by its own level (the widest under
  `dynamic`) after a statistics pass over its own training data; it runs whenever there
  are private layers, which the full-rate global model cannot hold;
- `weighting: samples` is available for comparisons with FjORD;
- the dynamic assignments are refused with private layers: they stay at the width last
  trained.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from pydantic import Field, model_validator

from hetfl.algorithms.base import WeightingOption, register_algorithm
from hetfl.algorithms.fedavg import FedAvgOptions
from hetfl.algorithms.width_assignment import (
    Assignment,
    Capacities,
    Levels,
    Proportions,
    WidthAssignment,
    check_every_level_fits,
)
from hetfl.algorithms.width_eval import FullRateMasked, LevelModels, LocalEvalModel, OwnLevel
from hetfl.algorithms.widths import LevelSpec, check_levels, full_width_base, level_specs
from hetfl.core.evaluation import GlobalEval, LocalEval, WholeModel
from hetfl.core.local.parts import CrossEntropy, LocalRecipe
from hetfl.core.local.terms import MaskedCrossEntropy
from hetfl.core.maps import LabelSplit, MapTransform, private_layers
from hetfl.core.server_update import Averaged
from hetfl.core.strategy import Strategy
from hetfl.core.training import LocalTraining
from hetfl.core.types import ModelFamily
from hetfl.core.weighting import weighting

DEFAULT_LEVELS = (1.0, 0.5, 0.25, 0.125, 0.0625)
#: The gradient-norm clipping of the authors' code, used when `train.clip_grad_norm` is unset.
DEFAULT_CLIP = 1.0


class HeteroFLOptions(FedAvgOptions):
    weighting: WeightingOption = "uniform"
    levels: Levels = DEFAULT_LEVELS
    proportions: Proportions = None
    assignment: Assignment = "fixed"
    capacities: Capacities = None
    label_split: bool = Field(True, description="masked loss and label-split head rows")
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
        if self.assignment.startswith("dynamic") and (self.private_norm or self.private_head):
            raise ValueError(
                f"assignment {self.assignment!r} with private_norm={self.private_norm}, "
                f"private_head={self.private_head}: private layers stay on a client at the "
                "width it last trained and cannot follow a width that changes every round; "
                "use assignment 'fixed' with private layers, or drop them"
            )
        return self


def evaluation(
    opts: HeteroFLOptions, assignment: WidthAssignment, eval_spec: LevelSpec
) -> tuple[GlobalEval, LocalEval]:
    """Every level after a statistics pass, unless private layers leave no complete global
    model. Local accuracy as `local_eval_model` says: the full-rate model as the global
    evaluation tested it, with the client's label mask (`global-masked`), or the client's
    own level after a statistics pass over its own training data (`own-level`, the one
    that runs with private layers)."""
    widest, mask, level_spec = max(assignment.levels), opts.label_split, assignment.level_spec
    level_of = (lambda info: widest) if assignment.dynamic else assignment.level
    own = OwnLevel(level_of, level_spec, eval_spec, label_mask=mask)
    if opts.private_norm or opts.private_head:
        return WholeModel(), own
    levels = LevelModels(assignment.levels, level_spec, eval_spec, stats_pass=True)
    if opts.local_eval_model == "own-level":
        return levels, own
    return levels, FullRateMasked(widest, level_spec, eval_spec, label_mask=mask)


@register_algorithm("heterofl", HeteroFLOptions, needs="scalable")
def _make(
    family: ModelFamily, opts: HeteroFLOptions, *, clients_per_round: int, train: LocalTraining
) -> tuple[Strategy, LocalRecipe]:
    """Width levels with static BN and the scaler, label-split masks (not with a private
    head) and the masked loss, the authors' clipping unless `train` sets its own."""
    levels, proportions = check_levels(opts.levels, opts.proportions)
    base = full_width_base(family, "heterofl")
    level_spec = level_specs(base, bn="static", scaler=True)
    eval_spec = level_specs(base, bn="batch", scaler=False)
    check_every_level_fits(opts.assignment, levels, clients_per_round)
    assignment = WidthAssignment(
        levels, proportions, level_spec, mode=opts.assignment, capacities=opts.capacities
    )
    transforms: list[MapTransform] = private_layers(
        family, norm=opts.private_norm, head=opts.private_head
    )
    if opts.label_split and not opts.private_head:
        transforms.append(LabelSplit(family))
    global_eval, local_eval = evaluation(opts, assignment, eval_spec)
    if train.clip_grad_norm is None:
        train = replace(train, clip_grad_norm=DEFAULT_CLIP)
    private = "own-level (private layers cannot load into the full-rate global model)"
    local = private if opts.private_norm or opts.private_head else opts.local_eval_model
    described = {"clip_grad_norm": train.clip_grad_norm, "local_eval_model": local}
    strategy = Strategy(
        family,
        train=train,
        sampler=opts.sampler(clients_per_round),
        assignment=assignment,
        transforms=transforms,
        weighting=weighting(opts.weighting),
        server_update=Averaged(),
        global_eval=global_eval,
        local_eval=local_eval,
        describe=lambda: dict(described),
        reducer=opts.reducer.build(),
    )
    forward = MaskedCrossEntropy() if opts.label_split else CrossEntropy()
    return strategy, LocalRecipe(forward=forward)
