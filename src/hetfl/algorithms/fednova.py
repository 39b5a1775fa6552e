"""FedNova: Wang et al., "Tackling the Objective Inconsistency Problem in Heterogeneous
Federated Optimization" (NeurIPS 2020), Section 4 (Eq. 6-7), and the official code
(JYWa/FedNova, `distoptim/FedNova.py`), whose unnormalised server rule is followed below.

Reproduced: each client tracks the normaliser ‖a_k‖₁ of its local optimiser while it trains
— plain SGD: ‖a‖₁ = τ_k; momentum ρ: per step c ← ρc + 1, ‖a‖₁ += c; proximal μ: per step
‖a‖₁ ← ‖a‖₁(1 - η μ) + 1 — and returns it with its weights. The server forms
g_k = w - w_k (the cumulative, learning-rate-scaled update, weight decay included) and
applies the official *unnormalised* rule

    w ← w - τ_eff Σ_k p_k g_k / ‖a_k‖₁,   τ_eff = Σ_k p_k ‖a_k‖₁   (prox: Σ_k p_k τ_k)

with p_k ∝ n_k over the clients that answered. This is not a re-weighted FedAvg: Flower's
baseline passes p_k τ_eff / ‖a_k‖₁ to a normalising average, which agrees only when all
‖a_k‖₁ are equal. With equal step counts and plain SGD the rule is FedAvg.

Choices where the paper is silent: with both momentum and μ the momentum recursion runs
first, then the proximal one, as the official optimiser does; momentum buffers are fresh
each round (`LocalTraining` creates the optimiser per round), and `train.keep_momentum` is
refused: ‖a‖₁ counts only this round's gradients, which a carried buffer breaks; BatchNorm
running statistics and counters take the FedAvg average, since they are not optimised; the
official server momentum (`gmf`) is not provided — a server optimiser on the same
direction is (`hetfl.core.server.optimisers`, used by FedALRC).
"""

from __future__ import annotations

from pydantic import Field

from hetfl.algorithms.fedavg import one_model_strategy
from hetfl.algorithms.parts.method_registry import AggregationOptions, register_algorithm
from hetfl.algorithms.parts.option_records import ProximalOptions
from hetfl.core.client.recipe import LocalRecipe
from hetfl.core.client.terms import ProximalTerm, StepNormaliser
from hetfl.core.server.optimisers import ServerOptimizer, ServerOptSettings
from hetfl.core.server.strategy import Strategy
from hetfl.core.server.update import Direction, NormalisedStep, Optimised
from hetfl.core.training import LocalTraining
from hetfl.core.types import ModelFamily


def normalised_strategy(
    family: ModelFamily,
    opts: AggregationOptions,
    *,
    method: str,
    clients_per_round: int,
    train: LocalTraining,
    direction: Direction,
    server: ServerOptSettings,
) -> Strategy:
    """A server that steps along a normalised direction (FedNova's, FedALRC's). ‖a‖₁ is
    local SGD's (§4, Eq. 6-7, for SGD, momentum and proximal SGD) and assumes momentum
    buffers start at zero each round: another local optimiser and `train.keep_momentum` are
    refused rather than normalised by the wrong count."""
    if train.optimizer != "sgd":
        raise ValueError(
            f"{method} normalises by the ‖a‖₁ of local SGD, got train.optimizer = "
            f"{train.optimizer!r}; use optimizer 'sgd'"
        )
    if train.keep_momentum:
        raise ValueError(
            f"{method} normalises by ‖a‖₁, which assumes momentum buffers start at zero each "
            "round; train.keep_momentum cannot be used with it"
        )
    update = Optimised(direction, ServerOptimizer(server))
    return one_model_strategy(
        family, opts, clients_per_round=clients_per_round, train=train, server_update=update
    )


class FedNovaOptions(ProximalOptions):
    mu: float = Field(0.0, ge=0, description="proximal weight (FedNova-Prox when > 0)")


@register_algorithm("fednova", FedNovaOptions)
def _make(
    family: ModelFamily, opts: FedNovaOptions, *, clients_per_round: int, train: LocalTraining
) -> tuple[Strategy, LocalRecipe]:
    """The normalised step applied as it is (plain server steps of size 1)."""
    strategy = normalised_strategy(
        family,
        opts,
        method="fednova",
        clients_per_round=clients_per_round,
        train=train,
        direction=NormalisedStep(prox=opts.mu > 0),
        server=ServerOptSettings(kind="sgd", lr=1.0),
    )
    prox = (ProximalTerm(opts.mu),) if opts.mu > 0 else ()
    return strategy, LocalRecipe(grad_transforms=prox, trackers=(StepNormaliser(opts.mu),))
