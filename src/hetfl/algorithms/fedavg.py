"""FedAvg: McMahan et al., "Communication-Efficient Learning of Deep Networks from
Decentralized Data" (AISTATS 2017), Algorithm 1 (FederatedAveraging).

Reproduced: clients run local SGD from the received global weights; the server takes the
average of the returned weights weighted by each client's training-sample count (renormalised
over the clients that answered), BatchNorm running statistics included (HetFL's choice,
as FedNova's and DTFL's code do: the paper's model has no BatchNorm).

Choices where the paper is silent: clients excluded as failures carry no weight (the
average is over valid results only); `weighting: uniform` gives every client weight 1 (as
HeteroFL and ScalableFL do) and is recorded in the resolved config; a round without valid
results leaves the global state unchanged.

Private layers, as options of FedAvg (and so of every method built on it):

- FedBN, Li et al., "FedBN: Federated Learning on Non-IID Features via Local Batch
  Normalization" (ICLR 2021), §3: `private_norm` keeps every
  normalisation tensor (affine and running statistics) on its client;
- FedPer, Arivazhagan et al., "Federated Learning with Personalization Layers" (2019), §3:
  `private_head` keeps the classifier head on its client.

Private tensors are found from the model's structure (`hetfl.core.roles`), start from the
client's own seeded initialisation at its first participation and are never sent. With
either option there is no complete global model, so `global_acc` is null and the method is
judged by `local_acc` (each client's model with its private layers on its local test split).
"""

from __future__ import annotations

from collections.abc import Sequence

from hetfl.algorithms.parts.method_registry import AggregationOptions, register_algorithm
from hetfl.algorithms.parts.option_records import PrivateHead, PrivateLayerOptions, PrivateNorm
from hetfl.core.client.recipe import LocalRecipe
from hetfl.core.server.assign import one_spec
from hetfl.core.server.maps import MapTransform, private_layers
from hetfl.core.server.strategy import Aggregation, Strategy
from hetfl.core.server.update import Averaged, ServerUpdate
from hetfl.core.server.weighting import weighting
from hetfl.core.training import LocalTraining
from hetfl.core.types import ModelFamily


class FedAvgOptions(PrivateLayerOptions):
    """FedAvg's options: the shared aggregation and private-layer records."""


class FedBNOptions(PrivateLayerOptions):
    private_norm: PrivateNorm = True


class FedPerOptions(PrivateLayerOptions):
    private_head: PrivateHead = True


def one_model_strategy(
    family: ModelFamily,
    opts: AggregationOptions,
    *,
    clients_per_round: int,
    train: LocalTraining,
    server_update: ServerUpdate,
    transforms: Sequence[MapTransform] = (),
) -> Strategy:
    """The server of FedAvg and the methods that change only its update (FedOpt, FedNova,
    FedALRC) or local training (FedProx): the options' sampling, the family's one spec,
    weighting and reducer, then `server_update`."""
    return Strategy(
        family,
        train=train,
        sampler=opts.sampler(clients_per_round),
        assignment=one_spec(family.global_spec([])),
        aggregation=Aggregation(
            weighting=weighting(opts.weighting),
            server_update=server_update,
            transforms=transforms,
            reducer=opts.reducer.build(),
        ),
    )


@register_algorithm("fedavg", FedAvgOptions)
@register_algorithm(
    "fedbn",
    FedBNOptions,
    needs="scalable",
)
@register_algorithm("fedper", FedPerOptions)
def _make(
    family: ModelFamily, opts: FedAvgOptions, *, clients_per_round: int, train: LocalTraining
) -> tuple[Strategy, LocalRecipe]:
    strategy = one_model_strategy(
        family,
        opts,
        clients_per_round=clients_per_round,
        train=train,
        server_update=Averaged(),
        transforms=private_layers(family, norm=opts.private_norm, head=opts.private_head),
    )
    return strategy, LocalRecipe()
