"""What a method receives from the cost model: a pass's MACs, and the costs of a split model
at each of its cuts, for methods that plan from them.

FedFA's architecture choice (and FlexiFed's and NeFL's, which share it) prices each
candidate architecture by the forward MACs of one sample (`PassPricing`). DTFL's tier
scheduler ("Speed up Federated Learning in Heterogeneous Environment: A Dynamic Tiering
Approach", §3.3, "Tier Profiling") estimates a client's round in every tier from a
profile of each tier made once, before training, on a standard batch: the client's and the
server's compute and the data each batch sends. HetFL prices those profiles with the same
cost model that charges the clients (`hetfl.systems.costs`), so a profile is exact for the
simulated clock rather than a constant copied from a paper.

The face prices (it may import the systems layer); a method receives a `PassPricing` through
its typed `macs` argument, or a `SplitPricing` through its typed `costs` argument, and asks it
for what it trains, so `algorithms/` never imports `systems/`. This module imports only the
core's plain types.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from hetfl.core.spec import Spec
from hetfl.core.types import PassRecord


@dataclass(frozen=True)
class CutCost:
    """One cut priced for one standard batch of `batch` samples.

    `client_macs`: training the client's side (with whatever head it trains) on the batch;
    `server_macs`: training the server's side on the batch's activations; `batch_bytes`:
    the activations and labels the batch sends up; `model_bytes`: the client side's tensors,
    sent down with the task and back up with the result, once per round.
    """

    batch: int
    client_macs: int
    server_macs: int
    batch_bytes: int
    model_bytes: int

    def __post_init__(self) -> None:
        if self.batch < 1:
            raise ValueError(f"a cut is priced on a batch of at least 1 sample, got {self.batch}")
        for name in ("client_macs", "server_macs", "batch_bytes", "model_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"CutCost.{name} must be >= 0, got {getattr(self, name)}")

    def summary(self) -> dict[str, float]:
        """The profile as a run's summary and start banner show it."""
        return {
            "client GMAC/batch": round(self.client_macs / 1e9, 4),
            "server GMAC/batch": round(self.server_macs / 1e9, 4),
            "sent MB/batch": round(self.batch_bytes / 1e6, 4),
            "model MB": round(self.model_bytes / 1e6, 4),
        }


class PassPricing(Protocol):
    """Prices one pass of a model (`hetfl.systems.costs.MacCounter`): `pass_macs(record,
    input_shape)`, the MACs of one pass of `record` (not multiplied by its count) on inputs
    of `input_shape`."""

    def pass_macs(self, record: PassRecord, input_shape: tuple[int, ...]) -> int: ...


class SplitPricing(Protocol):
    """Prices the two sides of a split model (`hetfl.systems.costs.SplitPricer`).

    `server_rate` is the server's compute rate in MAC/s; `cut_cost(client, server, batch)`
    prices training the models of specs `client` (on the data) and `server` (on the
    client's output) on one batch of `batch` samples."""

    @property
    def server_rate(self) -> float: ...

    def cut_cost(self, client: Spec, server: Spec, batch: int) -> CutCost: ...


def check_rate(rate: float) -> float:
    """A compute rate in MAC/s: positive and finite."""
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"a server rate must be a positive finite number of MAC/s, got {rate!r}")
    return rate
