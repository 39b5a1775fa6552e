"""Parameter matching: widths for a scalable model whose parameter count is nearest to a
target, exactly.

Comparisons at equal model size need it: ScalableFL's §V (Nitta, Suzuki, Rodríguez Mulet,
Yaguchi and Hirai, "Scalable Federated Learning for Clients with Different Input Image
Sizes and Numbers of Output Categories", arXiv 2311.08716 v1, §V and Table VIII's
hidden-channel ratios) compares with a HeteroFL whose every client has a fixed depth and
widths chosen so that its model has the parameter count of its ScalableFL model.

The count is an exact quadratic in the per-stage channel counts (every tensor is a product
of at most two channel counts), fitted from a few meta-device builds and checked against a
build (`ParameterCount`); `match_parameters` first tries one ratio for every stage, then
one ratio per stage.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import combinations

import numpy as np
import torch

from hetfl.core.spec import Spec
from hetfl.core.types import ModelFamily
from hetfl.models.scalable import ARCHITECTURES
from hetfl.models.slim import channels


def parameter_count(family: ModelFamily, spec: Spec) -> int:
    """Parameters of the model for `spec` (shared and private alike; BatchNorm running
    statistics are buffers, not parameters), built on the meta device."""
    with torch.device("meta"):
        model = family.build(spec)
    return sum(p.numel() for p in model.parameters())


class ParameterCount:
    """The parameter count of `spec`'s model as a function of the channel counts of its
    `stages` width slots, exact: every tensor's size is a constant or a product of at most
    two slots' channel counts, so the count is a quadratic in them. With x_i = c_i - 1:

        P(x) = d + sum_i b_i x_i + sum_i a_ii x_i^2 + sum_{i<j} a_ij x_i x_j

    fitted from 1 + 2D + D(D-1)/2 builds around x = 0 and checked at one more point."""

    def __init__(self, family: ModelFamily, spec: Spec) -> None:
        self.family, self.spec = family, spec
        bases = ARCHITECTURES.get(spec["family"]).base_widths
        self.bases = np.array(bases[: spec["stages"]])
        dim = len(self.bases)

        def at(x: Mapping[int, int]) -> int:
            """The built count at x (slot -> x_i; other slots at x = 0)."""
            chans = np.ones(dim, dtype=np.int64)
            for i, v in x.items():
                chans[i] += v
            return parameter_count(family, self.spec_at(chans))

        self.d = at({})
        self.a = np.zeros((dim, dim), dtype=np.int64)
        self.b = np.zeros(dim, dtype=np.int64)
        for i in range(dim):
            p1, p2 = at({i: 1}), at({i: 2})
            self.a[i, i] = (p2 - 2 * p1 + self.d) // 2
            self.b[i] = p1 - self.d - self.a[i, i]
        for i, j in combinations(range(dim), 2):
            both = at({i: 1, j: 1})
            self.a[i, j] = both - self.d - self.b[i] - self.b[j] - self.a[i, i] - self.a[j, j]
        probe = np.array([3 + 2 * i for i in range(dim)], dtype=np.int64)
        if int(self(probe[None])[0]) != parameter_count(family, self.spec_at(probe)):
            raise ValueError(
                f"{spec['family']}: the parameter count is not a quadratic in the stage "
                "widths, so it cannot be matched exactly"
            )

    def spec_at(self, chans: np.ndarray) -> Spec:
        """The spec whose width slots have `chans` channels (unused slots follow the last)."""
        ratios = [int(c) / int(b) for c, b in zip(chans, self.bases, strict=True)]
        slots = len(self.spec["widths"])
        return self.spec.replace(widths=tuple(ratios + [ratios[-1]] * (slots - len(ratios))))

    def __call__(self, chans: np.ndarray) -> np.ndarray:
        """Counts for channel counts of shape (N, D)."""
        x = chans.astype(np.int64) - 1
        linear = x @ self.b + np.einsum("ni,ij,nj->n", x, np.triu(self.a), x)
        return self.d + linear


@dataclass(frozen=True)
class Match:
    """The widths found for a parameter target and the count they give."""

    widths: tuple[float, ...]
    params: int
    per_stage: bool


def match_parameters(
    family: ModelFamily,
    spec: Spec,
    target: int,
    *,
    tolerance: float = 0.01,
    max_ratio: float = 4.0,
    max_spread: float = 1.5,
    max_grid: int = 4_000_000,
) -> Match:
    """Widths for `spec`'s depth, classes and input whose model's parameter count is nearest
    to `target`.

    First one ratio for every stage, over every ratio in (0, max_ratio] that changes some
    stage's channel count. When that misses `target` by more than `tolerance` (relative),
    one ratio per stage, with the ratios within a factor `max_spread` of each other (so no
    stage is starved to fit the count), replaces it if it comes nearer; this enumerates the
    first D-1 stages' channel counts (when they number at most `max_grid`) and solves the
    last stage's. Ties go to the first candidate found (the narrowest single ratio)."""
    count = ParameterCount(family, spec)
    tops = [channels(max_ratio, int(b)) for b in count.bases]
    ratios = sorted(
        {k / int(b) for b, top in zip(count.bases, tops, strict=True) for k in range(1, top + 1)}
    )
    ratios = [r for r in ratios if r <= max_ratio]
    chans = np.array([[channels(r, int(b)) for b in count.bases] for r in ratios])
    gaps = np.abs(count(chans) - target)
    best = int(np.argmin(gaps))
    found = chans[best]
    widths = (ratios[best],) * len(spec["widths"])
    if gaps[best] > tolerance * target and math.prod(tops[:-1]) <= max_grid:
        per_stage = _nearest_per_stage(count, tops, target, max_spread)
        if per_stage is not None and abs(int(count(per_stage[None])[0]) - target) < gaps[best]:
            found, widths = per_stage, tuple(count.spec_at(per_stage)["widths"])
    params = parameter_count(family, spec.replace(widths=widths))
    if params != int(count(found[None])[0]):
        raise RuntimeError(f"parameter count model disagrees with a build at {found.tolist()}")
    return Match(widths, params, per_stage=len(set(widths)) > 1)


