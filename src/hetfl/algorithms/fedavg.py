"""FedAvg: McMahan et al., "Communication-Efficient Learning of Deep Networks from
Decentralized Data" (AISTATS 2017), Algorithm 1 (FederatedAveraging).

Reproduced: clients run local SGD from the received global weights; the server takes the
average of the returned weights weighted by each client's training-sample count (renormalised
over the clients that answered), BatchNorm running statistics included (METHODS.md §6.1).

Choices where the paper is silent: clients excluded as failures carry no weight (the
average is over valid results only); `weighting: uniform` gives every client weight 1 (as
HeteroFL and ScalableFL do) and is recorded in the resolved config; a round without valid
results leaves the global state unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from hetfl.algorithms.base import ALGORITHMS, Algorithm, Options
from hetfl.core.client import ClientHooks
from hetfl.core.state import Accumulator
from hetfl.core.strategy import Strategy
from hetfl.core.types import ClientResult, Failure, ModelFamily, State

Weighting = Literal["samples", "uniform"]


class FedAvg(Strategy):
    name = "fedavg"

    def __init__(
        self,
        family: ModelFamily,
        *,
        clients_per_round: int,
        train: Mapping[str, Any],
        weighting: Weighting = "samples",
    ) -> None:
        super().__init__(family, clients_per_round=clients_per_round, train=train)
        if weighting not in ("samples", "uniform"):
            raise ValueError(f"weighting must be 'samples' or 'uniform', got {weighting!r}")
        self.weighting = weighting

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


def _make(
    family: ModelFamily, opts: FedAvgOptions, *, clients_per_round: int, train: dict[str, Any]
) -> tuple[Strategy, ClientHooks]:
    strategy = FedAvg(
        family, clients_per_round=clients_per_round, train=train, weighting=opts.weighting
    )
    return strategy, ClientHooks()


ALGORITHMS.register(
    "fedavg",
    Algorithm(
        "fedavg", "FedAvg (McMahan et al. 2017): sample-weighted averaging", FedAvgOptions, _make
    ),
)
