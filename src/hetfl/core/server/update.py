"""Reduction and server updates: how a round's results become the new global state — parts
of a `Strategy` (`hetfl.core.server.strategy`).

A *reducer* combines client tensors written through their index maps, element by element:
any `hetfl.core.state.ReducerFactory`, `reference -> Reducer` with `add(local, index_map,
weight, scale)` and `result(previous, fill)` (the `Accumulator`'s weighted mean is the
default; `hetfl.core.server.robust` has the coordinate-wise median and trimmed mean). Every
reduction of a round goes through it: the weights (fill "keep": an element no client covers
keeps its value) and the deltas a direction is made of (fill "zero").

A *server update* takes the global state and the reduced weights and returns the new
state: `Averaged` keeps the reduced weights (FedAvg); `Optimised` moves the trainable
parameters along a *direction* with a server optimiser (`hetfl.core.server.optimisers`) and takes
the reduced weights for the rest (BatchNorm buffers). Directions compose:
`pseudo_gradient` (FedOpt), `NormalisedStep` (FedNova), `Scaled` (FedALRC's γ). The
optimiser's moments are the update's `extra_state`, checkpointed with the strategy.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch

from hetfl.core.server.optimisers import ServerOptimizer
from hetfl.core.spec import IndexMap
from hetfl.core.state import Fill, ReducerFactory, State, extract
from hetfl.core.types import ClientResult


class Contribution(NamedTuple):
    """One set of client tensors to reduce, with the map that places them, its weight and
    its optional per-global-tensor scale."""

    tensors: Mapping[str, torch.Tensor]
    index_map: IndexMap
    weight: float | Mapping[str, float]
    scale: Mapping[str, float] | None = None


def reduce(
    reducer: ReducerFactory,
    reference: Mapping[str, torch.Tensor],
    contributions: Sequence[Contribution],
    fill: Fill,
) -> State:
    """The contributions reduced in their order, over the tensors of `reference`."""
    r = reducer(reference)
    for c in contributions:
        r.add(c.tensors, c.index_map, c.weight, c.scale)
    return r.result(reference, fill)


@dataclass(frozen=True)
class RoundResults:
    """A round's valid results as aggregation sees them: each with the map it was planned
    with and its weight, the run's reducer and the global state's trainable parameters."""

    results: Sequence[ClientResult]
    maps: Sequence[IndexMap]
    weights: Sequence[float | Mapping[str, float]]
    parameters: Sequence[str]
    reducer: ReducerFactory


class ServerUpdate(Protocol):
    def step(self, state: State, average: State, round: RoundResults) -> State:
        """The new global state from the current one and the reduced weights."""
        ...

    def extra_state(self) -> dict[str, Any]: ...

    def load_extra_state(self, state: Mapping[str, Any]) -> None: ...


class Averaged:
    """The reduced weights are the new state (FedAvg)."""

    def step(self, state: State, average: State, round: RoundResults) -> State:
        return average

    def extra_state(self) -> dict[str, Any]:
        return {}

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        return None


Direction = Callable[[State, State, RoundResults], State]


def pseudo_gradient(state: State, average: State, round: RoundResults) -> State:
    """Δ = Σ p_k w_k − w on every parameter (Reddi et al., "Adaptive Federated
    Optimization", ICLR 2021, Alg. 2)."""
    return {k: average[k] - state[k] for k in round.parameters}


class NormalisedStep:
    """FedNova's direction −τ_eff Σ_k p_k g_k / ‖a_k‖₁ with g_k = w − w_k (Wang et al.,
    "Tackling the Objective Inconsistency Problem in Heterogeneous Federated Optimization",
    NeurIPS 2020, §4, Eq. 6-7, the official code's unnormalised rule), τ_eff = Σ_k p_k ‖a_k‖₁
    or, with a proximal term (`prox`), Σ_k p_k τ_k. Zero where no client covers an element.
    Each client returns ‖a_k‖₁ and τ_k in its extras (the `StepNormaliser` tracker of
    `hetfl.algorithms.fednova`)."""

    def __init__(self, *, prox: bool) -> None:
        self.prox = prox

    def __call__(self, state: State, average: State, round: RoundResults) -> State:
        params = set(round.parameters)
        weights = [_scalar(w) for w in round.weights]
        total = sum(weights)
        tau_eff = 0.0
        deltas = []
        for r, imap, weight in zip(round.results, round.maps, weights, strict=True):
            a_norm, steps = normaliser(r)
            tau_eff += weight / total * (steps if self.prox else a_norm)
            shared = [e for e in imap if e.global_name in params]
            sent = extract(state, shared)
            update = {k: sent[k] - r.tensors[k] for k in sent}
            scale = {e.global_name: 1 / a_norm for e in shared}
            deltas.append(Contribution(update, shared, weight, scale))
        normalised = reduce(round.reducer, state, deltas, fill="zero")
        return {k: -tau_eff * normalised[k] for k in params}


def _scalar(weight: float | Mapping[str, float]) -> float:
    if isinstance(weight, Mapping):
        raise TypeError(
            "FedNova's normalised step needs one weight per client (p_k), got per-tensor "
            "weights; use the 'samples' or 'uniform' weighting"
        )
    return weight


def normaliser(result: ClientResult) -> tuple[float, int]:
    """(‖a_k‖₁, τ_k) a FedNova client returned."""
    try:
        a_norm, steps = float(result.extras["a_norm"]), int(result.extras["steps"])
    except KeyError as exc:
        raise KeyError(
            f"client {result.cid} returned no FedNova normaliser {exc}; its program must use "
            "the StepNormaliser tracker"
        ) from None
    if not a_norm > 0:
        raise ValueError(f"client {result.cid} returned normaliser {a_norm}; need > 0")
    return a_norm, steps


class Scaled:
    """A direction times a constant (FedALRC's γ: Wei et al., "Non-IID Federated Learning
    With Sharper Risk Bound", TNNLS 2024, Alg. 1, w ← w − γ (Σ_k p_k ϖ_k) Δ)."""

    def __init__(self, direction: Direction, factor: float) -> None:
        self.direction, self.factor = direction, factor

    def __call__(self, state: State, average: State, round: RoundResults) -> State:
        return {k: self.factor * d for k, d in self.direction(state, average, round).items()}


class Optimised:
    """A server optimiser's step along a direction on the parameters it names; every other
    tensor (BatchNorm buffers, counters) takes the reduced weights."""

    def __init__(self, direction: Direction, optimizer: ServerOptimizer) -> None:
        self.direction, self.optimizer = direction, optimizer

    def step(self, state: State, average: State, round: RoundResults) -> State:
        direction = self.direction(state, average, round)
        moved = self.optimizer.step(state, direction)
        return {k: moved[k] if k in direction else average[k] for k in average}

    def extra_state(self) -> dict[str, Any]:
        return {"server_opt": self.optimizer.state_dict()}

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        self.optimizer.load_state_dict(state.get("server_opt", {}))
