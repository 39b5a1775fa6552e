"""FlexiFed: Wang et al., "FlexiFed: Personalized Federated Learning for Edge Clients with
Heterogeneous Model Architectures" (WWW 2023), its Max-Common scheme, as FedFA compares
against it (Park and Joe-Wong, "Federated Learning with Flexible Architectures",
ECML-PKDD 2024, §2.1 and §5: the depth-only scenario).

Reproduced: clients train architectures of one family that differ in depth only
(`hetfl.algorithms.architectures`); layer by layer from the input, each layer is averaged
over the largest set of clients whose architectures share the identical prefix up to and
including it, so the layers after a client's point of divergence are shared only with
the clients that follow the same path; uniform weights, no scale compensation, BatchNorm
running statistics averaged with their layer. Each path keeps its layers under
group-qualified names (`<a>+<b>/<name>`: the candidates that share the prefix), and a
layer every candidate shares keeps its plain name. `global_acc` is the deepest
architecture's model (most blocks; the first listed among equals); every architecture is
evaluated (`arch=<name>`), and each client on its own (`local_acc`).

Choices where the paper is silent (it trains VGG-11/13/16/19):
- a Pre-ResNet's layers are its pipeline modules in order (stem, each residual block,
  section by section, the head), so two architectures share a block while their depths
  agree in every earlier section and both reach it; tensors outside those modules (the
  final norm, between the last block and the head) go with the head;
- architectures that differ in width are refused: Max-Common compares layers, which a
  width changes (NeFL and HeteroFL handle widths).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hetfl.algorithms.architectures import (
    ArchitectureAssignment,
    ArchitectureModels,
    Candidate,
    Candidates,
    LimitedShare,
    candidate_specs,
)
from hetfl.algorithms.base import AggregationOptions, WeightingOption, register_algorithm
from hetfl.core.evaluation import OwnModel
from hetfl.core.init import build_model
from hetfl.core.local.parts import LocalRecipe
from hetfl.core.maps import Grouped
from hetfl.core.server_update import Averaged
from hetfl.core.spec import Spec
from hetfl.core.strategy import Strategy
from hetfl.core.training import LocalTraining
from hetfl.core.types import ModelFamily
from hetfl.core.weighting import weighting

DEFAULT_CANDIDATES = (
    Candidate(name="d1", blocks=(1, 1, 1, 1)),
    Candidate(name="d2", blocks=(1, 1, 2, 2)),
    Candidate(name="d3", blocks=(2, 2, 2, 2)),
)


class FlexiFedOptions(AggregationOptions):
    weighting: WeightingOption = "uniform"
    architectures: Candidates = DEFAULT_CANDIDATES
    limited: LimitedShare = 0.5


def refuse_mixed_widths(specs: Mapping[str, Spec]) -> None:
    """Max-Common is depth-only: every candidate must have the same widths."""
    first, *rest = specs
    for name in rest:
        if specs[name]["widths"] != specs[first]["widths"]:
            raise ValueError(
                f"flexifed aggregates architectures that differ in depth only (Max-Common), "
                f"but candidate {name!r} has widths {list(specs[name]['widths'])} and "
                f"{first!r} {list(specs[first]['widths'])}; give every candidate the same "
                "width, or use nefl or heterofl for clients of different widths"
            )


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


@register_algorithm("flexifed", FlexiFedOptions, needs="scalable")
def _make(
    family: ModelFamily, opts: FlexiFedOptions, *, clients_per_round: int, train: LocalTraining
) -> tuple[Strategy, LocalRecipe]:
    """Declared depth-only architectures, Max-Common groups, uniform averaging."""
    specs = candidate_specs(family, opts.architectures, "flexifed")
    refuse_mixed_widths(specs)
    assignment = ArchitectureAssignment(family, specs, limited=opts.limited)
    groups = max_common(family, specs)
    deepest = ArchitectureModels(assignment, first=lambda spec: sum(spec["blocks"]))
    strategy = Strategy(
        family,
        train=train,
        sampler=opts.sampler(clients_per_round),
        assignment=assignment,
        transforms=[Grouped(lambda spec: groups.get(assignment.arch_of(spec) or "", {}))],
        weighting=weighting(opts.weighting),
        server_update=Averaged(),
        global_eval=deepest,
        local_eval=OwnModel(group=lambda info: f"local arch={assignment.name(info)}"),
        trace_fields=assignment.trace_fields,
        reducer=opts.reducer.build(),
    )
    return strategy, LocalRecipe()
