"""Evaluation parts of a `Strategy` (`hetfl.core.server.strategy`): which models are tested on the
global test set (`GlobalEval`), and how each client is judged on its local split
(`LocalEval`: `LocalModel`, one part for every method, which decides only the model, a
`ModelPick`; HeteroFL's `FullRateMasked` judges with the model the global evaluation tested).

Both read the run's set-up through a `Layout` (the family, the global spec, each client's
spec and the shared index map of a spec) and the global state the engine passes in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from hetfl.core.init import build_model
from hetfl.core.spec import IndexMap, Spec, local_names
from hetfl.core.state import State, extract
from hetfl.core.types import ClientInfo, EvalModel, EvalTask, ModelFamily


@dataclass(frozen=True)
class Layout:
    """What set-up decided, for evaluation parts: `spec_of(info)` is a client's own spec,
    `shared_map(spec)` the index map of a spec without a client (private layers removed)."""

    family: ModelFamily
    global_spec: Spec
    spec_of: Callable[[ClientInfo], Spec]
    shared_map: Callable[[Spec], IndexMap]


class GlobalEval(Protocol):
    def eval_models(self, layout: Layout, state: Mapping[str, torch.Tensor]) -> list[EvalModel]:
        """The models to test on the global test set; the first one is `global_acc`'s."""
        ...


class LocalEval(Protocol):
    def eval_task(
        self,
        layout: Layout,
        info: ClientInfo,
        state: Mapping[str, torch.Tensor],
        evaluated: Mapping[str, State],
    ) -> EvalTask:
        """How client `info` is judged on its local split. `evaluated` holds this round's
        global models as the engine tested them (after any statistics pass), by name."""
        ...


class WholeModel:
    """The global model, when the shared state is a complete model; else nothing (private
    layers: the method is judged by its clients' local accuracy)."""

    def eval_models(self, layout: Layout, state: Mapping[str, torch.Tensor]) -> list[EvalModel]:
        spec = layout.global_spec
        imap = layout.shared_map(spec)
        names = set(build_model(layout.family, spec).state_dict())
        if set(local_names(imap)) != names:
            return []
        return [EvalModel(name="global", spec=spec, tensors=extract(state, imap))]


class NoGlobalModel:
    """Nothing on the global test set: a method whose server model alone classifies no
    input (FedGKT's server model takes a client's feature maps)."""

    def eval_models(self, layout: Layout, state: Mapping[str, torch.Tensor]) -> list[EvalModel]:
        return []


@dataclass(frozen=True)
class Judged:
    """The model a client is judged by: the global tensors that the shared map of `trained`
    (the spec trained, or that would be) names, loaded into `spec` (`trained` itself by
    default; another normalisation of it, with running statistics a statistics pass
    estimates), reported under `group` when given."""

    trained: Spec
    spec: Spec | None = None
    group: str | None = None


#: Which model judges client `info`: `pick(layout, info)`.
ModelPick = Callable[[Layout, ClientInfo], Judged]


@dataclass(frozen=True)
class LocalModel:
    """How a client is judged on its local split, for every method: the model `pick` names
    (`Judged`), with the global tensors and the client's private tensors for the rest;
    with `stats_pass`, after the client re-estimates its BatchNorm statistics on its own
    training data (for that evaluation only); its logits masked to its classes with
    `label_mask`. With `present_only`, only the global tensors the state holds are loaded
    (FedGKT's joined model: the client's extractor is its own, md2..md8 the server's)."""

    pick: ModelPick
    stats_pass: bool = False
    label_mask: bool = False
    present_only: bool = False

    def eval_task(
        self,
        layout: Layout,
        info: ClientInfo,
        state: Mapping[str, torch.Tensor],
        evaluated: Mapping[str, State],
    ) -> EvalTask:
        judged = self.pick(layout, info)
        imap = layout.shared_map(judged.trained)
        if self.present_only:
            imap = [e for e in imap if e.global_name in state]
        return EvalTask(
            cid=info.cid,
            spec=judged.trained if judged.spec is None else judged.spec,
            payload=extract(state, imap),
            index_map=imap,
            group=judged.group,
            stats_pass=self.stats_pass,
            label_mask=info.labels if self.label_mask else None,
        )


def own_spec(group: Callable[[ClientInfo], str] | None = None) -> ModelPick:
    """The client's own spec (with its private layers: the default local evaluation);
    reported under `group(info)` when a grouping is given (ScalableFL's client groups)."""

    def pick(layout: Layout, info: ClientInfo) -> Judged:
        return Judged(layout.spec_of(info), group=None if group is None else group(info))

    return pick


def global_model(layout: Layout, info: ClientInfo) -> Judged:
    """The global model on the client's local split: split learning, where a client's model
    is its side joined to a server side, so its own spec alone classifies nothing (SplitFed,
    DTFL)."""
    return Judged(layout.global_spec)


def fixed_spec(spec: Spec) -> ModelPick:
    """`spec` for every client: FedGKT's client extractor (md1, private) joined to the
    server model (md2..md8, global), judged on the client's own split (the strategy's
    `pooled_eval`, with `present_only`)."""
    return lambda layout, info: Judged(spec)