def _nearest_per_stage(
    count: ParameterCount, tops: list[int], target: int, spread: float
) -> np.ndarray | None:
    """The channel counts c (c_i in 1..tops[i], ratios c_i / base_i within a factor `spread`
    of each other) whose count is nearest to `target`, or None if no c qualifies. Every
    combination of the first D-1 stages is tried; the count grows with the last stage's
    channels, so for each the nearest last count is next to the quadratic's root, moved
    into the range the spread allows."""
    last = len(tops) - 1
    bases = count.bases.astype(np.float64)
    axes = [np.arange(1, t + 1) for t in tops[:-1]]
    # (N, D): every combination of the first D-1 stages, the last stage at 1 channel
    grid = np.ones((math.prod(tops[:-1]), last + 1), dtype=np.int64)
    if axes:
        grid[:, :-1] = np.stack(np.meshgrid(*axes, indexing="ij"), -1).reshape(-1, last)
    head = grid[:, :last] / bases[:last]  # (N, D-1) ratios
    widest = head.max(axis=1, initial=0.0)
    narrowest = head.min(axis=1, initial=np.inf)
    eps = 1e-9
    lo = np.maximum(np.ceil(widest / spread * bases[last] - eps), 1)
    hi = np.minimum(np.floor(narrowest * spread * bases[last] + eps), tops[-1])
    ok = (lo <= hi) & (widest <= narrowest * spread + eps)
    if not ok.any():
        return None
    grid, lo, hi = grid[ok], lo[ok].astype(np.int64), hi[ok].astype(np.int64)
    # the count as a function of the last stage's x = c - 1: const + lin * x + quad * x^2
    rest = target - count(grid).astype(np.float64)
    lin = count.b[last] + (grid[:, :last] - 1) @ count.a[:last, last]
    quad = float(count.a[last, last])
    with np.errstate(invalid="ignore"):
        root = (-lin + np.sqrt(lin**2 + 4 * quad * rest)) / (2 * quad) if quad else rest / lin
    floor = np.floor(np.nan_to_num(root, nan=0.0)).astype(np.int64) + 1
    candidates = []
    for shift in (-1, 0, 1, 2):
        cand = grid.copy()
        cand[:, last] = np.clip(floor + shift, lo, hi)
        candidates.append(cand)
    stacked = np.concatenate(candidates)
    return stacked[int(np.argmin(np.abs(count(stacked) - target)))]
