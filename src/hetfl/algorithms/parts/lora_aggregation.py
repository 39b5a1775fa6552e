"""How heterogeneous-rank LoRA factors are combined: HetLoRA's zero-padded, sparsity-
weighted mean (a reducer and a weighting), FlexLoRA's product-space SVD (a server update)
and FLoRA's stacking (an exact sum of products).

A client of rank r trains A_k (r x in) and B_k (out x r), the leading slices of the rank-R
global factors (`hetfl.models.lora`); its update to a layer is s B_k A_k, with one scale s
for every rank, so these rules work on the factors and their products alone.

- Zero-padding (Cho et al., "Heterogeneous LoRA for Federated Fine-tuning of On-Device
  Foundation Models", EMNLP 2024, §3): each client's factors padded with zeros to rank R
  and averaged over *all* the round's clients, `ZeroPaddedMean`; HeteroFL's nested-slice
  mean (each element over the clients covering it) is the `Accumulator`'s. HetLoRA weighs
  a client by the Frobenius norm of its update ‖B_k A_k‖_F ("sparsity-weighted"), per
  layer: `sparsity_weights`.
- FlexLoRA (Bai et al., "Federated Fine-tuning of Large Language Models under Heterogeneous
  Tasks and Client Resources", NeurIPS 2024, §3): the server forms ΔW = Σ_k w_k B_k A_k
  (w_k normalised weights), takes its SVD U S Vᵀ and keeps the rank-R factors B = U_R S_R,
  A = V_Rᵀ (`ProductSVD`); SVD truncations are nested, so the leading r rows and columns a
  rank-r client extracts are ΔW's best rank-r approximation (Eckart-Young).
- FLoRA (Wang et al., "FLoRA: Federated Fine-Tuning Large Language Models with
  Heterogeneous Low-Rank Adaptations", NeurIPS 2024, §3.2): the factors stacked,
  A = [A_1; ...; A_K] and B = [p_1 B_1, ..., p_K B_K], so B A = Σ_k p_k B_k A_k exactly
  (`stack_factors`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from hetfl.core.server.update import RoundResults
from hetfl.core.spec import IndexMap
from hetfl.core.state import Accumulator, Fill, State, check_fill, merge_estimate, untouched
from hetfl.core.types import ClientResult

#: (A's global name, B's global name) of each adapted layer; a client's local names are
#: the same (`hetfl.models.lora.LoRAFamily.index_map`).
AdapterPairs = Sequence[tuple[str, str]]


class ZeroPaddedMean:
    """Each global element's weighted sum over the clients covering it divided by the
    total weight of *every* client that sent the tensor, covering the element or not: the
    mean of the clients' tensors zero-padded to the global shape (HetLoRA's aggregation).
    An element no client covers keeps its value (fill "keep") or is zero ("zero"), as the
    `Accumulator`'s; scales multiply values, as there."""

    def __init__(self, reference: Mapping[str, torch.Tensor]) -> None:
        self._sums = Accumulator(reference)
        self._reference = reference
        self._senders: dict[str, float] = {}

    def add(
        self,
        local: Mapping[str, torch.Tensor],
        index_map: IndexMap,
        weight: float | Mapping[str, float] = 1.0,
        scale: Mapping[str, float] | None = None,
    ) -> None:
        self._sums.add(local, index_map, weight, scale)
        for name in {e.global_name for e in index_map}:
            w = float(weight.get(name, 0.0) if isinstance(weight, Mapping) else weight)
            self._senders[name] = self._senders.get(name, 0.0) + w

    def result(self, previous: Mapping[str, torch.Tensor], fill: Fill = "keep") -> State:
        check_fill(fill)
        means = self._sums.result(previous, fill="zero")
        out: State = {}
        for name, prev in previous.items():
            count = self._sums.covered(name)
            total = self._senders.get(name, 0.0)
            if count is None or total <= 0.0:
                out[name] = untouched(prev, fill)
                continue
            hit = count > 0
            padded = means[name].to(torch.float64) * count / total
            out[name] = merge_estimate(prev, padded, hit, fill)
        return out


