"""Open registries of *kinds*: a part chosen by name in a config, each kind with options of
its own. Reducers (`hetfl.core.server.reducers`) and client-program wrappers
(`hetfl.core.client.wrappers`) are chosen this way.

A kind is registered once, as a name, a frozen pydantic model of its options and a function
that builds the part from them (`register_kind`); a module that brings a new kind (a robust
defence, an attack) registers it without editing any list. A config chooses one as a
mapping, `{kind: trimmed-mean, trim: 0.1}`, or, for a kind that needs no option, as its bare
name, `median`. `choose` validates that once, at the config edge, into a `Chosen` record (the
kind and its typed options), refusing an unknown kind with the known ones and a bad option
with the kind, the option, the value and the rule. `Chosen.build()` makes the part;
`Chosen.describe()` is what the run's outputs record.

Each built-in kind's one-line summary is written in `hetfl.catalogue` (what `hetfl list`
prints without importing torch) and read from there at registration, as for the
algorithms; a plugin's kind passes its own (`summary=`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from hetfl.core.registry import Registry

Built = TypeVar("Built")


class KindOptions(BaseModel):
    """Base of a kind's options: frozen, unknown keys refused. A kind without options uses
    it as it is."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True)
class Kind(Generic[Built]):
    """A registered kind: its name, its summary, the model of its options and `build`,
    options -> the part."""

    name: str
    summary: str
    options: type[KindOptions]
    build: Callable[[Any], Built]


@dataclass(frozen=True)
class Chosen(Generic[Built]):
    """A kind chosen by a config, with its options validated."""

    kind: Kind[Built]
    options: KindOptions

    def build(self) -> Built:
        return self.kind.build(self.options)

    def describe(self) -> dict[str, Any]:
        """`{"kind": name, **options}`: what summary.json records, and a value `choose`
        accepts back (a resolved config round-trips)."""
        return {"kind": self.kind.name, **self.options.model_dump(mode="json")}


def register_kind(
    registry: Registry[Kind[Built]],
    name: str,
    options: type[KindOptions],
    build: Callable[[Any], Built],
    *,
    summaries: Mapping[str, str],
    summary: str | None = None,
) -> Kind[Built]:
    """Registers `name` in `registry` with its `summary` (a plugin's) or else its summary
    from `summaries` (the catalogue's entry for this registry). A taken name raises
    ValueError; a name without a summary, KeyError."""
    if summary is None:
        if name not in summaries:
            raise KeyError(
                f"{registry.kind} {name!r} has no summary in hetfl.catalogue; add its one-line "
                "summary there (what `hetfl list` prints), or, in a plugin, pass it "
                "(summary='...')"
            )
        summary = summaries[name]
    return registry.register(name, Kind(name, summary, options, build))


def choose(registry: Registry[Kind[Built]], value: object) -> Chosen[Built]:
    """`value` (a `Chosen`, a kind's bare name, or `{kind: name, ...options}`) as a `Chosen`
    of `registry`; ValueError otherwise, naming what is wrong and the fix."""
    if isinstance(value, Chosen):
        return value
    what = registry.kind
    if isinstance(value, str):
        name, given = value, {}
    elif isinstance(value, Mapping) and isinstance(value.get("kind"), str):
        name, given = value["kind"], {k: v for k, v in value.items() if k != "kind"}
    else:
        raise ValueError(
            f"a {what} is chosen by its kind, as {{kind: <name>, ...its options}} or a bare "
            f"<name> (kinds: {', '.join(registry.names())}); got {value!r}"
        )
    if name not in registry:
        raise ValueError(registry.unknown_message(name))
    kind = registry.get(name)
    try:
        options = kind.options(**given)
    except ValidationError as exc:
        raise ValueError(f"{what} {name!r}: {_problems(exc, kind)}") from None
    return Chosen(kind, options)


def _problems(exc: ValidationError, kind: Kind[Any]) -> str:
    """The option errors of `kind`, each naming the option, the value and the rule; an
    error of the options together (a validator of the whole model) by its message alone."""
    fields = kind.options.model_fields
    allowed = ", ".join(f.alias or name for name, f in fields.items()) or "none"
    problems = []
    for err in exc.errors():
        option = ".".join(map(str, err["loc"]))
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            problems.append(f"{option} is not one of its options (options: {allowed})")
        elif err["type"] == "missing":
            problems.append(f"{option} is required (options: {allowed})")
        elif not option:
            problems.append(message)
        else:
            problems.append(f"{option} = {err.get('input')!r}: {message}")
    return "; ".join(problems)
