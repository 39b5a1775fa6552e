"""Local-only training: every client trains its own model on its own data and nothing is
shared — the floor any federated method must beat on the clients' local test splits (and
ScalableFL's "individual training" baseline, Table II of its paper).

Choices: the whole local model is private (its index map is empty), so it lives in the
client store, nothing is sent (zero bytes) and there is no global model to evaluate
(`global_acc` stays empty; read `local_acc`, best with `eval.local_eval: all`). Each client's
model is initialised from its own (seed, client) generator at its first participation;
clients train only in the rounds they are sampled, so `clients_per_round: num_clients`
gives every client the same number of local steps.
"""

from __future__ import annotations

from hetfl.algorithms.parts.method_registry import Options, register_algorithm
from hetfl.core.client.recipe import LocalRecipe
from hetfl.core.server.assign import UniformSampling, one_spec
from hetfl.core.server.maps import NothingShared
from hetfl.core.server.strategy import Aggregation, Strategy
from hetfl.core.server.weighting import uniform
from hetfl.core.training import LocalTraining
from hetfl.core.types import ModelFamily


class LocalOnlyOptions(Options):
    pass


@register_algorithm("local-only", LocalOnlyOptions)
def _make(
    family: ModelFamily, opts: LocalOnlyOptions, *, clients_per_round: int, train: LocalTraining
) -> tuple[Strategy, LocalRecipe]:
    strategy = Strategy(
        family,
        train=train,
        sampler=UniformSampling(clients_per_round),
        assignment=one_spec(family.global_spec([])),
        aggregation=Aggregation(weighting=uniform, transforms=[NothingShared()]),
    )
    return strategy, LocalRecipe()
