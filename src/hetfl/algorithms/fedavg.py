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
from typing import Literal

import torch

from hetfl.algorithms.base import Options, register_algorithm
from hetfl.core.init import build_model
from hetfl.core.local.parts import LocalRecipe
from hetfl.core.roles import head_tensor_names, norm_tensor_names
from hetfl.core.spec import IndexMap, Spec
from hetfl.core.state import Accumulator
from hetfl.core.strategy import Strategy
from hetfl.core.training import LocalTraining
from hetfl.core.types import ClientResult, Failure, ModelFamily, State

Weighting = Literal["samples", "uniform"]


class FedAvg(Strategy):
    name = "fedavg"

    def __init__(
        self,
        family: ModelFamily,
        *,
        clients_per_round: int,
        train: LocalTraining,
        weighting: Weighting = "samples",
        private_norm: bool = False,
        private_head: bool = False,
    ) -> None:
        super().__init__(family, clients_per_round=clients_per_round, train=train)
        if weighting not in ("samples", "uniform"):
            raise ValueError(f"weighting must be 'samples' or 'uniform', got {weighting!r}")
        self.weighting = weighting
        self.private_norm, self.private_head = private_norm, private_head
        self._private: dict[Spec, set[str]] = {}

    def index_map_for(self, spec: Spec) -> IndexMap:
        """The family's map without the private layers."""
        imap = super().index_map_for(spec)
        if not (self.private_norm or self.private_head):
            return imap
        private = self._private.get(spec)
        if private is None:
            with torch.device("meta"):
                model = build_model(self.family, spec)
            private = set()
            if self.private_norm:
                norms = norm_tensor_names(model)
                if not norms:
                    raise ValueError(
                        f"private_norm (FedBN) needs normalisation layers; the model for "
                        f"{spec} has none"
                    )
                private |= norms
            if self.private_head:
                private |= head_tensor_names(model)
            self._private[spec] = private
        return [e for e in imap if e.local not in private]

    def client_weight(self, result: ClientResult) -> float:
        return float(result.num_examples) if self.weighting == "samples" else 1.0

    def aggregate(
        self, round: int, results: Sequence[ClientResult], failures: Sequence[Failure]
    ) -> State:
        if not results:
            return dict(self.global_state)
        acc = Accumulator(self.global_state)
        for r in results:
            acc.add(r.tensors, self.result_map(r), weight=self.client_weight(r))
        return acc.result(self.global_state, fill="keep")


class FedAvgOptions(Options):
    weighting: Weighting = "samples"
    private_norm: bool = False
    private_head: bool = False


class FedBNOptions(FedAvgOptions):
    private_norm: bool = True


class FedPerOptions(FedAvgOptions):
    private_head: bool = True


@register_algorithm(
    "fedavg", "FedAvg (McMahan et al. 2017): sample-weighted averaging", FedAvgOptions
)
@register_algorithm(
    "fedbn",
    "FedBN (Li et al. 2021): private normalisation layers",
    FedBNOptions,
    needs_scalable=True,
)
@register_algorithm("fedper", "FedPer (Arivazhagan et al. 2019): a private head", FedPerOptions)
def _make(
    family: ModelFamily, opts: FedAvgOptions, *, clients_per_round: int, train: LocalTraining
) -> tuple[Strategy, LocalRecipe]:
    strategy = FedAvg(family, clients_per_round=clients_per_round, train=train, **dict(opts))
    return strategy, LocalRecipe()
