"""FlexLoRA: Bai, Chen, Li, Ding and Zhou, "Federated Fine-tuning of Large Language Models
under Heterogeneous Tasks and Client Resources" (NeurIPS 2024), §3.

Reproduced: clients fine-tune LoRA adapters of different ranks on one frozen base
(`hetfl.models.lora`); the server forms each layer's full-size update Σ_k w_k B_k A_k, w_k
proportional to the clients' training-sample counts, takes its SVD and keeps the
truncation at the global rank R (`ProductSVD`); a rank-r client receives the leading r
components, which is the rank-r truncation of the same SVD (truncations are nested); the
global model (rank R) is evaluated on the global test set, each client's own rank on its
local split.

Choices where the paper is silent: the factors are split as B = U_r S_r, A = V_rᵀ (the
singular values on B); the scale α / R is one for every rank, so no rank rescales what it
receives (`hetfl.models.lora`); the server keeps only the rank-R truncation of the
aggregated update, not the full matrix (no client can receive more than R components);
`weighting: uniform` is available for comparisons.
"""

from __future__ import annotations

from hetfl.algorithms.parts.lora_aggregation import ProductSVD
from hetfl.algorithms.parts.lora_ranks import LoRARankOptions, rank_setup
from hetfl.algorithms.parts.method_registry import register_algorithm
from hetfl.core.client.recipe import LocalRecipe
from hetfl.core.server.assign import UniformSampling
from hetfl.core.server.strategy import Aggregation, Extras, Strategy
from hetfl.core.server.weighting import weighting
from hetfl.core.training import LocalTraining
from hetfl.core.types import ModelFamily


class FlexLoRAOptions(LoRARankOptions):
    """The shared rank options; `weighting` samples (the paper's data-size weights) or uniform."""


@register_algorithm("flexlora", FlexLoRAOptions)
def _make(
    family: ModelFamily, opts: FlexLoRAOptions, *, clients_per_round: int, train: LocalTraining
) -> tuple[Strategy, LocalRecipe]:
    setup = rank_setup(family, opts)
    described = {"ranks": list(opts.ranks), "scale": setup.family.scale}
    strategy = Strategy(
        setup.family,
        train=train,
        sampler=UniformSampling(clients_per_round),
        assignment=setup.assignment,
        aggregation=Aggregation(
            weighting=weighting(opts.weighting),
            server_update=ProductSVD(setup.family.adapter_pairs()),
        ),
        extras=Extras(describe=lambda: dict(described)),
    )
    return strategy, LocalRecipe()
