"""Robust reducers: the coordinate-wise median and trimmed mean over the clients covering each
element, in place of the `Accumulator`'s weighted mean.

Yin et al., "Byzantine-Robust Distributed Learning: Towards Optimal Statistical Rates"
(ICML 2018), §3, Definitions 1 and 2: the server replaces the mean of the workers' vectors
by, per coordinate, their median, or their β-trimmed mean (drop the largest and the smallest
β fraction, average the rest). A few arbitrary clients then move the result by a bounded
amount, where they move a mean without bound.

The estimators there are unweighted, and so are these: sample weights are ignored, except
that a weight of zero (or a per-name mapping without the name) means the client does not
cover that tensor, as in the `Accumulator`. With heterogeneous sub-models the set of clients
differs from element to element, so each statistic runs over the k clients *covering* the
element: their entries reach it and their mask does not exclude it. A client whose entries
cover one element several times (a repeated local name) counts once there, with the mean of
its values (`place` puts each client in global coordinates). A per-name `scale` multiplies
the client's values before the statistic (FedFA's rescaling, as in the `Accumulator`).

`CoordinateReducer(reference, statistic)` is the reducer (`hetfl.core.state.Reducer`); the
statistic is one of

- `median`: the middle of the k sorted values; an even k takes the mean of the two middle
  ones.
- `trimmed_mean(trim)`: with t = floor(trim·k), the t smallest and t largest values are
  dropped and the k - 2t left are averaged; trim = 0 is the plain unweighted mean. Where
  k - 2t < 1 (trim = 0.5 and an even k) the element takes the median.

A method chooses one by its `reducer` option, as a kind of `hetfl.core.server.reducers.REDUCERS`
(`median`, `trimmed-mean` with its `trim`).

These are the naive baselines over heterogeneous sub-models: a trim of floor(trim·k) is 0
wherever few clients cover an element (the widest level's elements, which the malicious
clients, given the largest model, all cover), and a median over two values is their mean.
`CoverageReducer` (`coverage-median`, `coverage-trimmed-mean`) trims by each element's
coverage and the declared malicious fraction instead, and warns where no rule can hold.

Elements no client covers keep `previous` or are zero (`fill`), integer tensors are rounded,
as in the `Accumulator`; everything is computed in float64 and cast once. Both statistics
sort the covering values, so the result does not depend on the order clients are added in,
bit for bit. The price is memory: a reducer holds every added client's tensors in global
coordinates (k float64 copies of each tensor plus their coverage), where the `Accumulator`
holds one sum and one count.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial

import torch

from hetfl.core.spec import IndexMap
from hetfl.core.state import (
    Fill,
    State,
    check_fill,
    entry_weight,
    merge_estimate,
    place,
    untouched,
)

#: A per-element statistic: (values sorted along dim 0 with the uncovered ones last, the
#: coverage count k per element) -> float64 estimate per element (any value where k = 0).
Statistic = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class HeldClients:
    """Every added client in global coordinates: float64 values (scaled), coverage, and its
    weight per global name (0 where it does not cover the tensor); what a coordinate-wise
    statistic and a defence (`hetfl.core.server.defences`) read. `place` writes at the dtype of its
    `like`: float64 keeps the client's values exact (and unrounded for integer tensors)
    until the single cast of a result; expanded zero-dim tensors carry shape and device
    without allocating the tensor."""

    def __init__(self, reference: Mapping[str, torch.Tensor]) -> None:
        self.reference = reference
        self.like = {
            name: torch.zeros((), dtype=torch.float64, device=t.device).expand(t.shape)
            for name, t in reference.items()
        }
        self.values: list[dict[str, torch.Tensor]] = []
        self.covered: list[dict[str, torch.Tensor]] = []
        self.weights: list[dict[str, float]] = []

    def add(
        self,
        local: Mapping[str, torch.Tensor],
        index_map: IndexMap,
        weight: float | Mapping[str, float] = 1.0,
        scale: Mapping[str, float] | None = None,
    ) -> None:
        weighted = [(e, entry_weight(e, local, self.reference, weight)) for e in index_map]
        covering = [e for e, w in weighted if w > 0]
        placed = place(local, covering, self.like)
        weights = {e.global_name: w for e, w in weighted if w > 0}
        values = {}
        for name, v in placed.values.items():
            s = 1.0 if scale is None else float(scale.get(name, 1.0))
            values[name] = v if s == 1.0 else v * s
        self.values.append(values)
        self.covered.append(dict(placed.covered))
        self.weights.append(weights)

    def __len__(self) -> int:
        return len(self.values)

    def update(self, i: int, previous: Mapping[str, torch.Tensor], fill: Fill) -> State:
        """Client i's update over what it covers (zero elsewhere)."""
        out = {}
        for name, v in self.values[i].items():
            base = previous[name].to(torch.float64) if fill == "keep" else torch.zeros_like(v)
            out[name] = torch.where(self.covered[i][name], v - base, 0.0)
        return out

    def weighted_mean(
        self,
        chosen: list[int],
        previous: Mapping[str, torch.Tensor],
        fill: Fill,
        factors: Mapping[int, float] | None = None,
    ) -> State:
        """The method's weighted mean over the `chosen` clients covering each element, each
        client's update multiplied by its factor (clipping); `previous` or zero elsewhere."""
        out: State = {}
        for name, prev in previous.items():
            total = torch.zeros(prev.shape, dtype=torch.float64, device=prev.device)
            count = torch.zeros_like(total)
            for i in chosen:
                if name not in self.values[i]:
                    continue
                w, cov = self.weights[i].get(name, 0.0), self.covered[i][name]
                v = self.values[i][name]
                if factors is not None and factors[i] != 1.0:
                    base = prev.to(torch.float64) if fill == "keep" else torch.zeros_like(v)
                    v = base + factors[i] * (v - base)
                total += torch.where(cov, w * v, 0.0)
                count += torch.where(cov, w, 0.0)
            hit = count > 0
            if not bool(hit.any()):
                out[name] = untouched(prev, fill)
                continue
            out[name] = merge_estimate(prev, total / count.clamp(min=1e-300), hit, fill)
        return out


