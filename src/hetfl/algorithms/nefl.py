"""NeFL: Kang et al., "NeFL: Nested Model Scaling for Federated Learning with System
Heterogeneous Clients" (2023), as the authors' code runs it (honggkang/nested-federated-
learning: `utils/NeFedAvg.py`, `models/blocks.py` `BasicBlockM`, `NeFL-pre-resnet.py`),
and as FedFA compares against it (Park and Joe-Wong, "Federated Learning with Flexible
Architectures", ECML-PKDD 2024, §2.1 and §5: the width-and-depth scenario).

Reproduced: sub-models of one Pre-ResNet scaled in width by nested slices
(`[:ceil(r * out), :ceil(r * in)]`) and in depth by skipping the last blocks of each
section; a learnable scalar step size per residual block multiplies its residual branch
(`x + s_l f_l(x)`, starting at 1: `hetfl.models.blocks.StepSize`); the "inconsistent"
parameters, every BatchNorm tensor (affine and running statistics) and the step sizes,
are kept per sub-model under group-qualified names (`<sub-model>/<name>`) and averaged
only among the clients that trained that sub-model (uniformly); every other weight is
averaged uniformly over the clients whose sub-model covers each element, elements no
client covered keeping their value (`NeFedAvg`). The largest sub-model some client trains
(most MACs per sample) with its own BatchNorm and step sizes is the global model
(`global_acc`); every sub-model is evaluated (`arch=<label>`, as the code tests each), and
each client on its own (`local arch=<label>`).

Which client trains which sub-model: FedFA's assignment (`architecture_choice`, the same
options: a depth in every section x a width), where the code deals them by device class in
client-id order, so that with the same seed, candidates and clients NeFL and FedFA put the
same clients on the same architectures and the comparison is like for like.

Choices where the code differs or is silent:
- a skipped block is absent from the sub-model (not built, not sent, not priced) where the
  code keeps it with its step size frozen at 0: the outputs are the same, since a skipped
  block is never a section's first and its shortcut is the identity;
- BatchNorm's `num_batches_tracked` is averaged like the other statistics (the code sums
  it); with BatchNorm's momentum it affects nothing;
- each client's optimiser state is not kept between rounds unless `train.keep_momentum`
  says so (the pre-trained script keeps it);
- in non-IID runs the logits of a client's absent classes are zeroed in training and each
  head row is averaged over the clients holding its class (`label_split`, on by default),
  as FedFA does: FedFA's paper applies it to every method it compares (§5.1);
  `label_split: false` trains without it;
- only Pre-ResNet and EfficientNetV2 take step sizes (on EfficientNetV2's blocks that add
  their input, `hetfl.models.efficientnet`): NeFL refuses MobileNetV2 (FedFA and FlexiFed
  take it);
- when the chosen sub-models are not nested (d3-w0.25 and d2-w0.5, say), the global state
  spans their per-section maximum, which no client trains as a whole: its BatchNorm and
  step sizes, under plain names, are never trained nor evaluated.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hetfl.algorithms.parts.architecture_choice import (
    ArchitectureChoice,
    ArchitectureOptions,
    architecture_choice,
)
from hetfl.algorithms.parts.architecture_strategy import architecture_strategy
from hetfl.algorithms.parts.method_registry import WeightingOption, register_algorithm
from hetfl.algorithms.parts.option_records import BatchNormKindOptions
from hetfl.core.client.recipe import LocalRecipe
from hetfl.core.init import build_model
from hetfl.core.pricing import PassPricing
from hetfl.core.roles import norm_tensor_names, tensor_roles
from hetfl.core.server.maps import Grouped, GroupRule
from hetfl.core.server.strategy import Strategy
from hetfl.core.spec import Spec
from hetfl.core.training import LocalTraining
from hetfl.core.types import ModelFamily
from hetfl.models.scalable import ARCHITECTURES


class NeFLOptions(BatchNormKindOptions, ArchitectureOptions):
    weighting: WeightingOption = "uniform"


def per_sub_model(family: ModelFamily, choice: ArchitectureChoice) -> GroupRule:
    """NeFL's "inconsistent" parameters, each sub-model's own (`NeFedAvg.py`): a
    candidate's normalisation tensors and step sizes (role `step_size`) go to the group of
    its label; a spec no candidate is keeps them shared (none)."""

    def rule(spec: Spec) -> Mapping[str, str]:
        candidate = choice.candidate_at(spec)
        if candidate is None:
            return {}
        with torch.device("meta"):
            model = build_model(family, spec)
        own = norm_tensor_names(model)
        own |= {n for n, role in tensor_roles(model).items() if role == "step_size"}
        return {n: candidate.label for n in sorted(own)}

    return rule


@register_algorithm("nefl", NeFLOptions, needs="scalable", needs_macs=True)
def _make(
    family: ModelFamily,
    opts: NeFLOptions,
    *,
    clients_per_round: int,
    train: LocalTraining,
    macs: PassPricing,
) -> tuple[Strategy, LocalRecipe]:
    """FedFA's assignment of sub-models, with step sizes and BatchNorm kept per sub-model."""
    choice, query = architecture_choice(
        family,
        opts,
        method="nefl",
        normalisation={"bn": opts.bn, "step_size": True},
        batch_size=train.batch_size,
        macs=macs,
    )
    name = choice.base["family"]
    if not ARCHITECTURES.get(name).step_sizes:
        raise ValueError(
            f"nefl multiplies every residual branch by a learnable step size, which {name}'s "
            "blocks do not take; use model.name preresnet, or fedfa or flexifed on "
            f"{name}"
        )
    return architecture_strategy(
        family,
        opts,
        choice,
        query,
        train=train,
        clients_per_round=clients_per_round,
        transforms=[Grouped(per_sub_model(family, choice))],
        stats_pass=opts.bn == "static",
        first=choice.macs,
    )
