"""FedALRC and Ada-FedALRC: Wei, Li, Liu and Wang, "Non-IID Federated Learning With Sharper
Risk Bound" (IEEE TNNLS 35(5), 2024), §IV, Algorithms 1-3, Tables IV-V, §V.

Reproduced:
- Shallow (linear) models, Algorithm 1: plain local SGD with learning rate η_l and, after
  every step, partial singular-value thresholding of the weight matrix W (C x D): keep
  σ_1..σ_ϑ and set σ_j ← max(0, σ_j − α η_l) for j > ϑ. This is the proximal step of
  α Σ_{j>ϑ} σ_j, the tail that the local objective (§IV-A) and Theorem 2 penalise; the rule
  as printed in Algorithm 1 shrinks the leading ϑ instead, and thresholds by the server η
  where the text says η_l. The bias takes the plain gradient step.
- Deep models, Algorithm 2: the batch loss is (1/B) Σ_i ℓ_i + α ℜ with
  ℜ = (1/Q) Σ_q (1/(BC)) Σ_{i,c} ε^q_ic f_c(x_i), fresh Rademacher signs ε^q ∈ {±1}^{B x C}
  per draw and batch, added only while the locality gate (1/B) Σ_i ℓ_i² ≤ r holds (r = 1 and
  ℓ* = 0, §V-B; evaluated on detached losses). ℜ has mean zero over ε, so the term acts as
  logit-space gradient noise; it is implemented literally, as the paper specifies.
- Server, Algorithm 1 and Table IV: Δ_k = (w − w_k) / ϖ_k, Δ = Σ_k p_k Δ_k,
  w ← w − γ (Σ_k p_k ϖ_k) Δ. This is FedNova's direction scaled by γ (`Scaled` around
  `NormalisedStep`, `hetfl.core.server_update`); with γ = 1 and α = 0 it *is* FedNova
  with plain SGD (the ablation of §V-D calls (γ = 1, α = 0) FedNova).
- Ada-FedALRC, Algorithm 3: the same direction −ηΔ (η = γ Σ_k p_k ϖ_k) into the Adagrad
  server optimiser FedAdagrad uses (`hetfl.core.server_opt`, β1 = 0): v ← v + (ηΔ)²,
  w ← w − β_η ηΔ / (√v + eps), with one server step size β_η (line 10 multiplies by β η
  although Δ already carries η; §V-B tunes the single symbol β_η), eps = 1e-3 (option
  `tau`, FedAdagrad's name for it) and v⁰ = eps (line 1; FedAdagrad's own default is eps²,
  set its `v0` to match).
- The local lr decays as in FedNova (§V-A): x0.1 after 50 % and x0.01 after 75 % of the
  rounds (FedNova's official code, `update_learning_rate`). HetFL applies it to every
  method through the run's `train.lr_schedule: {kind: step, milestones: [0.5, 0.75],
  gamma: 0.1}` (`hetfl.core.schedule`), which every configs/fedalrc_*.yaml sets,
  comparators included; the threshold α η_l of the linear form follows the decayed η_l.
- FedALRC-g, Table V (`variant: g`): linear models threshold every singular value (ϑ = 0,
  the trace norm the paper calls Tr(W)); deep models add the Rademacher term without the gate.

Ada-FedALRC's server step: with v⁰ = eps = 1e-3, the first Adagrad step on an update
u = ηΔ, β_η u / (√(v⁰ + u²) + eps), is invariant to the scale of u only where |u| ≫ √eps ≈
0.03; below that it is about β_η u / (√eps + eps) ≈ 31 β_η u, and so are later steps while
the summed u² stays below eps. There γ, FedNova's effective step Σ_k p_k ϖ_k and β_η
multiply, and no default fits every setting: the paper tunes β_η over {0.001, 0.005,
0.01, 0.05, 0.1, 0.2, 0.5} (§V-B), and so does configs/fedalrc_server_lr_fmnist.yaml, for
FedAdagrad and Ada-FedALRC separately. The option's default, 0.1, is FedAdagrad's.

Choices where the paper is silent:
- Q = 5 draws (the paper does not give Q). ϑ = 5 by default (the value the project's
  linear experiments fix); α = 0.1 and γ = 1.5 by default (the only deep-model values
  printed, Fig. 2).
- Which form applies is read from the model (`form: auto`): thresholding when the model's
  parameters are exactly one `nn.Linear` (the `linear` model), the Rademacher term
  otherwise. `form` forces either.
- Signs are drawn only on batches whose gate is open (Algorithm 2 samples them inside the
  `if`), from the client's training generator after its batch order, so a client's round
  depends only on (seed, round, client).
- HetFL clients send weights; the server forms (w − w_k)/ϖ_k, the same numbers as Algorithm
  1's Δ_k. ϖ_k is the client's count of SGD steps (FedNova's normaliser ‖a‖₁ for plain SGD;
  with momentum, which the paper does not use, FedNova's ‖a‖₁ generalises it).
- BatchNorm statistics take the FedAvg average; p_k ∝ n_k over the clients that answered; a
  round without results leaves the state and v unchanged.
"""