def zero_padded_mean(reference: Mapping[str, torch.Tensor]) -> ZeroPaddedMean:
    """The `ReducerFactory` of `ZeroPaddedMean`."""
    return ZeroPaddedMean(reference)


def product(result: ClientResult, a_name: str, b_name: str) -> torch.Tensor:
    """B_k A_k (out x in) of one client's layer, in float64."""
    a, b = result.tensors[a_name], result.tensors[b_name]
    return b.to(torch.float64) @ a.to(torch.float64)


class SparsityWeights:
    """HetLoRA's weight of a client on each layer: ‖B_k A_k‖_F, on both of the layer's
    factors (the reducer normalises it over the clients)."""

    def __init__(self, pairs: AdapterPairs) -> None:
        self.pairs = tuple(pairs)

    def __call__(self, result: ClientResult) -> Mapping[str, float]:
        out: dict[str, float] = {}
        for a, b in self.pairs:
            norm = float(torch.linalg.matrix_norm(product(result, a, b)))
            out[a] = out[b] = norm
        return out


def truncated_factors(delta: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) with B A the best rank-`rank` approximation of `delta` (out x in): B = U_r S_r
    (out x r), A = V_rᵀ (r x in), from the SVD in float64; ranks beyond min(out, in) are
    zero."""
    u, s, vh = torch.linalg.svd(delta.to(torch.float64), full_matrices=False)
    k = min(rank, s.numel())
    a = torch.zeros(rank, delta.shape[1], dtype=torch.float64)
    b = torch.zeros(delta.shape[0], rank, dtype=torch.float64)
    a[:k] = vh[:k]
    b[:, :k] = u[:, :k] * s[:k]
    return a, b


def weighted_product(
    results: Sequence[ClientResult], weights: Sequence[float], a_name: str, b_name: str
) -> torch.Tensor:
    """Σ_k w_k B_k A_k over `results`, the weights normalised to sum to 1 (float64)."""
    total = float(sum(weights))
    if not total > 0:
        raise ValueError(f"the clients' weights must have a positive sum, got {list(weights)}")
    terms = [w / total * product(r, a_name, b_name) for r, w in zip(results, weights, strict=True)]
    return torch.stack(terms).sum(dim=0)


class ProductSVD:
    """FlexLoRA's server update: each layer's global factors become the rank-R SVD
    truncation of Σ_k w_k B_k A_k over the round's clients (`truncated_factors`); other
    tensors take the reduced weights. Client weights must be one number per client."""

    def __init__(self, pairs: AdapterPairs) -> None:
        self.pairs = tuple(pairs)

    def step(self, state: State, average: State, round: RoundResults) -> State:
        weights = [_scalar(w) for w in round.weights]
        new = dict(average)
        for a_name, b_name in self.pairs:
            delta = weighted_product(round.results, weights, a_name, b_name)
            a, b = truncated_factors(delta, state[a_name].shape[0])
            new[a_name] = a.to(state[a_name].dtype)
            new[b_name] = b.to(state[b_name].dtype)
        return new

    def extra_state(self) -> dict[str, Any]:
        return {}

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        return None


def _scalar(weight: float | Mapping[str, float]) -> float:
    if isinstance(weight, Mapping):
        raise TypeError(
            "FlexLoRA weighs each client's whole update by one number: use the 'samples' "
            "or 'uniform' weighting"
        )
    return float(weight)


def stack_factors(
    factors: Sequence[tuple[torch.Tensor, torch.Tensor]], weights: Sequence[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """FLoRA's stacking of the clients' (A_k, B_k): A = [A_1; ...; A_K] (Σ r_k x in) and
    B = [p_1 B_1, ..., p_K B_K] (out x Σ r_k), p_k the weights normalised, so that
    B A = Σ_k p_k B_k A_k exactly; its size grows with the cohort's ranks."""
    total = float(sum(weights))
    if not factors or not total > 0:
        raise ValueError("stacking needs at least one client and weights with a positive sum")
    a = torch.cat([a for a, _ in factors], dim=0)
    b = torch.cat([w / total * b for (_, b), w in zip(factors, weights, strict=True)], dim=1)
    return a, b
