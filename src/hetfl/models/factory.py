"""From a model name (and, for scalable families, their shape options) to a model family."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hetfl.core.types import ModelFamily
from hetfl.models.base import MODELS, PlainFamily
from hetfl.models.scalable import ARCHITECTURES, ScalableFamily


def model_names() -> list[str]:
    return sorted([*MODELS.names(), *ARCHITECTURES.names()])


def unknown_model_message(name: str) -> str:
    allowed = ", ".join(model_names())
    return f"unknown model {name!r} (allowed: {allowed})"


def is_scalable(name: str) -> bool:
    return name in ARCHITECTURES


def make_family(
    name: str, input_shape: Sequence[int], num_classes: int, **shape: Any
) -> ModelFamily:
    """A plain family for a fixed architecture, a `ScalableFamily` for a scalable one.

    `shape` holds the scalable options (`width`, `stages`, `blocks`, `bn`, `stem`); None
    values are unset. They are refused for plain models rather than silently ignored.
    """
    given = {k: v for k, v in shape.items() if v is not None}
    if is_scalable(name):
        base = {"family": name, "input_shape": tuple(input_shape), "num_classes": num_classes}
        return ScalableFamily({**base, **given})
    if name not in MODELS:
        raise KeyError(unknown_model_message(name))
    if given:
        raise ValueError(
            f"model {name!r} has one fixed architecture; {', '.join(sorted(given))} apply to "
            f"the scalable models only ({', '.join(ARCHITECTURES.names())})"
        )
    return PlainFamily(name, input_shape, num_classes)
