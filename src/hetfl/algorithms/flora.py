"""FLoRA: Wang, Shen, Wang, Zhou, Wang and Li, "FLoRA: Federated Fine-Tuning Large Language
Models with Heterogeneous Low-Rank Adaptations" (NeurIPS 2024), §3.2.

Reproduced: clients fine-tune LoRA adapters of different ranks on a frozen base
(`hetfl.models.lora`); the server stacks the round's factors, A = [A_1; ...; A_K] and
B = [p_1 B_1, ..., p_K B_K] with p_k ∝ n_k, whose product is the exact weighted sum
Σ_k p_k B_k A_k (no cross terms, unlike averaging the factors), and sends the stack to
every client; each merges it into its own base and re-initialises its adapters before it
trains again (`hetfl.algorithms.parts.lora_stacking`). The global model evaluated is the
base with the server's copy of the merged updates; each client is judged locally by its
own base and its last adapters.

Choices where the paper is silent or its code differs: the paper's code merges on the
server and sends the merged model; here every client merges the same stack, so its base
equals the server's copy without the base being sent (only the stack, Σ_k r_k (in + out)
numbers per layer, goes down); every client trains every round (a client that skipped a
round would miss its merge), so `train.clients_per_round` must be the number of clients;
the scale α / R is one for every rank (`hetfl.models.lora`).

Simulator only: the stack travels as a server phase's download, which the Flower adapter
does not carry.
"""

from __future__ import annotations

from hetfl.algorithms.parts.lora_ranks import LoRARankOptions, rank_setup
from hetfl.algorithms.parts.lora_stacking import (
    AdapterUpload,
    EveryClient,
    MergedGlobal,
    MergeThenTrain,
    NothingShared,
    StackedMerge,
    server_copy,
)
from hetfl.algorithms.parts.method_registry import register_algorithm
from hetfl.core.client.recipe import LocalRecipe
from hetfl.core.declared import DeclaredTensor
from hetfl.core.server.strategy import Aggregation, Evaluation, Extras, Strategy
from hetfl.core.server.weighting import uniform
from hetfl.core.training import LocalTraining
from hetfl.core.types import ModelFamily

SIMULATOR_ONLY = (
    "flora sends every client the round's stacked factors as a server phase's download, "
    "which the Flower adapter does not carry; run it in the simulator (hetfl run)"
)


class FLoRAOptions(LoRARankOptions):
    """The shared rank options; the stack weighs clients by their sample counts (p_k ∝ n_k)."""


@register_algorithm("flora", FLoRAOptions, simulator_only=SIMULATOR_ONLY)
def _make(
    family: ModelFamily, opts: FLoRAOptions, *, clients_per_round: int, train: LocalTraining
) -> tuple[Strategy, LocalRecipe]:
    if opts.weighting != "samples":
        raise ValueError(
            "flora stacks each client's factors with p_k ∝ n_k (the paper's weights); "
            f"weighting {opts.weighting!r} is not offered: leave it at samples"
        )
    setup = rank_setup(family, opts, mergeable=True)
    lora = setup.family
    sampler = EveryClient(clients_per_round)
    copies = [
        DeclaredTensor(server_copy(p), shape, "zeros", role="buffer")
        for p, shape in lora.shapes.items()
    ]
    described = {"ranks": list(opts.ranks), "scale": lora.scale}
    strategy = Strategy(
        lora,
        train=train,
        sampler=sampler,
        assignment=setup.assignment,
        aggregation=Aggregation(weighting=uniform, transforms=(NothingShared(),)),
        evaluation=Evaluation(global_eval=MergedGlobal(lora)),
        extras=Extras(
            declared=copies,
            server_phase=StackedMerge(lora, sampler),
            describe=lambda: dict(described),
        ),
    )
    layers = tuple(lora.layers)
    recipe = LocalRecipe(forward=MergeThenTrain(layers, lora.scale), upload=AdapterUpload(layers))
    return strategy, recipe
