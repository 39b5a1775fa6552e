"""FedALRC and Ada-FedALRC: Wei, Li, Liu and Wang, "Non-IID Federated Learning With Sharper
Risk Bound" (IEEE TNNLS 35(5), 2024), §IV, Algorithms 1-3, Tables IV-V, §V. Readings of the
printed algorithms and notes on tuning: docs/methods.md, "FedALRC".

Reproduced:
- Linear models, Algorithm 1: plain local SGD and, after every step, partial singular-value
  thresholding of W (C x D): keep σ_1..σ_ϑ, σ_j ← max(0, σ_j − α η_l) for j > ϑ, the
  proximal step of the tail α Σ_{j>ϑ} σ_j that §IV-A and Theorem 2 penalise (Algorithm 1
  as printed shrinks the leading ϑ, by the server η); the bias takes the plain step.
- Deep models, Algorithm 2: the batch loss (1/B) Σ_i ℓ_i + α ℜ, ℜ = (1/Q) Σ_q (1/(BC))
  Σ_{i,c} ε^q_ic f_c(x_i), fresh Rademacher signs ε^q ∈ {±1}^{B x C} per draw and batch,
  added while the locality gate (1/B) Σ_i ℓ_i² ≤ r holds (r = 1, ℓ* = 0, §V-B; on
  detached losses); ℜ has mean zero over ε and is implemented literally.
- Server, Algorithm 1 and Table IV: Δ_k = (w − w_k) / ϖ_k, Δ = Σ_k p_k Δ_k,
  w ← w − γ (Σ_k p_k ϖ_k) Δ: FedNova's direction scaled by γ (with γ = 1 and α = 0 it is
  FedNova with plain SGD, as §V-D's ablation says).
- Ada-FedALRC, Algorithm 3: that direction −ηΔ into FedAdagrad's server optimiser
  (β1 = 0): v ← v + (ηΔ)², w ← w − β_η ηΔ / (√v + eps), one step size β_η (`server_lr`),
  eps = 1e-3 (`tau`) and v⁰ = eps (line 1; `v0`).
- The local lr decays as in FedNova (§V-A; FedNova's code, `update_learning_rate`): x0.1
  after 50 % and x0.01 after 75 % of the rounds, `train.lr_schedule: {kind: step,
  milestones: [0.5, 0.75], gamma: 0.1}` in every configs/fedalrc_*.yaml, comparators
  included; the threshold α η_l follows the decayed η_l.
- FedALRC-g, Table V (`variant: g`): linear models threshold every singular value (ϑ = 0),
  deep models add the Rademacher term without the gate.

Choices where the paper is silent:
- Q = 5 draws; ϑ = 5 (the project's linear experiments); α = 0.1 and γ = 1.5 (the only
  deep-model values printed, Fig. 2);
- `form: auto` thresholds when the model's parameters are exactly one `nn.Linear` (the
  `linear` model) and adds the Rademacher term otherwise; `form` forces either;
- signs are drawn only on batches whose gate is open, from the client's training
  generator after its batch order, so a client's round depends on (seed, round, client);
- clients send weights and the server forms (w − w_k)/ϖ_k, ϖ_k the client's count of SGD
  steps (FedNova's ‖a‖₁, which also covers momentum);
- BatchNorm statistics take the FedAvg average; p_k ∝ n_k over the clients that answered;
  a round without results leaves the state and v unchanged.
"""

from __future__ import annotations

import warnings
from typing import Literal

from pydantic import Field, model_validator

from hetfl.algorithms.fednova import normalised_strategy
from hetfl.algorithms.parts.method_registry import AggregationOptions, register_algorithm
from hetfl.algorithms.parts.option_records import ServerOptimiserOptions
from hetfl.core.client.recipe import LocalRecipe
from hetfl.core.client.regularisers import PartialSVT, RademacherTerm
from hetfl.core.client.terms import StepNormaliser
from hetfl.core.init import build_model
from hetfl.core.roles import linear_weight
from hetfl.core.server.optimisers import ServerOptSettings
from hetfl.core.server.strategy import Strategy
from hetfl.core.server.update import NormalisedStep, Scaled
from hetfl.core.training import LocalTraining
from hetfl.core.types import ModelFamily

Form = Literal["auto", "linear", "deep"]