class CoordinateReducer:
    """A reducer (`hetfl.core.state.Reducer`): a per-element `statistic` over the clients
    covering each element. It holds every added client's tensors in global coordinates: k
    float64 copies of each touched tensor and their coverage."""

    def __init__(self, reference: Mapping[str, torch.Tensor], statistic: Statistic) -> None:
        self.held = HeldClients(reference)
        self._statistic = statistic

    def add(
        self,
        local: Mapping[str, torch.Tensor],
        index_map: IndexMap,
        weight: float | Mapping[str, float] = 1.0,
        scale: Mapping[str, float] | None = None,
    ) -> None:
        """Add one client. Entries of weight zero do not cover; the weight is otherwise unused."""
        self.held.add(local, index_map, weight, scale)

    def result(self, previous: Mapping[str, torch.Tensor], fill: Fill = "keep") -> State:
        """The statistic where k >= 1 clients cover an element; `previous` or zero elsewhere."""
        check_fill(fill)
        out: State = {}
        held = self.held
        for name, prev in previous.items():
            holding = [i for i in range(len(held)) if name in held.values[i]]
            if not holding:
                out[name] = untouched(prev, fill)
                continue
            covered = torch.stack([held.covered[i][name] for i in holding])  # (clients, *shape)
            # NaN sorts after every number, so the k covering values come first, ascending.
            values = torch.stack([held.values[i][name] for i in holding])
            values = torch.where(covered, values, math.nan)
            ordered = torch.sort(values, dim=0).values
            count = covered.sum(dim=0)  # (*shape): k
            out[name] = merge_estimate(prev, self._statistic(ordered, count), count > 0, fill)
        return out


def _at_rank(ordered: torch.Tensor, rank: torch.Tensor) -> torch.Tensor:
    """`ordered[rank[g], g]` for every element g."""
    return ordered.gather(0, rank.unsqueeze(0)).squeeze(0)


