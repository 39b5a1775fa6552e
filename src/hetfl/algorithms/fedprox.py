"""FedProx: Li et al., "Federated Optimization in Heterogeneous Networks" (MLSys 2020),
Algorithm 2, local objective h_k(w; w^t) = F_k(w) + (mu/2) ||w - w^t||^2.

Reproduced: each local step adds mu (w - w^t) to the gradient of every shared parameter,
where w^t is the weights the client *received* this round (the anchor); aggregation is
FedAvg's (HetFL's choice: Algorithm 2 averages uniformly over clients sampled with
probability p_k, which is FedAvg's p_k-weighted average in expectation).

Choices where the paper is silent: private parameters (kept on the client, never received)
have no anchor and get no proximal term; the term is added before gradient clipping and
before the optimiser's weight decay and momentum, as if it were part of the loss; the
paper's inexact-solver tolerance gamma and straggler dropping are not modelled (a
deadline in `systems` drops slow clients instead). mu = 0 is FedAvg and is warned about.
"""

from __future__ import annotations

import warnings

from hetfl.algorithms.fedavg import one_model_strategy
from hetfl.algorithms.parts.method_registry import register_algorithm
from hetfl.algorithms.parts.option_records import ProximalOptions
from hetfl.core.client.recipe import LocalRecipe
from hetfl.core.client.terms import ProximalTerm
from hetfl.core.server.strategy import Strategy
from hetfl.core.server.update import Averaged
from hetfl.core.training import LocalTraining
from hetfl.core.types import ModelFamily


class FedProxOptions(ProximalOptions):
    """FedProx's options: the shared aggregation and proximal records."""


@register_algorithm("fedprox", FedProxOptions)
def _make(
    family: ModelFamily, opts: FedProxOptions, *, clients_per_round: int, train: LocalTraining
) -> tuple[Strategy, LocalRecipe]:
    if opts.mu == 0:
        warnings.warn("fedprox with mu = 0 is FedAvg", stacklevel=2)
    strategy = one_model_strategy(
        family, opts, clients_per_round=clients_per_round, train=train, server_update=Averaged()
    )
    return strategy, LocalRecipe(grad_transforms=(ProximalTerm(opts.mu),))
