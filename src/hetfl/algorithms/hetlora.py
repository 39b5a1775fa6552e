"""HetLoRA: Cho, Liu, Mishra, Liu, Jiang, Yoon and Ramirez, "Heterogeneous LoRA for
Federated Fine-tuning of On-Device Foundation Models" (EMNLP 2024), §3.

Reproduced: clients fine-tune LoRA adapters of different ranks on one frozen base
(`hetfl.models.lora`; a rank-r client trains the leading r rows of each global A and
columns of each B); the server zero-pads every client's factors to the global rank and
averages them over all of the round's clients, zeros included (`normalisation:
all-clients`, `ZeroPaddedMean`), each client weighted per layer by the Frobenius norm of
its update ‖B_k A_k‖_F (`weighting: sparsity`, §3's sparsity-weighted aggregation); the
global model (rank R) is evaluated on the global test set, each client's own rank on its
local split.

Not reproduced: the local rank self-pruning of §3 (a client shrinking its rank when its
adapters' trailing components are small); clients keep their assigned rank.

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
from hetfl.algorithms.parts.lora_ranks import LoRARankOptions, rank_setup
from hetfl.algorithms.parts.method_registry import register_algorithm
from hetfl.core.client.recipe import LocalRecipe
from hetfl.core.server.assign import UniformSampling
from hetfl.core.server.strategy import Aggregation, Extras, Strategy
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
    strategy = Strategy(
        setup.family,
        train=train,
        sampler=UniformSampling(clients_per_round),
        assignment=setup.assignment,
        aggregation=Aggregation(weighting=weigh, reducer=reducer),
        extras=Extras(describe=lambda: dict(described)),
    )
    return strategy, LocalRecipe()
