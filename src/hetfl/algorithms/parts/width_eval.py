"""Evaluation parts of the width-sliced methods (`hetfl.core.server.evaluation`): every level's
model on the global test set (`LevelModels`, `level_models`), and a client judged by the
full-rate model (`FullRateMasked`, HeteroFL's local accuracy) or by its own level
(`own_level`, a pick of `hetfl.core.server.evaluation.LocalModel`); HeteroFL's choice among
them (`sliced_evaluation`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Literal

import torch
from pydantic import Field

from hetfl.algorithms.parts.width_assignment import WidthAssignment
from hetfl.algorithms.parts.width_norms import LevelNorm
from hetfl.algorithms.parts.widths import LevelSpec
from hetfl.core.init import build_model
from hetfl.core.server.evaluation import (
    GlobalEval,
    Judged,
    Layout,
    LocalEval,
    LocalModel,
    ModelPick,
    WholeModel,
)
from hetfl.core.spec import IndexMap, Spec
from hetfl.core.state import State, extract
from hetfl.core.types import ClientInfo, EvalModel, EvalTask, ModelFamily

#: How HeteroFL measures a client's local accuracy (`FullRateMasked` or `own_level`).
LocalEvalModel = Annotated[
    Literal["global-masked", "own-level"],
    Field(
        description="local_acc's model: global-masked, the full-rate model with the global "
        "statistics and the client's label mask (the authors' code); own-level, the client's "
        "own level after a statistics pass over its training data"
    ),
]


def eval_model_at(
    family: ModelFamily,
    eval_spec: Spec,
    imap: IndexMap,
    state: State,
    *,
    name: str,
    stats_pass: bool,
    mean_group: str | None = None,
) -> EvalModel:
    """An evaluation model built for `eval_spec` from the global tensors `imap` selects;
    tensors the map does not cover (running statistics of a static-BN model)
    start at their defaults and are re-estimated by the stats pass."""
    tensors = dict(build_model(family, eval_spec).state_dict())
    tensors.update(extract(state, imap))
    return EvalModel(
        name=name,
        spec=eval_spec,
        tensors=tensors,
        stats_pass=stats_pass,
        group=name,
        mean_group=mean_group,
    )


def level_name(ratio: float) -> str:
    """The name (and group) of a level's evaluated model: `width=r`."""
    return f"width={ratio:g}"


class LevelModels:
    """Every level's model on the global test set, widest first (named and grouped by
    `name(r)`, `width=r` by default; the widest is `global_acc`): the global tensors of the
    level's training spec, loaded into its evaluation spec, after a statistics pass when
    `stats_pass` (static BatchNorm). `levels` may be a function, for levels known only
    after set-up (declared capacities); with `mean_group`, their mean accuracy is reported
    under it too."""

    def __init__(
        self,
        levels: Sequence[float] | Callable[[], Sequence[float]],
        level_spec: LevelSpec,
        eval_spec: LevelSpec,
        *,
        stats_pass: bool,
        name: Callable[[float], str] = level_name,
        mean_group: str | None = None,
    ) -> None:
        self.levels = levels
        self.level_spec, self.eval_spec = level_spec, eval_spec
        self.stats_pass, self.name, self.mean_group = stats_pass, name, mean_group

    def eval_models(self, layout: Layout, state: Mapping[str, torch.Tensor]) -> list[EvalModel]:
        levels = self.levels() if callable(self.levels) else self.levels
        return [
            eval_model_at(
                layout.family,
                self.eval_spec(r),
                layout.shared_map(self.level_spec(r)),
                dict(state),
                name=self.name(r),
                stats_pass=self.stats_pass,
                mean_group=self.mean_group,
            )
            for r in sorted(levels, reverse=True)
        ]


class FullRateMasked:
    """A client judged by the full-rate model exactly as the global evaluation tested it
    (its BatchNorm statistics from the server-side pass), its logits masked to the client's
    classes when `label_mask` (HeteroFL's code: `train_classifier_fed.py`, `stats` then
    `test` with each client's label split): the client runs no statistics pass."""

    def __init__(
        self, widest: float, level_spec: LevelSpec, eval_spec: LevelSpec, *, label_mask: bool
    ) -> None:
        self.widest, self.level_spec, self.eval_spec = widest, level_spec, eval_spec
        self.label_mask = label_mask

    def eval_task(
        self,
        layout: Layout,
        info: ClientInfo,
        state: Mapping[str, torch.Tensor],
        evaluated: Mapping[str, State],
    ) -> EvalTask:
        name = level_name(self.widest)
        if name not in evaluated:
            raise RuntimeError(
                f"HeteroFL's local_eval_model 'global-masked' judges clients with the evaluated "
                f"full-rate model {name!r}, which this round's evaluation did not give "
                f"(it gave {sorted(evaluated)}); the engine passes eval_task the models it tested"
            )
        return EvalTask(
            cid=info.cid,
            spec=self.eval_spec(self.widest),
            payload=dict(evaluated[name]),
            index_map=layout.shared_map(self.level_spec(self.widest)),
            label_mask=info.labels if self.label_mask else None,
        )


def own_level(
    level_of: Callable[[ClientInfo], float],
    level_spec: LevelSpec,
    eval_spec: LevelSpec,
    group: Callable[[float], str] = lambda r: f"local width={r:g}",
) -> ModelPick:
    """A client judged by its own level (`level_of(info)`): the global tensors of the level's
    training spec in its evaluation spec, reported under `group(r)` (`local width=r` by
    default); a `LocalModel` adds the statistics pass (static BatchNorm) and the label mask."""

    def pick(layout: Layout, info: ClientInfo) -> Judged:
        ratio = level_of(info)
        return Judged(level_spec(ratio), eval_spec(ratio), group(ratio))

    return pick


def level_models(assignment: WidthAssignment, norm: LevelNorm) -> LevelModels:
    """Every level of `assignment` tested as `norm` says; under per-capacity norms only the
    levels some client trains (another level has no normalisation tensors)."""
    levels = assignment.trained_levels if norm.per_capacity else assignment.levels
    return LevelModels(levels, assignment.level_spec, norm.evaluate, stats_pass=norm.stats_pass)


def sliced_evaluation(
    assignment: WidthAssignment,
    norm: LevelNorm,
    *,
    private: bool,
    label_mask: bool,
    local: LocalEvalModel,
) -> tuple[GlobalEval, LocalEval]:
    """HeteroFL's evaluation: every level (`level_models`), unless private layers leave no
    complete global model; local accuracy as `local` says: the full-rate model as the global
    evaluation tested it, with the client's label mask (`global-masked`), or the client's
    own level, the widest under a dynamic assignment (`own-level`, the one that runs with
    private layers), after a statistics pass over its training data where `norm` has one."""
    widest, level_spec = max(assignment.levels), assignment.level_spec
    level_of = (lambda info: widest) if assignment.dynamic else assignment.level
    own = LocalModel(
        own_level(level_of, level_spec, norm.evaluate),
        stats_pass=norm.stats_pass,
        label_mask=label_mask,
    )
    if private:
        return WholeModel(), own
    if local == "own-level":
        return level_models(assignment, norm), own
    masked = FullRateMasked(widest, level_spec, norm.evaluate, label_mask=label_mask)
    return level_models(assignment, norm), masked
