"""Map transforms: the chained steps that turn a spec's index map (`ModelFamily.index_map`)
into the map a client's task is planned with — a part of a `Strategy`
(`hetfl.core.server.strategy`).

Each transform says how it acts with and without a client. `shared` runs where no client
is given (initialising the global state, naming the parameters, building evaluation
models): private layers leave the map there too, a client's label mask does not apply.
`for_client` runs when a sampled client's task is planned (and its result aggregated
through the same map); it may read the client's `ClientInfo` and the global state's shapes.
Transforms are applied in the order given, each to the previous one's output.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch

from hetfl.core.init import build_model
from hetfl.core.roles import head_tensor_names, norm_tensor_names
from hetfl.core.spec import IndexMap, MapEntry, Spec, group_qualified
from hetfl.core.types import ClientInfo, ModelFamily


class MapTransform(Protocol):
    def shared(self, imap: IndexMap, spec: Spec) -> IndexMap:
        """The map where no client is given (initialisation, parameters, evaluation)."""
        ...

    def for_client(
        self,
        imap: IndexMap,
        spec: Spec,
        client: ClientInfo,
        state: Mapping[str, torch.Tensor],
    ) -> IndexMap:
        """A sampled client's map; `state` is the global state the task is cut from."""
        ...


class PrivateLayers:
    """Leaves a client's normalisation tensors (FedBN: Li et al., "FedBN: Federated Learning
    on Non-IID Features via Local Batch Normalization", ICLR 2021, §3) and/or its classifier
    head (FedPer: Arivazhagan et al., "Federated Learning with Personalization Layers",
    2019, §3) out of the map, so they stay on the client. Found from the model's structure
    (`hetfl.core.roles`), with or without a client."""

    def __init__(self, family: ModelFamily, *, norm: bool, head: bool) -> None:
        self.family, self.norm, self.head = family, norm, head
        self._private: dict[Spec, set[str]] = {}

    def private(self, spec: Spec) -> set[str]:
        """The local names kept on the client for a model of `spec`."""
        found = self._private.get(spec)
        if found is None:
            with torch.device("meta"):
                model = build_model(self.family, spec)
            found = set()
            if self.norm:
                norms = norm_tensor_names(model)
                if not norms:
                    raise ValueError(
                        f"private_norm (FedBN) needs normalisation layers; the model for "
                        f"{spec} has none"
                    )
                found |= norms
            if self.head:
                found |= head_tensor_names(model)
            self._private[spec] = found
        return found

    def shared(self, imap: IndexMap, spec: Spec) -> IndexMap:
        private = self.private(spec)
        return [e for e in imap if e.local not in private]

    def for_client(
        self,
        imap: IndexMap,
        spec: Spec,
        client: ClientInfo,
        state: Mapping[str, torch.Tensor],
    ) -> IndexMap:
        return self.shared(imap, spec)


def private_layers(family: ModelFamily, *, norm: bool, head: bool) -> list[MapTransform]:
    """The `PrivateLayers` transform when either option is on, else none."""
    return [PrivateLayers(family, norm=norm, head=head)] if norm or head else []


class NothingShared:
    """An empty map: the whole local model stays on its client (local-only training)."""

    def shared(self, imap: IndexMap, spec: Spec) -> IndexMap:
        return []

    def for_client(
        self,
        imap: IndexMap,
        spec: Spec,
        client: ClientInfo,
        state: Mapping[str, torch.Tensor],
    ) -> IndexMap:
        return []


def label_split(
    family: ModelFamily,
    spec: Spec,
    imap: IndexMap,
    state: Mapping[str, torch.Tensor],
    labels: Sequence[int],
) -> IndexMap:
    """The map with the head's entries masked to the rows of `labels`: label-split
    aggregation (Diao, Ding and Tarokh, "HeteroFL: Computation and Communication Efficient
    Federated Learning for Heterogeneous Clients", ICLR 2021, §3: a client contributes only
    its own classes' output rows)."""
    with torch.device("meta"):
        head = head_tensor_names(build_model(family, spec))
    out: IndexMap = []
    for e in imap:
        if e.local in head:
            shape = e.global_shape_of(state[e.global_name].shape)
            mask = torch.zeros(shape, dtype=torch.bool)
            rows = [c for c in labels if c < shape[0]]
            mask[rows] = True
            e = MapEntry(e.local, e.global_name, e.index, mask)
        out.append(e)
    return out


class LabelSplit:
    """A sampled client's head entries masked to its own classes (`label_split`); without
    a client (initialisation, evaluation) the map is unchanged."""

    def __init__(self, family: ModelFamily) -> None:
        self.family = family

    def shared(self, imap: IndexMap, spec: Spec) -> IndexMap:
        return imap

    def for_client(
        self, imap: IndexMap, spec: Spec, client: ClientInfo, state: Mapping[str, torch.Tensor]
    ) -> IndexMap:
        return label_split(self.family, spec, imap, state, client.labels)


#: Which local tensors of a spec's model go to a group's own global copies: local name ->
#: group (`hetfl.core.spec.group_qualified`); names not listed stay shared.
GroupRule = Callable[[Spec], Mapping[str, str]]


class Grouped:
    """A spec's tensors moved to per-group global copies by a rule on the spec, with or
    without a client, so they are averaged only among the clients of their group and an
    evaluation model of the spec reads them back: NeFL's per-sub-model normalisation and
    step sizes, FlexiFed's per-path blocks. The rule is asked once per spec."""

    def __init__(self, rule: GroupRule) -> None:
        self.rule = rule
        self._groups: dict[Spec, dict[str, list[str]]] = {}

    def shared(self, imap: IndexMap, spec: Spec) -> IndexMap:
        groups = self._groups.get(spec)
        if groups is None:
            groups = {}
            for local, group in self.rule(spec).items():
                groups.setdefault(group, []).append(local)
            self._groups[spec] = groups
        for group, locals_ in groups.items():
            imap = group_qualified(imap, group, locals_)
        return imap

    def for_client(
        self, imap: IndexMap, spec: Spec, client: ClientInfo, state: Mapping[str, torch.Tensor]
    ) -> IndexMap:
        return self.shared(imap, spec)
