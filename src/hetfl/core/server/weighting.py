"""Weighting and scaling: how much each result counts in aggregation — parts of a
`Strategy` (`hetfl.core.server.strategy`).

A weighting gives a result its weight `p_k` (a float, or a mapping from global tensor name
to float, for per-tensor weights); the reducer normalises the weights over the clients
covering each element. A scaling, optional, multiplies each result's tensors per global
tensor before the reduction; it does not enter the normaliser. It is a round-level part: it
sees every result of the round with its task before any is scaled, since a factor may
depend on the other clients (FedFA's α, a mean of all the clients' norms over one client's:
`hetfl.algorithms.parts.fedfa_scaling`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Literal

from hetfl.core.types import ClientResult, Trained

Weighting = Callable[[ClientResult], float | Mapping[str, float]]
#: `(the round's trained clients, in id order) -> one {global name: factor} per client, in
#: that order`; a global name a client's mapping lacks is not scaled (factor 1).
Scaling = Callable[[Sequence[Trained]], Sequence[Mapping[str, float]]]
WeightingName = Literal["samples", "uniform"]


def by_samples(result: ClientResult) -> float:
    """p_k ∝ n_k, the client's training-sample count (McMahan et al., "Communication-
    Efficient Learning of Deep Networks from Decentralized Data", Alg. 1)."""
    return float(result.num_examples)


def uniform(result: ClientResult) -> float:
    """Weight 1 per client on each element it covers (HeteroFL's and ScalableFL's average)."""
    return 1.0


def weighting(name: WeightingName) -> Weighting:
    """The weighting a config names: `samples` or `uniform`."""
    if name == "samples":
        return by_samples
    if name == "uniform":
        return uniform
    raise ValueError(f"weighting must be 'samples' or 'uniform', got {name!r}")
