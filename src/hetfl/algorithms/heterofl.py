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

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Literal

import torch
from pydantic import model_validator

from hetfl.algorithms.base import register_algorithm
from hetfl.algorithms.fedavg import FedAvgOptions, Weighting
from hetfl.algorithms.submodels import WidthLevels, at_width, draw_level, eval_model_at, label_split
from hetfl.core.local.parts import LocalRecipe
from hetfl.core.local.terms import MaskedCrossEntropy
from hetfl.core.spec import IndexMap, Spec
from hetfl.core.state import extract
from hetfl.core.strategy import Strategy
from hetfl.core.training import LocalTraining
from hetfl.core.types import ClientInfo, EvalModel, EvalTask, ModelFamily, State

Assignment = Literal["fixed", "dynamic"]
#: How local accuracy is measured: the full-rate global model (after the global statistics
#: pass) with the client's label mask, or the client's own level with statistics from its
#: own training data.
LocalEvalModel = Literal["global-masked", "own-level"]
DEFAULT_LEVELS = (1.0, 0.5, 0.25, 0.125, 0.0625)
#: The gradient-norm clipping of the authors' code, used when `train.clip_grad_norm` is unset.
DEFAULT_CLIP = 1.0


class HeteroFL(WidthLevels):
    name = "heterofl"

    def __init__(
        self,
        family: ModelFamily,
        *,
        clients_per_round: int,
        train: LocalTraining,
        levels: Sequence[float] = DEFAULT_LEVELS,
        proportions: Sequence[float] | None = None,
        assignment: Assignment = "fixed",
        label_split: bool = True,
        weighting: Weighting = "uniform",
        private_norm: bool = False,
        private_head: bool = False,
        local_eval_model: LocalEvalModel = "global-masked",
    ) -> None:
        """`train.clip_grad_norm` runs when set; unset (None), HeteroFL clips at
        `DEFAULT_CLIP`."""
        if train.clip_grad_norm is None:
            train = replace(train, clip_grad_norm=DEFAULT_CLIP)
        super().__init__(
            family,
            clients_per_round=clients_per_round,
            train=train,
            levels=levels,
            proportions=proportions,
            weighting=weighting,
            private_norm=private_norm,
            private_head=private_head,
        )
        if assignment not in ("fixed", "dynamic"):
            raise ValueError(f"assignment must be 'fixed' or 'dynamic', got {assignment!r}")
        if local_eval_model not in ("global-masked", "own-level"):
            raise ValueError(
                f"local_eval_model must be 'global-masked' or 'own-level', got {local_eval_model!r}"
            )
        self.assignment = assignment
        self.split_labels = label_split
        # A full-rate global model cannot hold private layers: those clients are judged
        # with their own level.
        self.local_eval_model: LocalEvalModel = (
            "own-level" if private_norm or private_head else local_eval_model
        )

    def level_spec(self, ratio: float) -> Spec:
        """The training spec of a level: static BN with the scaler."""
        return at_width(self.base, ratio, bn="static", scaler=True)

    def eval_spec(self, ratio: float) -> Spec:
        """The same model with running statistics, for evaluation after a stats pass."""
        return at_width(self.base, ratio, bn="batch", scaler=False)

    # -- planning ------------------------------------------------------------------------
    def possible_specs(self) -> list[Spec]:
        if self.assignment == "dynamic":
            return [self.level_spec(r) for r in self.levels]
        return list(self.specs.values())

    def spec_in_round(self, round: int, info: ClientInfo, rng: torch.Generator) -> Spec:
        if self.assignment == "dynamic":
            return self.level_spec(draw_level(self.levels, self.proportions, rng))
        return super().spec_in_round(round, info, rng)

    def index_map_in_round(self, round: int, info: ClientInfo, spec: Spec) -> IndexMap:
        imap = self.index_map_for(spec)
        if not self.split_labels or self.private_head:
            return imap
        return label_split(self.family, spec, imap, self.global_state, info.labels)

    # -- evaluation ----------------------------------------------------------------------
    def eval_models(self, state: Mapping[str, torch.Tensor]) -> list[EvalModel]:
        """Every level after a statistics pass, widest first; none with private layers
        (there is then no complete global model: clients are judged locally)."""
        if self.private_norm or self.private_head:
            return []
        return [
            eval_model_at(
                self.family,
                self.eval_spec(r),
                self.index_map_for(self.level_spec(r)),
                dict(state),
                name=level_name(r),
                stats_pass=True,
            )
            for r in sorted(self.levels, reverse=True)
        ]

    def eval_task(self, info: ClientInfo, evaluated: Mapping[str, State] | None = None) -> EvalTask:
        """The client's local accuracy task, as `local_eval_model` says."""
        if self.local_eval_model == "own-level":
            return self.own_level_task(info)
        return self.global_masked_task(info, evaluated or {})

    def global_masked_task(self, info: ClientInfo, evaluated: Mapping[str, State]) -> EvalTask:
        """The full-rate model exactly as the global evaluation tested it (its BatchNorm
        statistics from the server-side pass), with the client's label mask: the client
        runs no statistics pass of its own."""
        ratio = max(self.levels)
        name = level_name(ratio)
        if name not in evaluated:
            raise RuntimeError(
                f"HeteroFL's local_eval_model 'global-masked' judges clients with the evaluated "
                f"full-rate model {name!r}, which this round's evaluation did not give "
                f"(it gave {sorted(evaluated)}); the engine passes eval_task the models it tested"
            )
        return EvalTask(
            cid=info.cid,
            spec=self.eval_spec(ratio),
            payload=dict(evaluated[name]),
            index_map=self.index_map_for(self.level_spec(ratio)),
            label_mask=info.labels if self.split_labels else None,
        )

    def own_level_task(self, info: ClientInfo) -> EvalTask:
        """The client's own level (the widest under `dynamic` assignment) after a
        statistics pass over the client's own training data, with its label mask."""
        ratio = self.level_of.get(info.cid, max(self.levels))
        if self.assignment == "dynamic":
            ratio = max(self.levels)
        imap = self.index_map_for(self.level_spec(ratio))
        return EvalTask(
            cid=info.cid,
            spec=self.eval_spec(ratio),
            payload=extract(self.global_state, imap),
            index_map=imap,
            group=f"local width={ratio:g}",
            stats_pass=True,
            label_mask=info.labels if self.split_labels else None,
        )

    def describe(self) -> dict[str, Any]:
        """The clipping that runs (the user's `train.clip_grad_norm` or `DEFAULT_CLIP`) and
        how local accuracy is measured, with why when private layers decided it."""
        local: str = self.local_eval_model
        if self.private_norm or self.private_head:
            local = "own-level (private layers cannot load into the full-rate global model)"
        return {"clip_grad_norm": self.train.clip_grad_norm, "local_eval_model": local}


def level_name(ratio: float) -> str:
    """The name (and group) of a level's evaluated model: `width=r`."""
    return f"width={ratio:g}"


class HeteroFLOptions(FedAvgOptions):
    weighting: Weighting = "uniform"
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


@register_algorithm(
    "heterofl",
    "HeteroFL (Diao et al. 2021): width levels of one model, static BN, label split",
    HeteroFLOptions,
    needs_scalable=True,
)
def _make(
    family: ModelFamily, opts: HeteroFLOptions, *, clients_per_round: int, train: LocalTraining
) -> tuple[Strategy, LocalRecipe]:
    strategy = HeteroFL(family, clients_per_round=clients_per_round, train=train, **dict(opts))
    return strategy, LocalRecipe(
        forward=MaskedCrossEntropy()
    ) if opts.label_split else LocalRecipe()
