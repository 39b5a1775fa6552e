"""FedAdagrad, FedAdam and FedYogi: Reddi et al., "Adaptive Federated Optimization"
(ICLR 2021), Algorithm 2, with Flower's FedAdagrad/FedYogi strategies for the defaults the
paper leaves open.

Reproduced: clients run local SGD as in FedAvg; the server forms the pseudo-gradient
`Δ = Σ p_k w_k - w` (the FedAvg average minus the current weights, p_k ∝ n_k) and steps
with an adaptive optimiser (`hetfl.core.server.optimisers`): FedAdagrad with β1 = 0 (no server
momentum, as in Flower and FedALRC's Algorithm 3), FedAdam and FedYogi with β1 = 0.9,
β2 = 0.99; τ = 1e-3; no bias correction.

Choices where the paper is silent: the optimiser moves trainable parameters only —
BatchNorm running statistics and counters take the FedAvg average (adaptive steps on
running variances could make them negative); `v0` defaults to τ² (the paper asks v ≥ τ²;
Flower starts from 0, pass `v0: 0` to match it); server learning rates default to Flower's
(0.1 for FedAdagrad and FedAdam, 0.01 for FedYogi); a round without valid results leaves
the state and the moments unchanged.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from hetfl.algorithms.fedavg import one_model_strategy
from hetfl.algorithms.parts.method_registry import register_algorithm
from hetfl.algorithms.parts.option_records import MomentOptions, ServerOptimiserOptions
from hetfl.core.client.recipe import LocalRecipe
from hetfl.core.server.optimisers import ServerOptimizer, ServerOptKind, ServerOptSettings
from hetfl.core.server.strategy import Strategy
from hetfl.core.server.update import Optimised, pseudo_gradient
from hetfl.core.training import LocalTraining
from hetfl.core.types import ModelFamily


class FedAdagradOptions(ServerOptimiserOptions):
    server_optimizer: ClassVar[ServerOptKind] = "adagrad"


class FedAdamOptions(MomentOptions):
    server_optimizer: ClassVar[ServerOptKind] = "adam"


class FedYogiOptions(MomentOptions):
    server_optimizer: ClassVar[ServerOptKind] = "yogi"
    server_lr: float = Field(0.01, gt=0, description="η, the server optimiser's step size")


@register_algorithm("fedadagrad", FedAdagradOptions)
@register_algorithm("fedadam", FedAdamOptions)
@register_algorithm("fedyogi", FedYogiOptions)
def _make(
    family: ModelFamily,
    opts: FedAdagradOptions | FedAdamOptions | FedYogiOptions,
    *,
    clients_per_round: int,
    train: LocalTraining,
) -> tuple[Strategy, LocalRecipe]:
    """The server optimiser is the options class's `server_optimizer` (FedAdamOptions: adam)
    on the pseudo-gradient; buffers take FedAvg's average."""
    moments: dict[str, float] = (
        {"beta1": opts.beta1, "beta2": opts.beta2} if isinstance(opts, MomentOptions) else {}
    )
    server = ServerOptSettings(
        kind=opts.server_optimizer, lr=opts.server_lr, tau=opts.tau, v0=opts.v0, **moments
    )
    update = Optimised(pseudo_gradient, ServerOptimizer(server))
    strategy = one_model_strategy(
        family, opts, clients_per_round=clients_per_round, train=train, server_update=update
    )
    return strategy, LocalRecipe()
