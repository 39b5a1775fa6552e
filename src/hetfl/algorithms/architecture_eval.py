"""Evaluation parts of FedFA (`hetfl.core.evaluation`): the global model (the largest width
and depth) and each architecture some client chose, on the global test set, after a
statistics pass (static BatchNorm, as HeteroFL's); a client judged by its own architecture
after a statistics pass over its own training data, with its label mask.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hetfl.algorithms.architecture_choice import ArchitectureChoice
from hetfl.algorithms.width_eval import eval_model_at
from hetfl.core.evaluation import Layout
from hetfl.core.spec import Spec
from hetfl.core.state import State, extract
from hetfl.core.types import ClientInfo, EvalModel, EvalTask


def evaluated_spec(spec: Spec) -> Spec:
    """A statically normalised spec as it is evaluated: with running statistics, which the
    statistics pass estimates."""
    return spec.replace(bn="batch")


class ArchitectureModels:
    """`global` (the global spec: `global_acc`), then `arch=<label>` for every architecture
    chosen, smallest first, each a group of the `groups` metric."""

    def __init__(self, choice: ArchitectureChoice) -> None:
        self.choice = choice

    def eval_models(self, layout: Layout, state: Mapping[str, torch.Tensor]) -> list[EvalModel]:
        named = [("global", layout.global_spec)]
        named += [(f"arch={c.label}", self.choice.spec(c)) for c in self.choice.used()]
        return [
            eval_model_at(
                layout.family,
                evaluated_spec(spec),
                layout.shared_map(spec),
                dict(state),
                name=name,
                stats_pass=True,
            )
            for name, spec in named
        ]


class OwnArchitecture:
    """A client's own architecture after a statistics pass over its training data, its
    logits masked to its classes when `label_mask`; grouped `local arch=<label>`."""

    def __init__(self, choice: ArchitectureChoice, *, label_mask: bool) -> None:
        self.choice, self.label_mask = choice, label_mask

    def eval_task(
        self,
        layout: Layout,
        info: ClientInfo,
        state: Mapping[str, torch.Tensor],
        evaluated: Mapping[str, State],
    ) -> EvalTask:
        candidate = self.choice.candidate_of(info)
        spec = self.choice.spec(candidate)
        imap = layout.shared_map(spec)
        return EvalTask(
            cid=info.cid,
            spec=evaluated_spec(spec),
            payload=extract(state, imap),
            index_map=imap,
            group=f"local arch={candidate.label}",
            stats_pass=True,
            label_mask=info.labels if self.label_mask else None,
        )
