"""One job: a pydantic `ValidationError` as lines that name each field, the value received
and what is allowed, with the closest known key for an unknown one.

The value is shown only when it is the field's own (a number, a name, a short list): a
check over a whole section or across sections (its location is the section, or nothing)
names its fields in its message, so the section's mapping, let alone the whole config,
is never printed.
"""

from __future__ import annotations

import difflib
import types
from collections.abc import Mapping, Sequence
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

#: Longest value shown beside a problem; a longer one is the user's own text, not news.
_SHOWN = 80
_MISSING = object()


def problem_lines(
    exc: ValidationError, raw: Any, model: type[BaseModel], prefix: Sequence[str] = ()
) -> list[str]:
    """One `field: problem (got value)` line per error of `exc`, raised validating `raw`
    as `model`; each field dotted from `prefix` (where `model` sits in the whole config)."""
    lines = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        field = ".".join([*prefix, *loc])
        if err["type"] == "extra_forbidden":
            lines.append(f"{field}: unknown key{suggestion(model, loc)}")
            continue
        msg = err["msg"].removeprefix("Value error, ")
        got = _lookup(raw, loc)
        shown = f" (got {got!r})" if _is_own_value(got) else ""
        lines.append(f"{field}: {msg}{shown}" if field else f"{msg}{shown}")
    return lines


def _is_own_value(value: Any) -> bool:
    return value is not _MISSING and not isinstance(value, Mapping) and len(repr(value)) <= _SHOWN


def _lookup(raw: Any, loc: Sequence[str]) -> Any:
    node = raw
    for p in loc:
        if isinstance(node, Mapping) and p in node:
            node = node[p]
        elif isinstance(node, list) and p.isdigit() and int(p) < len(node):
            node = node[int(p)]
        else:
            return _MISSING
    return node


def suggestion(model: type[BaseModel], loc: Sequence[str]) -> str:
    """'; did you mean X? (allowed: ...)' from the fields of the record that holds the
    unknown key at `loc` (through optional sections and lists of records)."""
    for p in loc[:-1]:
        if p.isdigit():  # an item of a list of records: the record is the same
            continue
        field = model.model_fields.get(p)
        inner = _record(getattr(field, "annotation", None))
        if inner is None:
            return ""
        model = inner
    allowed = list(model.model_fields)
    close = difflib.get_close_matches(loc[-1], allowed, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{hint} (allowed: {', '.join(allowed)})"


def _record(annotation: Any) -> type[BaseModel] | None:
    """The record an annotation holds: itself, or the record inside `X | None` or
    `list[X]`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if get_origin(annotation) in (Union, types.UnionType, list):
        for arg in get_args(annotation):
            found = _record(arg)
            if found is not None:
                return found
    return None