class FedALRCOptions(AggregationOptions):
    alpha: float = Field(0.1, ge=0, allow_inf_nan=False, description="α, the regulariser's weight")
    gamma: float = Field(1.5, gt=0, allow_inf_nan=False, description="γ, factor on FedNova's step")
    Q: int = Field(5, ge=1, description="Rademacher draws per batch (deep models)")
    theta: int = Field(5, ge=0, description="ϑ, leading singular values kept (linear models)")
    r: float = Field(1.0, gt=0, allow_inf_nan=False, description="locality gate: mean ℓ² ≤ r")
    variant: Literal["l", "g"] = Field(
        "l", description="l: local (gate, tail thresholding); g: global (no gate, theta = 0)"
    )
    form: Form = Field(
        "auto",
        description="linear (thresholding) or deep (Rademacher term); auto: linear when the "
        "model is one nn.Linear",
    )

    @model_validator(mode="after")
    def _global_variant_keeps_nothing(self) -> FedALRCOptions:
        if self.variant == "g" and "theta" in self.model_fields_set and self.theta != 0:
            raise ValueError(
                f"variant 'g' thresholds every singular value (theta = 0), got theta = "
                f"{self.theta}; drop theta or use variant 'l'"
            )
        return self


class AdaFedALRCOptions(FedALRCOptions, ServerOptimiserOptions):
    v0: float | None = Field(
        None, ge=0, description="initial second moment (default tau, Algorithm 3's v0 = eps)"
    )


def regulariser_recipe(family: ModelFamily, opts: FedALRCOptions) -> LocalRecipe:
    """The local half of FedALRC for the family's model: the regulariser of its form, and
    FedNova's step counter (ϖ_k); checks theta against the weight's shape."""
    model = build_model(family, family.global_spec([]))
    weight = linear_weight(model)
    form = opts.form if opts.form != "auto" else ("linear" if weight else "deep")
    ignored = {"linear": ("Q", "r"), "deep": ("theta",)}[form]
    for key in sorted(set(ignored) & opts.model_fields_set):
        warnings.warn(f"fedalrc option {key} does not apply to the {form} form", stacklevel=3)
    if form == "deep":
        term = RademacherTerm(opts.alpha, opts.Q, opts.r, gated=opts.variant == "l")
        return LocalRecipe(loss_terms=(term,), trackers=(StepNormaliser(), term))
    if weight is None:
        raise ValueError(
            f"form 'linear' needs a model whose parameters are one nn.Linear (model: linear); "
            f"{type(model).__name__} has {sum(1 for _ in model.parameters())} parameter tensors"
        )
    theta = 0 if opts.variant == "g" else opts.theta
    svt = PartialSVT(weight, model.get_parameter(weight).shape, opts.alpha, theta)
    return LocalRecipe(projections=(svt,), trackers=(StepNormaliser(),))


def server_of(opts: FedALRCOptions) -> tuple[str, ServerOptSettings]:
    """The method's name and server optimiser: plain steps of size 1 (FedALRC, Algorithm 1)
    or Adagrad (Ada-FedALRC, Algorithm 3)."""
    if isinstance(opts, AdaFedALRCOptions):
        v0 = opts.tau if opts.v0 is None else opts.v0
        return "ada-fedalrc", ServerOptSettings("adagrad", lr=opts.server_lr, tau=opts.tau, v0=v0)
    return "fedalrc", ServerOptSettings(kind="sgd", lr=1.0)


@register_algorithm(
    "fedalrc",
    FedALRCOptions,
)
@register_algorithm(
    "ada-fedalrc",
    AdaFedALRCOptions,
)
def _make(
    family: ModelFamily, opts: FedALRCOptions, *, clients_per_round: int, train: LocalTraining
) -> tuple[Strategy, LocalRecipe]:
    """The regulariser of the model's form; FedNova's normalised direction scaled by γ into
    the method's server optimiser."""
    recipe = regulariser_recipe(family, opts)
    method, server = server_of(opts)
    strategy = normalised_strategy(
        family,
        opts,
        method=method,
        clients_per_round=clients_per_round,
        train=train,
        direction=Scaled(NormalisedStep(prox=False), opts.gamma),
        server=server,
    )
    return strategy, recipe
