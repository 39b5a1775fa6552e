"""Evaluation parts of a `Strategy` (`hetfl.core.server.strategy`): which models are tested on the
global test set (`GlobalEval`), and how each client is judged on its local split
(`LocalEval`).

Both read the run's set-up through a `Layout` (the family, the global spec, each client's
spec and the shared index map of a spec) and the global state the engine passes in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
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


class OwnModel:
    """The client's own spec with the global tensors and its private layers; reported
    under `group(info)` when a grouping is given (ScalableFL's client groups)."""

    def __init__(self, group: Callable[[ClientInfo], str] | None = None) -> None:
        self.group = group

    def eval_task(
        self,
        layout: Layout,
        info: ClientInfo,
        state: Mapping[str, torch.Tensor],
        evaluated: Mapping[str, State],
    ) -> EvalTask:
        spec = layout.spec_of(info)
        imap = layout.shared_map(spec)
        task = EvalTask(cid=info.cid, spec=spec, payload=extract(state, imap), index_map=imap)
        return task if self.group is None else replace(task, group=self.group(info))


class GlobalOnClient:
    """The global model (the global spec with the shared tensors) on the client's local
    split: split learning, where a client's model is its side joined to a server side, so
    its own spec alone classifies nothing (SplitFed, DTFL)."""

    def eval_task(
        self,
        layout: Layout,
        info: ClientInfo,
        state: Mapping[str, torch.Tensor],
        evaluated: Mapping[str, State],
    ) -> EvalTask:
        spec = layout.global_spec
        imap = layout.shared_map(spec)
        return EvalTask(cid=info.cid, spec=spec, payload=extract(state, imap), index_map=imap)


class NoGlobalModel:
    """Nothing on the global test set: a method whose server model alone classifies no
    input (FedGKT's server model takes a client's feature maps)."""

    def eval_models(self, layout: Layout, state: Mapping[str, torch.Tensor]) -> list[EvalModel]:
        return []


@dataclass(frozen=True)
class JoinedWithPrivate:
    """The model of `spec` with the global tensors its shared map names and the client's
    private tensors for the rest: FedGKT's client extractor (md1, private) joined to the
    server model (md2..md8, global), judged on the client's own split (the strategy's
    `pooled_eval`)."""

    spec: Spec
    #: Re-estimate the joined model's BatchNorm statistics on the client's own training data
    #: first (for that evaluation only), instead of using the running statistics it holds.
    stats_pass: bool = False

    def eval_task(
        self,
        layout: Layout,
        info: ClientInfo,
        state: Mapping[str, torch.Tensor],
        evaluated: Mapping[str, State],
    ) -> EvalTask:
        imap = [e for e in layout.shared_map(self.spec) if e.global_name in state]
        return EvalTask(
            cid=info.cid,
            spec=self.spec,
            payload=extract(state, imap),
            index_map=imap,
            stats_pass=self.stats_pass,
        )
