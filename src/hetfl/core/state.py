"""Named-tensor state, extraction through an index map, placement back into global
coordinates, and the element-wise accumulator.

The server's model is a `State` (`dict[str, Tensor]`). A client's model is a view of it
described by an index map (`hetfl.core.spec`). `extract` reads the view, `place` writes one
client's tensors back into global coordinates; the `Accumulator`
writes client tensors back through the same maps as a per-element weighted average, which
is the shared mechanism of FedAvg, HeteroFL, FjORD, ScalableFL, NeFL and FedFA: they differ
only in their maps, weights and scales. `Reducer` is the interface aggregation reduces
through; `hetfl.core.server.robust` has the coordinate-wise median and trimmed mean behind it.

Sums and counts are kept in float64 and cast once at the end, so that aggregating unchanged
sub-models gives back the global state bit for bit, and the order in which clients are added
changes nothing beyond float64 rounding. Within one client's entry, elements that land on the
same global element are summed in one fixed order on every device (`scatter_add`), so that
two CUDA runs of the same aggregation agree bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Literal, NamedTuple, Protocol

import torch

from hetfl.core.spec import Index, IndexMap, MapEntry, first_entries, selected_shape

#: Named tensors: the global state, a payload, a client's model (defined here, once).
State = dict[str, torch.Tensor]
Fill = Literal["keep", "zero"]


def clone_state(state: Mapping[str, torch.Tensor]) -> State:
    """A detached deep copy."""
    return {k: v.detach().clone() for k, v in state.items()}


def state_bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """Bytes on the wire for these tensors (their element size times element count)."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _broadcast_indices(index: Index, shape: torch.Size) -> tuple[torch.Tensor, ...]:
    """Turn a per-dimension index into broadcastable index tensors (an open mesh)."""
    ndim = len(shape)
    out = []
    for d in range(ndim):
        sel = index[d] if d < len(index) else slice(None)
        if isinstance(sel, slice):
            idx = torch.arange(*sel.indices(shape[d]))
        else:
            idx = sel.to(torch.long).reshape(-1)
        view = [1] * ndim
        view[d] = -1
        out.append(idx.view(view))
    return tuple(out)


def _is_basic(index: Index) -> bool:
    return all(isinstance(s, slice) for s in index)


def scatter_add(target: torch.Tensor, index: Index, value: torch.Tensor) -> None:
    """`target[index] += value` with per-dimension semantics, index tensors that may repeat a
    position included, in the same order on every device.

    Slices of `value` that an index tensor sends to the same position are first summed along
    that dimension in their order in the index (`_sum_repeats`). The distinct positions left
    address every element of `target` at most once, so one gather, add and write-back
    finishes the job without atomic accumulation, whose order on a GPU
    (`index_put_(accumulate=True)`, `index_add_`) may change from run to run and with it the
    float64 rounding: with this, each element's sum is formed in one fixed order.
    """
    distinct: list[slice | torch.Tensor] = []
    for d, sel in enumerate(index):
        if isinstance(sel, slice):
            distinct.append(sel)
        else:
            positions, value = _sum_repeats(value, d, sel)
            distinct.append(positions)
    idx = _broadcast_indices(tuple(distinct), target.shape)
    target.index_put_(idx, target[idx] + value)


