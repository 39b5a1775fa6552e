"""HetLoRA: Cho, Liu, Mishra, Liu, Jiang, Yoon and Ramirez, "Heterogeneous LoRA for
Federated Fine-tuning of On-Device Foundation Models" (EMNLP 2024), §3.

Reproduced: clients fine-tune LoRA adapters of different ranks on one frozen base
(`hetfl.models.lora`; a rank-r client trains the leading r rows of each global A and
columns of each B); the server zero-pads every client's factors to the global rank and
averages them over all of the round's clients, zeros included (`normalisation:
all-clients`, `ZeroPaddedMean`), each client weighted per layer by the Frobenius norm of
its update ‖B_k A_k‖_F (`weighting: sparsity`, §3's sparsity-weighted aggregation); the
global model (rank R) is evaluated on the global test set, each client's own rank on its
local split. With `self_pruning.enabled`, §3's local rank self-pruning
(`hetfl.algorithms.parts.lora_pruning`): each client adds λ ‖B_{⌊γr⌋:r} A_{⌊γr⌋:r}‖_F
to its local loss and, when that trailing part's norm fell below its previous round's,
sends its factors cut to rank ⌊γ r⌋ and keeps that rank for the rest of the run; the
per-client trace records each client's rank per round (`rank`). Off by default (the
method's aggregation alone, as before).

Not reproduced: the bytes of the round a client prunes in count its upload at the rank it
trained (the part's docstring says why).

Choices where the paper is silent: the scale α / R is the same for every rank
(`hetfl.models.lora`); `normalisation: coverage` gives HeteroFL's rule instead (each
element averaged over the clients covering it) and `weighting: samples` or `uniform`
replace the sparsity weights, for comparisons; the base is the pretrained state given
(`pretrained`) or the model's initialisation from seed 0.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from hetfl.algorithms.parts.lora_aggregation import SparsityWeights, zero_padded_mean
from hetfl.algorithms.parts.lora_pruning import (
    PrunedRanks,
    PruningDecisions,
    SelfPruningOptions,
    TailRegulariser,
    rank_trace,
)
from hetfl.algorithms.parts.lora_ranks import LoRARankOptions, rank_setup
from hetfl.algorithms.parts.method_registry import register_algorithm
from hetfl.core.client.recipe import LocalRecipe
from hetfl.core.server.assign import Assignment, UniformSampling
from hetfl.core.server.strategy import Aggregation, Extras, Strategy
from hetfl.core.server.update import Averaged, ServerUpdate
from hetfl.core.server.weighting import Weighting, weighting
from hetfl.core.state import Accumulator, ReducerFactory
from hetfl.core.training import LocalTraining
from hetfl.core.types import ModelFamily


class HetLoRAOptions(LoRARankOptions):
    weighting: Literal["sparsity", "samples", "uniform"] = Field(  # type: ignore[assignment]
        "sparsity",
        description="each client's weight: sparsity, ‖B_k A_k‖_F per layer (HetLoRA's); "
        "samples, its training-sample count; uniform, 1 each",
    )
    normalisation: Literal["all-clients", "coverage"] = Field(
        "all-clients",
        description="all-clients: zero-padded, every element divided by the total weight of "
        "the round's clients (HetLoRA's); coverage: by the clients covering it (HeteroFL's)",
    )
    self_pruning: SelfPruningOptions = Field(
        default_factory=SelfPruningOptions,
        description="§3's local rank self-pruning: {enabled, gamma, lam}",
    )


@register_algorithm("hetlora", HetLoRAOptions)
def _make(
    family: ModelFamily, opts: HetLoRAOptions, *, clients_per_round: int, train: LocalTraining
) -> tuple[Strategy, LocalRecipe]:
    setup = rank_setup(family, opts)
    weigh: Weighting = (
        SparsityWeights(setup.family.adapter_pairs())
        if opts.weighting == "sparsity"
        else weighting(opts.weighting)
    )
    reducer: ReducerFactory = (
        zero_padded_mean if opts.normalisation == "all-clients" else Accumulator
    )
    described = {"ranks": list(opts.ranks), "scale": setup.family.scale}
    assignment: Assignment = setup.assignment
    update: ServerUpdate = Averaged()
    recipe, pruning = LocalRecipe(), opts.self_pruning
    if pruning.enabled:
        assignment = ranks = PrunedRanks(setup.assignment, setup.family, pruning.gamma)
        update = PruningDecisions(update, ranks, weigh, reducer)
        recipe = LocalRecipe(loss_terms=(TailRegulariser(ranks.pairs, pruning.gamma, pruning.lam),))
        described["self_pruning"] = {"gamma": pruning.gamma, "lam": pruning.lam}
    strategy = Strategy(
        setup.family,
        train=train,
        sampler=UniformSampling(clients_per_round),
        assignment=assignment,
        aggregation=Aggregation(weighting=weigh, server_update=update, reducer=reducer),
        extras=Extras(
            describe=lambda: dict(described),
            trace_fields=rank_trace if pruning.enabled else None,
        ),
    )
    return strategy, recipe
