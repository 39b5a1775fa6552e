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
uncovered ones kept; every level evaluated on the global test set (`width=r`; the widest
is `global_acc`) after a statistics pass (static BN); local accuracy as
`train_classifier_fed.py` measures it (`stats`, then `test` with each client's label
split): the full-rate model, logits masked to the client's classes.

The code's own switches, defaults as above: `norm` (`bn` or `none` among others there;
here also `per-width` and `per-capacity`, `width_norms`), `scaler` (`scale`),
`label_split` (`mask`); `default_clipping: false` trains unclipped.

Choices where the paper is silent or the code differs from the text:
- `fixed` gives the levels to clients in id order, narrowest first, in exact proportions
  (the code draws them with replacement);
- the masked loss and the label split use the client's training classes (no-ops on IID
  data, so on by default);
- `local_eval_model: own-level` judges each client by its own level (the widest under
  `dynamic`) after a statistics pass over its own training data (static BN); it runs
  whenever there are private layers, which the full-rate global model cannot hold;
- `weighting: samples` is available for comparisons with FjORD;
- the dynamic assignments are refused with private layers: they stay at the width last
  trained;
- under `per-capacity` norms only levels some client trains are evaluated (no others
  have normalisation tensors).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from pydantic import Field, model_validator

from hetfl.algorithms.parts.method_registry import WeightingOption, register_algorithm
from hetfl.algorithms.parts.option_records import PrivateLayerOptions
from hetfl.algorithms.parts.width_assignment import (
    Assignment,
    Capacities,
    Levels,
    Proportions,
    WidthAssignment,
    check_every_level_fits,
)
from hetfl.algorithms.parts.width_eval import LocalEvalModel, sliced_evaluation
from hetfl.algorithms.parts.width_norms import NormOption, level_norm
from hetfl.algorithms.parts.widths import check_levels, full_width_base
from hetfl.core.client.recipe import CrossEntropy, LocalRecipe
from hetfl.core.client.terms import MaskedCrossEntropy
from hetfl.core.server.maps import LabelSplit, MapTransform, private_layers
from hetfl.core.server.strategy import Aggregation, Evaluation, Extras, Strategy
from hetfl.core.server.weighting import weighting
from hetfl.core.training import LocalTraining
from hetfl.core.types import ModelFamily

DEFAULT_LEVELS = (1.0, 0.5, 0.25, 0.125, 0.0625)
#: The gradient-norm clipping of the authors' code, used when `train.clip_grad_norm` is unset.
DEFAULT_CLIP = 1.0


class HeteroFLOptions(PrivateLayerOptions):
    weighting: WeightingOption = "uniform"
    levels: Levels = DEFAULT_LEVELS
    proportions: Proportions = None
    assignment: Assignment = "fixed"
    capacities: Capacities = None
    label_split: bool = Field(True, description="masked loss and label-split head rows")
    local_eval_model: LocalEvalModel = "global-masked"
    norm: NormOption = "static"
    scaler: bool = Field(
        True, description="divide activations by the width ratio in training (the code's scale)"
    )
    default_clipping: bool = Field(
        True,
        description=f"clip gradients at norm {DEFAULT_CLIP} (the code's) when "
        "train.clip_grad_norm is unset; false: no clipping unless train sets one",
    )

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
    def _settings_fit_together(self) -> HeteroFLOptions:
        if self.scaler and self.norm == "per-width":
            raise ValueError(
                "norm 'per-width' keeps running statistics per width and takes no scaler; "
                "set scaler: false, or choose norm static, per-capacity or none"
            )
        if self.assignment.startswith("dynamic") and (self.private_norm or self.private_head):
            raise ValueError(
                f"assignment {self.assignment!r} with private_norm={self.private_norm}, "
                f"private_head={self.private_head}: private layers stay on a client at the "
                "width it last trained and cannot follow a width that changes every round; "
                "use assignment 'fixed' with private layers, or drop them"
            )
        return self


@register_algorithm("heterofl", HeteroFLOptions, needs="scalable")
def _make(
    family: ModelFamily, opts: HeteroFLOptions, *, clients_per_round: int, train: LocalTraining
) -> tuple[Strategy, LocalRecipe]:
    """Width levels under `norm` (static BN) with the scaler, label-split masks (not with a
    private head) and the masked loss, the authors' clipping unless `train` sets its own."""
    levels, proportions = check_levels(opts.levels, opts.proportions)
    base = full_width_base(family, "heterofl")
    norm = level_norm(base, opts.norm, levels, scaler=opts.scaler)
    check_every_level_fits(opts.assignment, levels, clients_per_round)
    assignment = WidthAssignment(
        levels, proportions, norm.train, mode=opts.assignment, capacities=opts.capacities
    )
    transforms: list[MapTransform] = private_layers(
        family, norm=opts.private_norm, head=opts.private_head
    )
    if opts.label_split and not opts.private_head:
        transforms.append(LabelSplit(family))
    private = opts.private_norm or opts.private_head
    global_eval, local_eval = sliced_evaluation(
        assignment, norm, private=private, label_mask=opts.label_split, local=opts.local_eval_model
    )
    if train.clip_grad_norm is None and opts.default_clipping:
        train = replace(train, clip_grad_norm=DEFAULT_CLIP)
    own = "own-level (private layers cannot load into the full-rate global model)"
    local = own if private else opts.local_eval_model
    described = {"clip_grad_norm": train.clip_grad_norm, "local_eval_model": local}
    strategy = Strategy(
        family,
        train=train,
        sampler=opts.sampler(clients_per_round),
        assignment=assignment,
        aggregation=Aggregation(
            weighting=weighting(opts.weighting),
            transforms=transforms,
            reducer=opts.reducer.build(),
        ),
        evaluation=Evaluation(global_eval=global_eval, local_eval=local_eval),
        extras=Extras(describe=lambda: dict(described)),
    )
    forward = MaskedCrossEntropy() if opts.label_split else CrossEntropy()
    return strategy, LocalRecipe(forward=forward)