def median(ordered: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """The middle of the k first values; for an even k the mean of the two middle ones."""
    low = _at_rank(ordered, (count - 1).clamp(min=0) // 2)
    high = _at_rank(ordered, count // 2)
    return (low + high) / 2


def _without_ends(
    ordered: torch.Tensor, count: torch.Tensor, dropped: torch.Tensor
) -> torch.Tensor:
    """The mean of ranks t .. k-t-1 of the k first values (t = `dropped` per element), or
    the median where that leaves no value."""
    kept = count - 2 * dropped
    rank = torch.arange(ordered.shape[0], device=ordered.device).view(-1, *[1] * count.dim())
    inside = (rank >= dropped) & (rank < count - dropped)
    total = torch.where(inside, ordered, 0.0).sum(dim=0)
    mean = total / kept.clamp(min=1)
    return torch.where(kept >= 1, mean, median(ordered, count))


def _trimmed_mean(ordered: torch.Tensor, count: torch.Tensor, trim: float) -> torch.Tensor:
    dropped = torch.floor(trim * count.to(torch.float64)).to(count.dtype)  # t per element
    return _without_ends(ordered, count, dropped)


def trimmed_mean(trim: float) -> Statistic:
    """The mean of ranks t .. k-t-1 of the k first values, t = floor(trim·k), or the median
    where that leaves no value (trim = 0.5, even k). Yin et al. (§3, Definition 2) take
    trim = β < 1/2; 0.5 is allowed here as the limit that gives the median."""
    check_trim(trim)
    return partial(_trimmed_mean, trim=trim)


def check_trim(trim: float) -> None:
    if not 0.0 <= trim <= 0.5:
        raise ValueError(f"trim must be a fraction in [0, 0.5], got {trim!r}")


@dataclass
class Breakdown:
    """Whether a run's coverage-aware reducers have warned that some elements are beyond
    the breakdown point (`CoverageReducer`): the factory holds one for the whole run, so
    the warning is given once."""

    warned: bool = False


@dataclass(frozen=True)
class Beyond:
    """One reduction's elements beyond the breakdown point: the `elements` (of the
    `covered` ones, those at least one client covers) where the `attackers` that may attack
    can be half or more of the clients covering them (k <= 2A), and the global `tensors`
    holding them, sorted."""

    elements: int
    covered: int
    attackers: int
    tensors: tuple[str, ...] = ()

    @property
    def share(self) -> float:
        """`elements` / `covered` (0 where nothing is covered)."""
        return self.elements / self.covered if self.covered else 0.0


def beyond_breakdown(held: HeldClients, attackers: int) -> Beyond:
    """The elements of `held` covered by k >= 1 clients with k <= 2·`attackers`: under the
    worst case that every attacker covers every element (Park and Joe-Wong, §3.1), there
    the attackers can be half or more of an element's coverage and no rule holds."""
    elements = covered = 0
    tensors = []
    names = sorted({name for values in held.values for name in values})
    for name in names:
        count = torch.stack([c[name] for c in held.covered if name in c]).sum(dim=0)  # k
        hit = count > 0
        beyond = int((hit & (count <= 2 * attackers)).sum())
        elements += beyond
        covered += int(hit.sum())
        if beyond:
            tensors.append(name)
    return Beyond(elements, covered, attackers, tuple(tensors))


def percent(share: float) -> str:
    """A share in per cent with three significant digits ("0.0475 %", "93.7 %", "100 %"),
    so that a share of a few elements of a large model does not print as 0.0 %."""
    return f"{100 * share:.3g} %"


def warn_beyond(beyond: Beyond, added: int, declared: str) -> None:
    """The breakdown warning: how many elements, their share, the tensors holding them."""
    shown = ", ".join(beyond.tensors[:3]) + (
        f" and {len(beyond.tensors) - 3} more" if len(beyond.tensors) > 3 else ""
    )
    warnings.warn(
        f"{beyond.elements:,} of the model's {beyond.covered:,} reduced elements "
        f"({percent(beyond.share)}, in {shown}) are covered by at most twice the "
        f"{beyond.attackers} client(s) that may attack of {added} ({declared}): there "
        "attackers can be half or more of the clients covering an element, and no rule "
        "holds (a coordinate-wise one takes the median there); warned once per run",
        stacklevel=3,
    )


class CoverageReducer:
    """The coordinate-wise median or trimmed mean with a trim that follows each element's
    coverage and the declared malicious `fraction` β (a reducer, `hetfl.core.state.Reducer`).

    Of a reduction's n clients, up to A = ceil(β·n) may attack, and under the paper's worst
    case (malicious clients take the largest model: Park and Joe-Wong, §3.1) every one of
    them covers every element. An element covered by k clients may then hold min(A, k)
    attackers: with `trim`, the min(A, k) smallest and largest of its k values are dropped
    and the rest averaged (never a trim of 0 where β says attackers may be there, as
    floor(β·k) is for k < 1/β), without it, the median. Where k <= 2A, attackers can be half
    or more of the element's coverage, and no rule holds: the element takes the median of
    its k values, `beyond` counts them (`beyond_breakdown`, for the run outputs), and the
    first reduction of the run with such elements warns (`breakdown`, once), naming how
    many, their share of the reduced elements and their tensors."""

    def __init__(
        self,
        reference: Mapping[str, torch.Tensor],
        fraction: float,
        trim: bool,
        breakdown: Breakdown,
    ) -> None:
        self._inner = CoordinateReducer(reference, self._statistic)
        self.fraction, self.trim, self.breakdown = fraction, trim, breakdown
        self._added = 0
        self._attackers = 0
        #: The last result's elements beyond the breakdown point (None before a result).
        self.beyond: Beyond | None = None

    def add(
        self,
        local: Mapping[str, torch.Tensor],
        index_map: IndexMap,
        weight: float | Mapping[str, float] = 1.0,
        scale: Mapping[str, float] | None = None,
    ) -> None:
        self._added += 1
        self._inner.add(local, index_map, weight, scale)

    def result(self, previous: Mapping[str, torch.Tensor], fill: Fill = "keep") -> State:
        self._attackers = math.ceil(self.fraction * self._added)
        out = self._inner.result(previous, fill)
        self.beyond = beyond_breakdown(self._inner.held, self._attackers)
        if self.beyond.elements and not self.breakdown.warned:
            self.breakdown.warned = True
            warn_beyond(self.beyond, self._added, f"declared malicious fraction {self.fraction}")
        return out

    def _statistic(self, ordered: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        attackers = self._attackers
        if not self.trim:
            return median(ordered, count)
        return _without_ends(ordered, count, count.clamp(max=attackers))  # min(A, k) each end
