"""FedFA: Park and Joe-Wong, "Federated Learning with Flexible Architectures" (ECML-PKDD
2024), §4 and Algorithms 1-3. Notes on the choices: docs/methods.md, "FedFA".

Reproduced: each client trains one architecture of a Pre-activation ResNet or of
MobileNetV2 (§5.1), a depth per section and a width per layer (`architecture_choice`: half
of the clients the smallest, the others the best within their budget by the ZiCo proxy,
§5.1; with the same seed, options and clients, its baselines FlexiFed and NeFL put the same
clients on the same architectures); the global model has the largest width of every layer
and the largest depth of every section (Alg. 1, line 3); a client receives the first d
blocks of each section, every layer a leading width slice (Alg. 3); its last block of a
section is grafted into the deeper blocks it lacks (Alg. 2, `grafting`); every tensor is
rescaled by α, the round's mean 95th-percentile norm over the client's own, and the global
model is sum(n_k α W_k) / sum(n_k) element-wise over the clients covering each element
(Alg. 1, lines 12-22, `hetfl.algorithms.parts.fedfa_scaling`); static BatchNorm without HeteroFL's
scaler (§5.1, App. 0.G).

Choices where the paper is silent or its text is loose:
- the candidate grid (depths {2, 3, 4} x widths {1/4, 1/2, 3/4, 1}) is a project default,
  since the paper's Table 5 is an image; on MobileNetV2 a depth d gives a stage of n
  repeats min(d, n) blocks (its one-block stages keep one; d = 4 is its full depth;
  `hetfl.models.scalable.depth_blocks`); a budget is forward MACs per sample, drawn
  uniformly between the cheapest and the dearest candidate when not given;
- elements no client covers keep their value (Alg. 1 as printed divides 0 by 0 there);
- in non-IID runs the logits of a client's absent classes are zeroed in training and its
  head contributes only its own classes' rows, as HeteroFL's code does (`label_split`);
  their norm is taken over those rows;
- `norm: rms` and `scale: weights_only` (see `hetfl.algorithms.parts.fedfa_scaling`);
- ZiCo runs on each client's data at set-up, a question the simulator asks it; the Flower
  adapter cannot ask it yet and refuses `choice: zico` with what to set instead.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from hetfl.algorithms.parts.architecture_choice import (
    ArchitectureOptions,
    architecture_choice,
    candidate_grid,
)
from hetfl.algorithms.parts.architecture_strategy import architecture_strategy
from hetfl.algorithms.parts.fedfa_scaling import NormKind, QuantileNormScaling, ScaledTensors
from hetfl.algorithms.parts.grafting import Grafting, sectioned
from hetfl.algorithms.parts.method_registry import register_algorithm
from hetfl.core.client.recipe import LocalRecipe
from hetfl.core.pricing import PassPricing
from hetfl.core.server.strategy import Strategy
from hetfl.core.training import LocalTraining
from hetfl.core.types import ModelFamily


class FedFAOptions(ArchitectureOptions):
    depths: list[int] = Field(
        [2, 3, 4],
        description="candidate depths, blocks in every section (mobilenetv2, efficientnetv2-s "
        "and -tiny: min(depth, n) in a stage of n repeats, full at 4, 15 and 3; >= 2 where "
        "any is deeper: grafting copies a section's last block, an identity block only from "
        "depth 2)",
    )
    norm: NormKind = Field(
        "l2",
        description="the 95th-percentile norm behind alpha: l2 (the paper's) or rms (l2 over "
        "the square root of the entries kept: no bias toward narrow layers)",
    )
    scale: ScaledTensors = Field(
        "all", description="which tensors alpha rescales: all, or weights_only (conv and linear)"
    )

    @model_validator(mode="after")
    def _grafting_has_identity_blocks(self) -> FedFAOptions:
        candidate_grid(self.depths, self.widths, grafting=True)
        return self


@register_algorithm("fedfa", FedFAOptions, needs="scalable", needs_macs=True)
def _make(
    family: ModelFamily,
    opts: FedFAOptions,
    *,
    clients_per_round: int,
    train: LocalTraining,
    macs: PassPricing,
) -> tuple[Strategy, LocalRecipe]:
    """Architectures chosen at set-up, grafting and label-split maps, the round's quantile
    norms as scales, per-architecture evaluation after a statistics pass."""
    blocks = sectioned(family, "fedfa")
    choice, query = architecture_choice(
        family,
        opts,
        method="fedfa",
        normalisation={"bn": "static", "scaler": False},  # §5.1, App. 0.G: no scaler
        batch_size=train.batch_size,
        macs=macs,
    )
    return architecture_strategy(
        family,
        opts,
        choice,
        query,
        train=train,
        clients_per_round=clients_per_round,
        transforms=[Grafting(blocks, choice.global_spec)],
        stats_pass=True,
        scaling=QuantileNormScaling(family, norm=opts.norm, scale=opts.scale),
    )
