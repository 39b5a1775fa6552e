"""FlexiFed: Wang et al., "FlexiFed: Personalized Federated Learning for Edge Clients with
Heterogeneous Model Architectures" (WWW 2023), its Max-Common scheme, as FedFA compares
against it (Park and Joe-Wong, "Federated Learning with Flexible Architectures",
ECML-PKDD 2024, §2.1 and §5: the depth-only scenario).

Reproduced: clients train Pre-ResNet architectures that differ in depth only; layer by
layer from the input, each layer is averaged over the largest set of clients whose
architectures share the identical prefix up to and including it, so the layers after a
client's point of divergence are shared only with the clients that follow the same path;
uniform weights, no scale compensation, BatchNorm running statistics averaged with their
layer. Each path keeps its layers under group-qualified names (`<a>+<b>/<name>`: the
candidates that share the prefix), and a layer every candidate shares keeps its plain name.
`global_acc` is the deepest architecture's model; every architecture is evaluated
(`arch=<label>`), and each client on its own (`local arch=<label>`).

Which client trains which depth: FedFA's assignment (`architecture_choice`, the same
options), so that with the same seed, candidates and clients FlexiFed and FedFA put the same
clients on the same architectures and the comparison is like for like.

Choices where the paper is silent (it trains VGG-11/13/16/19):
- a Pre-ResNet's layers are its pipeline modules in order (stem, each residual block,
  section by section, the head), so two architectures share a block while their depths
  agree in every earlier section and both reach it; tensors outside those modules (the
  final norm, between the last block and the head) go with the head;
- groups are named by the candidates, whether or not a client chose them: a candidate no
  client chose adds nothing to a group's average;
- in non-IID runs the logits of a client's absent classes are zeroed in training and each
  head row is averaged over the clients holding its class (`label_split`, on by default),
  as FedFA does: FedFA's paper applies it to every method it compares (§5.1);
  `label_split: false` trains without it;
- architectures that differ in width are refused: Max-Common compares layers, which a
  width changes (NeFL and FedFA handle widths).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from pydantic import Field, model_validator

from hetfl.algorithms.parts.architecture_choice import ArchitectureOptions, architecture_choice
from hetfl.algorithms.parts.architecture_strategy import architecture_strategy
from hetfl.algorithms.parts.method_registry import WeightingOption, register_algorithm
from hetfl.algorithms.parts.option_records import BatchNormKindOptions
from hetfl.core.client.recipe import LocalRecipe
from hetfl.core.init import build_model
from hetfl.core.pricing import PassPricing
from hetfl.core.server.maps import Grouped
from hetfl.core.server.strategy import Strategy
from hetfl.core.spec import Spec
from hetfl.core.training import LocalTraining
from hetfl.core.types import ModelFamily


class FlexiFedOptions(BatchNormKindOptions, ArchitectureOptions):
    weighting: WeightingOption = "uniform"
    widths: list[float] = Field(
        [1.0],
        description="the width multiplier of every candidate, in (0, 1]: one value (Max-Common "
        "is depth-only)",
    )

    @model_validator(mode="after")
    def _depth_only(self) -> FlexiFedOptions:
        if len(set(self.widths)) > 1:
            raise ValueError(
                f"flexifed aggregates architectures that differ in depth only (Max-Common), "
                f"but widths lists {self.widths}; give one width (e.g. widths: [1.0]), or use "
                "nefl or fedfa for clients of different widths"
            )
        return self


def max_common(family: ModelFamily, specs: Mapping[str, Spec]) -> dict[str, dict[str, str]]:
    """For each candidate, the group of each of its tensors that not every candidate
    shares: the candidates whose pipelines agree with its own up to the tensor's module,
    joined by '+' in the order listed (module docstring)."""
    pipes = {n: family.modules(s) for n, s in specs.items()}
    out: dict[str, dict[str, str]] = {}
    for name, spec in specs.items():
        pipe = pipes[name]
        group_at = []
        for i in range(len(pipe)):
            sharing = [n for n in specs if pipes[n][: i + 1] == pipe[: i + 1]]
            group_at.append(None if len(sharing) == len(specs) else "+".join(sharing))
        with torch.device("meta"):
            tensors = list(build_model(family, spec).state_dict())
        out[name] = {}
        for t in tensors:
            at = [i for i, m in enumerate(pipe) if t.startswith(f"{m}.")]
            group = group_at[at[0] if at else len(pipe) - 1]
            if group is not None:
                out[name][t] = group
    return out


@register_algorithm("flexifed", FlexiFedOptions, needs="scalable", needs_macs=True)
def _make(
    family: ModelFamily,
    opts: FlexiFedOptions,
    *,
    clients_per_round: int,
    train: LocalTraining,
    macs: PassPricing,
) -> tuple[Strategy, LocalRecipe]:
    """FedFA's assignment of depths, Max-Common groups, uniform averaging."""
    choice, query = architecture_choice(
        family,
        opts,
        method="flexifed",
        normalisation={"bn": opts.bn},
        batch_size=train.batch_size,
        macs=macs,
    )
    groups = max_common(family, {c.label: choice.spec(c) for c in choice.candidates})

    def path_of(spec: Spec) -> Mapping[str, str]:
        candidate = choice.candidate_at(spec)
        return {} if candidate is None else groups[candidate.label]

    return architecture_strategy(
        family,
        opts,
        choice,
        query,
        train=train,
        clients_per_round=clients_per_round,
        transforms=[Grouped(path_of)],
        stats_pass=opts.bn == "static",
        first=lambda c: c.depth,
    )
