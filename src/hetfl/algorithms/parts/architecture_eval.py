"""Evaluation parts of the methods whose clients train architectures
(`hetfl.core.server.evaluation`, `architecture_choice`): each architecture some client chose, on
the global test set, grouped `arch=<label>`, and a client judged by its own architecture,
grouped `local arch=<label>` (`own_architecture`, a pick of
`hetfl.core.server.evaluation.LocalModel`). Each model reads the global tensors through its
spec's shared map, so tensors a method keeps per group (`hetfl.core.server.maps.Grouped`:
NeFL's per-sub-model BatchNorm, FlexiFed's per-path layers) load as the architecture's own.

FedFA (Park and Joe-Wong, "Federated Learning with Flexible Architectures", ECML-PKDD
2024, §5.1) tests the global model, the largest width and depth, as `global_acc`, after a
statistics pass (static BatchNorm, as HeteroFL's), a client after a pass over its own
training data, with its label mask. Its baselines test one chosen architecture as
`global_acc` (`first`: FlexiFed's deepest, NeFL's largest) with the BatchNorm statistics
they averaged, no pass.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from hetfl.algorithms.parts.architecture_choice import ArchitectureChoice, Candidate
from hetfl.algorithms.parts.width_eval import eval_model_at
from hetfl.core.server.evaluation import Judged, Layout, ModelPick
from hetfl.core.spec import Spec
from hetfl.core.types import ClientInfo, EvalModel


def evaluated_spec(spec: Spec) -> Spec:
    """A statically normalised spec as it is evaluated: with running statistics, which the
    statistics pass estimates."""
    return spec.replace(bn="batch")


class ArchitectureModels:
    """Without `first`: `global` (the global spec: `global_acc`), then `arch=<label>` for
    every architecture chosen, smallest first. With `first`: the chosen architecture that
    `first` ranks highest (`global_acc`; the smaller first on a tie), then the others,
    smallest first. Each is a group of the `groups` metric; with `stats_pass`, each is
    tested after a statistics pass at running statistics (`evaluated_spec`)."""

    def __init__(
        self,
        choice: ArchitectureChoice,
        *,
        first: Callable[[Candidate], float] | None = None,
        stats_pass: bool = True,
    ) -> None:
        self.choice, self.first, self.stats_pass = choice, first, stats_pass

    def eval_models(self, layout: Layout, state: Mapping[str, torch.Tensor]) -> list[EvalModel]:
        used = self.choice.used()
        if self.first is None:
            named = [("global", layout.global_spec)]
        else:
            top = max(used, key=self.first)
            used = [top, *(c for c in used if c != top)]
            named = []
        named += [(f"arch={c.label}", self.choice.spec(c)) for c in used]
        return [
            eval_model_at(
                layout.family,
                evaluated_spec(spec) if self.stats_pass else spec,
                layout.shared_map(spec),
                dict(state),
                name=name,
                stats_pass=self.stats_pass,
            )
            for name, spec in named
        ]


def own_architecture(choice: ArchitectureChoice, *, stats_pass: bool) -> ModelPick:
    """A client judged by its own architecture, grouped `local arch=<label>`; at running
    statistics (`evaluated_spec`) when `stats_pass`, which a `LocalModel` then runs over the
    client's training data."""

    def pick(layout: Layout, info: ClientInfo) -> Judged:
        candidate = choice.candidate_of(info)
        spec = choice.spec(candidate)
        evaluated = evaluated_spec(spec) if stats_pass else spec
        return Judged(spec, evaluated, f"local arch={candidate.label}")

    return pick
