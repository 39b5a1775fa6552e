"""Width levels of a scalable model, shared by the width-sliced methods (HeteroFL, FjORD,
FLANC, later FedFA): levels checked and paired with their proportions, and the full-width
base spec a level is cut from (`full_width_base`, `level_specs`). Which client trains which
level is `hetfl.algorithms.parts.width_assignment`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from hetfl.core.spec import Spec
from hetfl.core.types import ModelFamily


def check_levels(
    levels: Sequence[float], proportions: Sequence[float] | None
) -> tuple[list[float], list[float] | None]:
    """Width levels narrowest first, each with its proportion (None = equal shares), checked.

    Levels and proportions are sorted as pairs, so that a level keeps its share whatever
    order a config lists them in (`levels: [1.0, 0.5], proportions: [0.7, 0.3]` puts 70 %
    of the clients at width 1 for every method)."""
    if not levels:
        raise ValueError("levels must list at least one width ratio")
    for p in levels:
        if not (math.isfinite(p) and 0 < p <= 1):
            raise ValueError(f"width levels must be in (0, 1], got {list(levels)}")
    if len(set(levels)) != len(levels):
        raise ValueError(f"width levels must be distinct, got {list(levels)}")
    if proportions is None:
        return sorted(float(p) for p in levels), None
    if len(proportions) != len(levels):
        raise ValueError(
            f"proportions needs one value per level ({len(levels)}), got {list(proportions)}"
        )
    if any(not (q >= 0 and math.isfinite(q)) for q in proportions) or sum(proportions) <= 0:
        raise ValueError(f"proportions must be >= 0 with a positive sum, got {proportions}")
    pairs = sorted((float(p), float(q)) for p, q in zip(levels, proportions, strict=True))
    return [p for p, _ in pairs], [q for _, q in pairs]


def shares(levels: Sequence[float], proportions: Sequence[float] | None) -> list[float]:
    """Normalised proportions (equal when None)."""
    raw = list(proportions) if proportions is not None else [1.0] * len(levels)
    total = float(sum(raw))
    return [q / total for q in raw]


def scalable_base(family: ModelFamily, method: str) -> Spec:
    """The family's base spec (its `model.width` included), refused for a model that has
    no width slots."""
    base = family.global_spec([])
    if base.get("widths") is None:
        raise ValueError(
            f"{method} needs a scalable model (model.name one of the scalable families; see "
            "`hetfl list`); the configured model has one fixed architecture"
        )
    return base


def full_width_base(family: ModelFamily, method: str) -> Spec:
    """The family's base spec, which width-sliced methods treat as the full (ratio 1) model."""
    base = scalable_base(family, method)
    widths = base["widths"]
    if any(w != 1.0 for w in widths):
        raise ValueError(
            f"{method} slices the configured model by its own width levels; leave model.width "
            f"at 1 (the global model), got {widths}"
        )
    return base


#: A level's spec: the width ratio r -> the spec of the model at that width.
LevelSpec = Callable[[float], Spec]


def level_specs(base: Spec, **changes: object) -> LevelSpec:
    """The level spec of `base`: r -> `base` with every width slot at r and `changes`
    (a method's normalisation and scaler)."""

    def at(ratio: float) -> Spec:
        return base.replace(widths=(ratio,) * len(base["widths"]), **changes)

    return at
