"""Specs and index maps: how a client's local model is a view of the global state.

This module is a leaf: it imports nothing of HetFL, so that model families can return its
types without depending on the rest of the core.

A *spec* describes one local model (width ratios, depth, input size, number of classes,
...). It is an immutable, hashable mapping, so that models, index maps and MAC counts can
be cached per spec.

An *index map* says, for every tensor a client exchanges with the server, which global
tensor and which part of it the local tensor is. Entries may repeat a local name (one local
tensor feeding several global tensors, as FedFA's grafting does); extraction reads each
local name from its *first* entry, aggregation writes through every entry. A contribution
mask narrows what a client uploads below what it downloaded (HeteroFL's label-split head
rows): masked-out elements add neither to the sum nor to the count.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

#: One per-dimension selector: a prefix (or any) slice, or a 1-D tensor of indices.
DimIndex = slice | torch.Tensor
#: A per-dimension index; dimensions beyond its length are taken whole.
Index = tuple[DimIndex, ...]


class Spec(Mapping[str, Any]):
    """An immutable, hashable description of one local model.

    Values must be hashable (numbers, strings, tuples); lists are converted to tuples.
    """

    __slots__ = ("_hash", "_items")

    def __init__(self, values: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        merged = dict(values or {})
        merged.update(kwargs)
        self._items: dict[str, Any] = {k: _freeze(v) for k, v in sorted(merged.items())}
        self._hash = hash(tuple(self._items.items()))

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Spec) and self._items == other._items

    def replace(self, **changes: Any) -> Spec:
        """A copy with some values changed."""
        return Spec(self._items, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self._items.items()}

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self._items.items())
        return f"Spec({inner})"


def _freeze(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    return value


@dataclass(frozen=True)
class MapEntry:
    """One local tensor (or a repeat of it) placed inside one global tensor.

    `index` selects, per dimension, the part of the global tensor the local tensor is
    (`()` = the whole tensor). `mask`, when given, has the local tensor's shape; a zero
    element is not uploaded for this entry (it neither adds to the sum nor to the count).
    """

    local: str
    global_name: str
    index: Index = ()
    mask: torch.Tensor | None = None

    def global_shape_of(self, global_shape: torch.Size) -> tuple[int, ...]:
        """The shape of the selected part of a global tensor of `global_shape`."""
        return selected_shape(global_shape, self.index)


IndexMap = list[MapEntry]


@dataclass(frozen=True)
class SectionBlock:
    """One residual block of a model built in sections (a ResNet's stages), as its family
    reports it (`sections(spec)`), so that methods find blocks by structure, never by name.

    `path` is the block's module path (`stages.1.2`); `tensors` the local names of its
    tensors, in the model's order; `identity` says the block has neither a stride nor a
    projection shortcut, so its input and output have one shape and any identity block of
    its section has tensors of the same shapes (FedFA's grafting may copy one into another).
    """

    path: str
    tensors: tuple[str, ...]
    identity: bool


def selected_shape(shape: Iterable[int], index: Index) -> tuple[int, ...]:
    """Shape of `tensor[index]` for a tensor of `shape`, without building it."""
    dims = list(shape)
    if len(index) > len(dims):
        raise ValueError(f"index has {len(index)} dimensions, tensor has {len(dims)}")
    out = []
    for d, size in enumerate(dims):
        if d >= len(index):
            out.append(size)
            continue
        sel = index[d]
        if isinstance(sel, slice):
            out.append(len(range(*sel.indices(size))))
        else:
            out.append(int(sel.numel()))
    return tuple(out)


def prefix_index(*sizes: int | None) -> Index:
    """Leading-channel slices: `prefix_index(8, 3)` selects `W[:8, :3]`; None keeps a dim whole."""
    return tuple(slice(None) if s is None else slice(0, s) for s in sizes)


def full_map(names: Iterable[str]) -> IndexMap:
    """The identity map: every local tensor is the whole global tensor of the same name."""
    return [MapEntry(n, n) for n in names]


def local_names(index_map: IndexMap) -> list[str]:
    """The distinct local names of a map, in first-appearance order."""
    seen: dict[str, None] = {}
    for e in index_map:
        seen.setdefault(e.local, None)
    return list(seen)


def first_entries(index_map: IndexMap) -> dict[str, MapEntry]:
    """For each local name, the entry extraction reads it from."""
    out: dict[str, MapEntry] = {}
    for e in index_map:
        out.setdefault(e.local, e)
    return out


#: Separates a group from a tensor name in group-qualified global names (`"p=0.5/bn.weight"`).
GROUP_SEP = "/"


def group_qualified(index_map: IndexMap, group: str, locals_: Iterable[str]) -> IndexMap:
    """The map with the entries of `locals_` moved to per-group global tensors
    `"<group>/<global name>"`, averaged only among the clients of that group (FLANC's and
    NeFL's per-group BatchNorm: FLANC's supplementary §1.2 and `trainer_FL.py: sync`,
    NeFL's `utils/NeFedAvg.py`). Other entries are unchanged."""
    if GROUP_SEP in group:
        raise ValueError(f"group name {group!r} must not contain {GROUP_SEP!r}")
    chosen = set(locals_)
    return [
        MapEntry(e.local, f"{group}{GROUP_SEP}{e.global_name}", e.index, e.mask)
        if e.local in chosen
        else e
        for e in index_map
    ]


def capacity_group(p: float) -> str:
    """The group of capacity p's own tensors: `cap0.25`, `cap1` (FLANC's per-capacity
    tensors, and the `per-capacity` normalisation of the scalable families)."""
    return f"cap{p:g}"


def ungrouped(global_name: str) -> str:
    """The global model's tensor behind a (possibly group-qualified) global name."""
    return global_name.rsplit(GROUP_SEP, 1)[-1]
