"""HetLoRA's local rank self-pruning (Cho et al., "Heterogeneous LoRA for Federated
Fine-tuning of On-Device Foundation Models", EMNLP 2024, §3, "Local Rank Self-Pruning"):
a client whose adapters' trailing components keep shrinking gives them up for good.

The rule (§3; arXiv 2401.06432). The paper's text
could not be read while this was written (the stored copies of arxiv.org/abs/2401.06432,
sciencestack.ai/paper/2401.06432 and deep-paper.org/en/paper/2401.06432 hold the abstract
and summaries only: "rank self-pruning locally"), so the rule is the one those summaries
and public re-implementations agree on (a FederatedScope-based `hetlora` client: the
trailing part's norm after training against a reference, pruned to ⌊γ r⌋, γ 0.99 and λ
0.01 by default; measaverb/SplitHetLoRA: the trailing slices from ⌊γ r⌋ in the loss, as
the product of the two factors' norms, where HetFL takes the norm of their product, as
the formula below writes it). A client k of
rank r_k adds to its local loss

    λ ‖B_{k, ⌊γ r_k⌋ : r_k} A_{k, ⌊γ r_k⌋ : r_k}‖_F

(the product of its factors' trailing r_k − ⌊γ r_k⌋ components, γ < 1 the decaying factor)
and, after local training, prunes to rank ⌊γ r_k⌋ when that trailing part's norm is
smaller than it was at the end of its previous round; it sends the pruned factors, keeps
the reduced rank from then on, and the server treats it at that rank (zero-padded as
every lower-rank client). To be checked against the paper's §3 when its text is at hand.

Choices where the paper is silent or the framework decides:

- the norm is summed over the adapted layers, one term per layer, and the rank is the
  client's, the same on every layer;
- a client never goes below rank 1, and at rank 1 (⌊γ⌋ = 0) has no trailing part, so
  neither regularises nor prunes; γ r is rounded to 9 decimals before the floor, so that
  0.29 · 100 is 29, not 28;
- a client's first participation has no previous round, so it never prunes then;
- the decision runs where the server aggregates, on the factors the client sent (the same
  factors and previous norm the client has: the same decision); the round is then
  reduced with the pruning client's factors cut to ⌊γ r_k⌋, as if it had sent only those
  (`PruningDecisions`), and from its next participation it downloads, trains and uploads
  ⌊γ r_k⌋ components (bytes and MACs at that rank). Only the bytes of the round it prunes
  in count its upload at the rank it trained (r_k − ⌊γ r_k⌋ components more than it
  sends in the paper);
- under `dynamic` assignment the pruned rank caps the rank a client draws.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from pydantic import Field

from hetfl.algorithms.parts.lora_aggregation import AdapterPairs
from hetfl.algorithms.parts.method_registry import Options
from hetfl.algorithms.parts.width_assignment import WidthAssignment
from hetfl.core.client.recipe import TrainContext, Vectorises
from hetfl.core.server.assign import round_specs
from hetfl.core.server.update import Contribution, RoundResults, ServerUpdate, reduce
from hetfl.core.server.weighting import Weighting
from hetfl.core.spec import Spec
from hetfl.core.state import ReducerFactory, State
from hetfl.core.types import ClientInfo, ClientTask
from hetfl.models.lora import RANK_KEY, LoRAFamily


class SelfPruningOptions(Options):
    """HetLoRA's local rank self-pruning (Cho et al., EMNLP 2024, §3): off by default."""

    enabled: bool = Field(
        False, description="clients regularise their trailing components and prune their rank"
    )
    gamma: float = Field(
        0.99,
        gt=0,
        lt=1,
        allow_inf_nan=False,
        description="γ, the decaying factor: a rank-r client prunes to ⌊γ r⌋ (at least 1)",
    )
    lam: float = Field(
        0.01,
        ge=0,
        allow_inf_nan=False,
        description="λ, the weight of ‖B_{⌊γr⌋:r} A_{⌊γr⌋:r}‖_F in the local loss",
    )


def pruned_rank(rank: int, gamma: float) -> int:
    """⌊γ r⌋, at least 1 (γ r rounded to 9 decimals first)."""
    return max(1, math.floor(round(gamma * rank, 9)))


def tail_norm(
    tensors: Mapping[str, torch.Tensor], pairs: AdapterPairs, gamma: float
) -> torch.Tensor | None:
    """Σ over layers of ‖B[:, s:r] A[s:r, :]‖_F, s = `pruned_rank(r, gamma)` and r the
    rank of `tensors` (A: r x in, B: out x r), differentiable in the factors; None when
    no layer has a trailing part (rank 1)."""
    terms = []
    for a_name, b_name in pairs:
        a, b = tensors[a_name], tensors[b_name]
        start = pruned_rank(a.shape[0], gamma)
        if start < a.shape[0]:
            terms.append(torch.linalg.matrix_norm(b[:, start:] @ a[start:]))
    return torch.stack(terms).sum() if terms else None


@dataclass(frozen=True)
class TailRegulariser:
    """The local loss's λ ‖B_{⌊γr⌋:r} A_{⌊γr⌋:r}‖_F on the client's live factors."""

    pairs: tuple[tuple[str, str], ...]
    gamma: float
    lam: float

    vectorises: ClassVar[Vectorises] = Vectorises.PER_CLIENT

    def __call__(
        self, outputs: torch.Tensor, y: torch.Tensor, per_sample: torch.Tensor, ctx: TrainContext
    ) -> torch.Tensor | None:
        norm = None if self.lam == 0 else tail_norm(ctx.params, self.pairs, self.gamma)
        return None if norm is None else self.lam * norm


