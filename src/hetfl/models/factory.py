"""From a model name (and the options of its kind of family) to a model family."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hetfl.core.types import ModelFamily
from hetfl.models.base import MODELS, PlainFamily
from hetfl.models.flanc import COMPOSED, ComposedFamily
from hetfl.models.resnet_cifar import SPLIT, CifarResNetFamily
from hetfl.models.scalable import ARCHITECTURES, ScalableFamily

#: The options of a scalable family's (global) model.
SHAPE_OPTIONS = ("width", "stages", "blocks", "bn", "stem")
#: The options of a composed family (`hetfl.models.flanc`).
COMPOSED_OPTIONS = ("compose", "basis")
#: The options of a split family (`hetfl.models.resnet_cifar`).
SPLIT_OPTIONS = ("blocks",)


def model_names() -> list[str]:
    return sorted([*MODELS.names(), *ARCHITECTURES.names(), *COMPOSED.names(), *SPLIT.names()])


def unknown_model_message(name: str) -> str:
    allowed = ", ".join(model_names())
    return f"unknown model {name!r} (allowed: {allowed})"


def is_scalable(name: str) -> bool:
    return name in ARCHITECTURES


def is_composed(name: str) -> bool:
    return name in COMPOSED


def is_split(name: str) -> bool:
    """Whether `name` is a model cut into modules whose sides split learning trains."""
    return name in SPLIT


def misplaced_options(name: str, given: Sequence[str]) -> str | None:
    """Why the options `given` do not apply to model `name` (None when they all do)."""
    allowed: tuple[str, ...]
    if is_composed(name):
        allowed, kind = COMPOSED_OPTIONS, "is a composed model"
    elif is_scalable(name):
        allowed, kind = SHAPE_OPTIONS, "is a scalable model"
    elif is_split(name):
        allowed, kind = SPLIT_OPTIONS, "is a split model"
    else:
        allowed, kind = (), "has one fixed architecture"
    wrong = sorted(k for k in given if k not in allowed)
    if not wrong:
        return None
    owners = {
        "the scalable models": (SHAPE_OPTIONS, ARCHITECTURES.names()),
        "the composed models": (COMPOSED_OPTIONS, COMPOSED.names()),
        "the split models": (SPLIT_OPTIONS, SPLIT.names()),
    }
    by_owners: dict[tuple[str, ...], list[str]] = {}
    for k in wrong:
        titles = tuple(t for t, (options, _) in owners.items() if k in options)
        if titles:
            by_owners.setdefault(titles, []).append(k)
    where = "; ".join(
        f"{', '.join(keys)} apply to "
        + " or ".join(f"{t} only ({', '.join(owners[t][1])})" for t in titles)
        for titles, keys in by_owners.items()
    )
    unknown = [k for k in wrong if k not in (*SHAPE_OPTIONS, *COMPOSED_OPTIONS, *SPLIT_OPTIONS)]
    if unknown:
        where = f"unknown option(s) {', '.join(unknown)} (allowed: {', '.join(allowed)})"
    return f"model {name!r} {kind}: {where}"


def make_family(
    name: str, input_shape: Sequence[int], num_classes: int, **options: Any
) -> ModelFamily:
    """A plain family for a fixed architecture, a `ScalableFamily` for a scalable one, a
    `ComposedFamily` for a composed one, a `CifarResNetFamily` for a split one.

    `options` holds the scalable options (`SHAPE_OPTIONS`), the composed ones
    (`COMPOSED_OPTIONS`) or the split ones (`SPLIT_OPTIONS`); None values are unset. An
    option of another kind of model is refused rather than silently ignored.
    """
    given = {k: v for k, v in options.items() if v is not None}
    if name not in model_names():
        raise KeyError(unknown_model_message(name))
    problem = misplaced_options(name, list(given))
    if problem is not None:
        raise ValueError(problem)
    base = {"family": name, "input_shape": tuple(input_shape), "num_classes": num_classes}
    if is_composed(name):
        return ComposedFamily({**base, **given})
    if is_scalable(name):
        return ScalableFamily({**base, **given})
    if is_split(name):
        return CifarResNetFamily({**base, **given})
    return PlainFamily(name, input_shape, num_classes)