from __future__ import annotations

import warnings
from typing import Literal

from pydantic import Field, model_validator
from torch import nn

from hetfl.algorithms.base import ReducerOptions, register_algorithm
from hetfl.algorithms.fednova import StepNormaliser, normalised_strategy
from hetfl.algorithms.fedopt import FedAdagradOptions
from hetfl.core.init import build_model
from hetfl.core.local.parts import LocalRecipe
from hetfl.core.local.regularisers import PartialSVT, RademacherTerm
from hetfl.core.server_opt import ServerOptSettings
from hetfl.core.server_update import NormalisedStep, Scaled
from hetfl.core.strategy import Strategy
from hetfl.core.training import LocalTraining
from hetfl.core.types import ModelFamily
from hetfl.core.weighting import WeightingName


def linear_weight(model: nn.Module) -> str | None:
    """The weight's name when every parameter of `model` belongs to one `nn.Linear`."""
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if len(linears) != 1:
        return None
    prefix, layer = linears[0]
    dot = f"{prefix}." if prefix else ""
    owned = {dot + n for n, _ in layer.named_parameters()}
    return dot + "weight" if owned == {n for n, _ in model.named_parameters()} else None


# -- options and registration ---------------------------------------------------------------
Form = Literal["auto", "linear", "deep"]


class FedALRCOptions(ReducerOptions):
    alpha: float = Field(0.1, ge=0, allow_inf_nan=False, description="regulariser weight")
    gamma: float = Field(1.5, gt=0, allow_inf_nan=False, description="server lr scale")
    Q: int = Field(5, ge=1, description="Rademacher draws per batch (deep models)")
    theta: int = Field(5, ge=0, description="singular values kept (linear models)")
    r: float = Field(1.0, gt=0, allow_inf_nan=False, description="locality gate radius")
    variant: Literal["l", "g"] = Field(
        "l", description="l: local (gate, tail thresholding); g: global (no gate, theta = 0)"
    )
    form: Form = Field("auto", description="linear (thresholding) or deep (Rademacher term)")
    weighting: WeightingName = "samples"

    @model_validator(mode="after")
    def _global_variant_keeps_nothing(self) -> FedALRCOptions:
        if self.variant == "g" and "theta" in self.model_fields_set and self.theta != 0:
            raise ValueError(
                f"variant 'g' thresholds every singular value (theta = 0), got theta = "
                f"{self.theta}; drop theta or use variant 'l'"
            )
        return self


class AdaFedALRCOptions(FedALRCOptions, FedAdagradOptions):
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


def alrc_strategy(
    family: ModelFamily,
    method: str,
    opts: FedALRCOptions,
    clients_per_round: int,
    train: LocalTraining,
    server: ServerOptSettings,
) -> Strategy:
    """FedNova's normalised direction scaled by γ into `server`: plain steps of size 1
    (FedALRC, Algorithm 1) or Adagrad (Ada-FedALRC, Algorithm 3)."""
    return normalised_strategy(
        family,
        method=method,
        clients_per_round=clients_per_round,
        train=train,
        weighting_name=opts.weighting,
        direction=Scaled(NormalisedStep(prox=False), opts.gamma),
        server=server,
        reducer=opts.reducer_settings().factory(),
    )


@register_algorithm(
    "fedalrc",
    "FedALRC (Wei et al. 2024): local Rademacher regularisation, FedNova steps x gamma",
    FedALRCOptions,
)
def _make(
    family: ModelFamily, opts: FedALRCOptions, *, clients_per_round: int, train: LocalTraining
) -> tuple[Strategy, LocalRecipe]:
    recipe = regulariser_recipe(family, opts)
    strategy = alrc_strategy(
        family, "fedalrc", opts, clients_per_round, train, ServerOptSettings(kind="sgd", lr=1.0)
    )
    return strategy, recipe


@register_algorithm(
    "ada-fedalrc",
    "Ada-FedALRC (Wei et al. 2024): FedALRC local training, Adagrad server step",
    AdaFedALRCOptions,
)
def _make_ada(
    family: ModelFamily, opts: AdaFedALRCOptions, *, clients_per_round: int, train: LocalTraining
) -> tuple[Strategy, LocalRecipe]:
    recipe = regulariser_recipe(family, opts)
    server = ServerOptSettings(
        kind="adagrad", lr=opts.server_lr, tau=opts.tau, v0=opts.tau if opts.v0 is None else opts.v0
    )
    strategy = alrc_strategy(family, "ada-fedalrc", opts, clients_per_round, train, server)
    return strategy, recipe