class PrunedRanks:
    """The rank assignment with each client's pruned rank as a cap, and the decision that
    sets it (`decide`). Its record (each client's pruned rank and last trailing norm) is
    the strategy's extra state, so a resumed run prunes as an uninterrupted one."""

    def __init__(self, inner: WidthAssignment, family: LoRAFamily, gamma: float) -> None:
        self.inner, self.family, self.gamma = inner, family, gamma
        self.pairs = tuple(family.adapter_pairs())
        self.ranks: dict[int, int] = {}
        self.tails: dict[int, float] = {}

    def setup(self, clients: Sequence[ClientInfo]) -> None:
        self.inner.setup(clients)
        self.ranks, self.tails = {}, {}

    def _capped(self, cid: int, spec: Spec) -> Spec:
        own = self.ranks.get(cid)
        if own is None or own >= int(spec[RANK_KEY]):
            return spec
        return self.family.spec_at(own)

    def spec_of(self, info: ClientInfo) -> Spec:
        return self._capped(info.cid, self.inner.spec_of(info))

    def spec_in_round(self, round: int, info: ClientInfo, rng: torch.Generator) -> Spec:
        return self.specs_in_round(round, [info], rng)[0]

    def specs_in_round(
        self, round: int, infos: Sequence[ClientInfo], rng: torch.Generator
    ) -> list[Spec]:
        specs = round_specs(self.inner, round, infos, rng)
        return [self._capped(i.cid, s) for i, s in zip(infos, specs, strict=True)]

    def possible_specs(self) -> list[Spec]:
        """The configured ranks' specs: a pruned rank's tensors are slices of them."""
        return self.inner.possible_specs()

    def largest_spec(self) -> Spec:
        return self.inner.largest_spec()

    def give_largest(self, cid: int) -> None:
        self.inner.give_largest(cid)

    def rank_of(self, cid: int) -> int | None:
        """Client `cid`'s pruned rank (None: never pruned)."""
        return self.ranks.get(cid)

    def decide(self, cid: int, tensors: Mapping[str, torch.Tensor]) -> int | None:
        """After client `cid`'s training on `tensors` (its factors): its new rank ⌊γ r⌋
        when the trailing norm fell below its previous round's, else None."""
        rank = int(tensors[self.pairs[0][0]].shape[0])
        wide = {k: tensors[k].detach().to(torch.float64) for pair in self.pairs for k in pair}
        found = tail_norm(wide, self.pairs, self.gamma)
        if found is None:
            return None
        norm, previous = float(found), self.tails.get(cid)
        self.tails[cid] = norm
        if previous is None or not norm < previous:
            return None
        self.ranks[cid] = pruned_rank(rank, self.gamma)
        return self.ranks[cid]

    def extra_state(self) -> dict[str, Any]:
        return {
            "hetlora_pruned_ranks": sorted(self.ranks.items()),
            "hetlora_tail_norms": sorted(self.tails.items()),
        }

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        self.ranks = {int(c): int(r) for c, r in state["hetlora_pruned_ranks"]}
        self.tails = {int(c): float(n) for c, n in state["hetlora_tail_norms"]}


class PruningDecisions:
    """A server update that first lets every trained client decide its rank
    (`PrunedRanks.decide`); in a round where some client pruned, the round is reduced again
    with each pruning client's factors cut to its new rank, its map and its weight
    (`weighting`) those of the cut factors: what it sends in the paper. Then it steps as
    `inner`."""

    def __init__(
        self,
        inner: ServerUpdate,
        ranks: PrunedRanks,
        weighting: Weighting,
        reducer: ReducerFactory,
    ) -> None:
        self.inner, self.ranks = inner, ranks
        self.weighting, self.reducer = weighting, reducer

    def step(self, state: State, average: State, round: RoundResults) -> State:
        new_ranks = [self.ranks.decide(r.cid, r.tensors) for r in round.results]
        if any(new is not None for new in new_ranks):
            results, maps, weights = [], [], []
            for result, imap, weight, new in zip(
                round.results, round.maps, round.weights, new_ranks, strict=True
            ):
                if new is not None:
                    result = replace(result, tensors=self._cut(result.tensors, new))
                    imap = self.ranks.family.index_map(self.ranks.family.spec_at(new))
                    weight = self.weighting(result)
                results.append(result)
                maps.append(imap)
                weights.append(weight)
            sent = [
                Contribution(r.tensors, m, w)
                for r, m, w in zip(results, maps, weights, strict=True)
            ]
            average = reduce(self.reducer, state, sent, fill="keep")
            round = replace(round, results=results, maps=maps, weights=weights)
        return self.inner.step(state, average, round)

    def _cut(self, tensors: Mapping[str, torch.Tensor], rank: int) -> State:
        out = dict(tensors)
        for a_name, b_name in self.ranks.pairs:
            out[a_name], out[b_name] = tensors[a_name][:rank], tensors[b_name][:, :rank]
        return out

    def extra_state(self) -> dict[str, Any]:
        return self.inner.extra_state()

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        self.inner.load_extra_state(state)


def rank_trace(info: ClientInfo, task: ClientTask | None) -> dict[str, Any]:
    """The per-client trace's `rank`: the rank a client trains this round."""
    return {} if task is None else {"rank": int(task.spec[RANK_KEY])}