def _sum_repeats(
    value: torch.Tensor, dim: int, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(distinct positions, slices of `value` along `dim` summed per distinct position).

    The k-th occurrences of all repeated positions form one layer, added at once with
    `index_copy_` (no position twice in a layer), so every sum runs over its slices in their
    order along `dim`. Without repeats `value` comes back as it is."""
    flat = positions.to(device=value.device, dtype=torch.long).reshape(-1)
    unique, slot = torch.unique(flat, sorted=True, return_inverse=True)
    if unique.numel() == flat.numel():
        return flat, value
    shape = list(value.shape)
    shape[dim] = unique.numel()
    summed = value.new_zeros(shape)
    seen: dict[int, int] = {}
    layers: list[tuple[list[int], list[int]]] = []  # (positions along dim, their slots)
    for j, s in enumerate(slot.tolist()):
        k = seen.get(s, 0)
        seen[s] = k + 1
        if k == len(layers):
            layers.append(([], []))
        layers[k][0].append(j)
        layers[k][1].append(s)
    for src, dst in layers:
        to = torch.tensor(dst, device=value.device)
        add = value.index_select(dim, torch.tensor(src, device=value.device))
        summed.index_copy_(dim, to, summed.index_select(dim, to) + add)
    return unique, summed


def select(tensor: torch.Tensor, index: Index) -> torch.Tensor:
    """`tensor[index]` with per-dimension semantics (index tensors select along one dim)."""
    if _is_basic(index):
        return tensor[index]
    return tensor[_broadcast_indices(index, tensor.shape)]


def extract(global_state: Mapping[str, torch.Tensor], index_map: IndexMap) -> State:
    """The local tensors of a sub-model: copies of the selected parts of the global state.

    Each local name is read from its first entry in the map.
    """
    out: State = {}
    for local, entry in first_entries(index_map).items():
        if entry.global_name not in global_state:
            raise KeyError(
                f"index map entry {local!r} refers to global tensor {entry.global_name!r}, "
                "which the global state does not have"
            )
        out[local] = select(global_state[entry.global_name], entry.index).clone()
    return out


class Placement(NamedTuple):
    """A client's tensors in global coordinates (`place`): per global name, the values where
    the client's entries cover an element and zero elsewhere, and the boolean coverage."""

    values: State
    covered: dict[str, torch.Tensor]


def place(
    local: Mapping[str, torch.Tensor],
    index_map: IndexMap,
    like: Mapping[str, torch.Tensor],
) -> Placement:
    """The inverse of `extract`: each global tensor the map touches, at the shape, dtype and
    device of `like[name]`, holding the client's tensors where its entries cover it.

    It writes through every entry, as aggregation does (a repeated local name lands in every
    place it is mapped to; masked-out elements cover nothing), and an element covered by
    several entries holds their mean: this is one client added to an `Accumulator` with
    weight 1, so placement and aggregation cannot disagree. `place(extract(g, m), m)` is `g`
    wherever every covering entry reads the element it writes (all but grafted repeats).
    FedFA's per-tensor scaling (Park and Joe-Wong, "Federated Learning with Flexible
    Architectures", Alg. 1) measures client tensors in these coordinates. Global names the
    map does not touch are absent from both dictionaries.
    """
    acc = Accumulator(like)
    acc.add(local, index_map, weight=1.0)
    touched = {e.global_name: like[e.global_name] for e in index_map}
    covered: dict[str, torch.Tensor] = {}
    for name, ref in touched.items():
        count = acc.covered(name)  # None only if no entry reached the accumulator
        covered[name] = torch.zeros_like(ref, dtype=torch.bool) if count is None else count > 0
    return Placement(acc.result(touched, fill="zero"), covered)


def entry_weight(
    entry: MapEntry,
    local: Mapping[str, torch.Tensor],
    reference: Mapping[str, torch.Tensor],
    weight: float | Mapping[str, float],
) -> float:
    """The weight a client gives one map entry, after checking that the entry names a tensor
    of the client's result and of the global state. With a per-name mapping, a global name
    missing from it weighs 0. A negative or non-finite weight is an error."""
    if entry.global_name not in reference:
        raise KeyError(f"global tensor {entry.global_name!r} is not in the global state")
    if entry.local not in local:
        raise KeyError(f"client result has no tensor {entry.local!r} named by the map")
    w = float(weight.get(entry.global_name, 0.0) if isinstance(weight, Mapping) else weight)
    if not (w >= 0.0 and w < float("inf")):
        raise ValueError(f"aggregation weight for {entry.global_name!r} is {w}; need >= 0")
    return w


def check_fill(fill: str) -> None:
    if fill not in ("keep", "zero"):
        raise ValueError(f"fill must be 'keep' or 'zero', got {fill!r}")


def untouched(previous: torch.Tensor, fill: Fill) -> torch.Tensor:
    """A global tensor that no client covered anywhere: a copy (keep) or zeros (zero)."""
    return previous.detach().clone() if fill == "keep" else torch.zeros_like(previous)


def merge_estimate(
    previous: torch.Tensor, estimate: torch.Tensor, hit: torch.Tensor, fill: Fill
) -> torch.Tensor:
    """A reduced global tensor: the float64 `estimate` where `hit`, `previous` (keep) or zero
    elsewhere, cast once to `previous`'s dtype (integer tensors rounded to the nearest)."""
    base = previous.detach().to(torch.float64) if fill == "keep" else torch.zeros_like(estimate)
    merged = torch.where(hit, estimate, base)
    if previous.is_floating_point():
        return merged.to(previous.dtype)
    return torch.round(merged).to(previous.dtype)


class Reducer(Protocol):
    """What aggregation reduces client tensors with: clients are `add`ed one by one, through
    their index maps, and `result` gives the new global tensors. `Accumulator` (the weighted
    mean) is the default; `hetfl.core.server.robust` has the coordinate-wise median and trimmed
    mean."""

    def add(
        self,
        local: Mapping[str, torch.Tensor],
        index_map: IndexMap,
        weight: float | Mapping[str, float] = 1.0,
        scale: Mapping[str, float] | None = None,
    ) -> None: ...

    def result(self, previous: Mapping[str, torch.Tensor], fill: Fill = "keep") -> State: ...


#: Builds a fresh reducer for one reduction, from the global state it reduces into.
ReducerFactory = Callable[[Mapping[str, torch.Tensor]], Reducer]


class Accumulator:
    """Per-element weighted averages of client tensors written through index maps.

    For every global element `g`, `result` is `sum_c w_c * s_c * x_c[g] / sum_c w_c` over
    the client entries `c` covering `g` (with their mask), where `w` is the client's weight
    (a float, or a mapping from global name to float) and `s` a per-global-name scale
    (FedFA's rescaling; 1 by default). Elements no client covered keep their previous value
    (`fill="keep"`, for weights) or are zero (`fill="zero"`, for deltas).

    Integer tensors (BatchNorm's `num_batches_tracked`) are averaged in float64 and rounded
    to the nearest integer. A weight of zero contributes nothing; a negative or non-finite
    weight is an error.
    """

    def __init__(self, reference: Mapping[str, torch.Tensor]) -> None:
        self._reference = reference
        self._sum: dict[str, torch.Tensor] = {}
        self._count: dict[str, torch.Tensor] = {}

    def _buffers(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        if name not in self._sum:
            ref = self._reference[name]
            self._sum[name] = torch.zeros(ref.shape, dtype=torch.float64, device=ref.device)
            self._count[name] = torch.zeros(ref.shape, dtype=torch.float64, device=ref.device)
        return self._sum[name], self._count[name]

    def add(
        self,
        local: Mapping[str, torch.Tensor],
        index_map: IndexMap,
        weight: float | Mapping[str, float] = 1.0,
        scale: Mapping[str, float] | None = None,
    ) -> None:
        """Add one client's tensors. Every entry of `index_map` must name a tensor of `local`."""
        for entry in index_map:
            w = entry_weight(entry, local, self._reference, weight)
            if w == 0.0:
                continue
            s = 1.0 if scale is None else float(scale.get(entry.global_name, 1.0))
            self._add_entry(entry, local[entry.local], w, s)

    def _add_entry(self, entry: MapEntry, tensor: torch.Tensor, w: float, s: float) -> None:
        total, count = self._buffers(entry.global_name)
        expected = selected_shape(total.shape, entry.index)
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"tensor {entry.local!r} has shape {tuple(tensor.shape)}, the map places it in "
                f"{entry.global_name!r}{list(total.shape)} where it must be {expected}"
            )
        value = tensor.detach().to(device=total.device, dtype=torch.float64)
        contrib = torch.full_like(value, w)
        if entry.mask is not None:
            contrib = contrib * entry.mask.to(device=total.device, dtype=torch.float64)
        value = value * contrib if s == 1.0 else value * (contrib * s)
        if _is_basic(entry.index):
            total[entry.index] += value
            count[entry.index] += contrib
        else:
            scatter_add(total, entry.index, value)
            scatter_add(count, entry.index, contrib)

    def covered(self, name: str) -> torch.Tensor | None:
        """The total weight on each element of a global tensor (None if nothing touched it)."""
        return self._count.get(name)

    def result(self, previous: Mapping[str, torch.Tensor], fill: Fill = "keep") -> State:
        """The new state: averages where covered, `previous` (keep) or zero elsewhere."""
        check_fill(fill)
        out: State = {}
        for name, prev in previous.items():
            if name not in self._sum:
                out[name] = untouched(prev, fill)
                continue
            total, count = self._sum[name], self._count[name]
            hit = count > 0
            mean = torch.where(hit, total / torch.where(hit, count, 1.0), 0.0)
            out[name] = merge_estimate(prev, mean, hit, fill)
        return out
