"""Named registries of algorithms, models, datasets and partitioners.

They drive config validation ("allowed: ...") and the tests parameterised over every
entry; `hetfl list` prints `hetfl.catalogue`, a torch-free module of their names (and of
the algorithms' summaries, written only there) that the tests hold equal to them.

Registering a name twice is an error, not a silent override, and the error names both
registrations: each entry remembers its *origin*, HetFL itself or the plugin
(`hetfl.core.plugins`) whose import registered it. Registries whose names a config reads
from one field (the plain, scalable and composed models all answer `model.name`) share
their names: a name taken in one is taken in all.
"""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any, Generic, NamedTuple, TypeVar

T = TypeVar("T")

#: The plugin being imported (`registering_for`), None while HetFL registers its own.
_PLUGIN: ContextVar[str | None] = ContextVar("hetfl_registering_plugin", default=None)


@contextlib.contextmanager
def registering_for(plugin: str) -> Iterator[None]:
    """Every registration made inside is recorded as the plugin's (`Registry.origin`)."""
    token = _PLUGIN.set(plugin)
    try:
        yield
    finally:
        _PLUGIN.reset(token)


def _origin_text(plugin: str | None) -> str:
    return "HetFL (built in)" if plugin is None else f"plugin {plugin!r}"


class _Entry(NamedTuple, Generic[T]):
    value: T
    plugin: str | None  # None: built in


class Registry(Generic[T]):
    """Names to entries. `shares_names_with`: a registry whose names this one may not take
    (and that may not take this one's)."""

    def __init__(self, kind: str, *, shares_names_with: Registry[Any] | None = None) -> None:
        self.kind = kind
        self._entries: dict[str, _Entry[T]] = {}
        self._namespace: list[Registry[Any]] = (
            [] if shares_names_with is None else shares_names_with._namespace
        )
        self._namespace.append(self)

    def register(self, name: str, entry: T) -> T:
        plugin = _PLUGIN.get()
        for registry in self._namespace:
            if name in registry._entries:
                taken = registry._entries[name].plugin
                again = "" if registry is self else f" as a {self.kind}"
                raise ValueError(
                    f"{registry.kind} {name!r} is already registered by {_origin_text(taken)}; "
                    f"{_origin_text(plugin)} registers it again{again}: give it another name"
                )
        self._entries[name] = _Entry(entry, plugin)
        return entry

    def decorator(self, name: str) -> Callable[[T], T]:
        def wrap(entry: T) -> T:
            return self.register(name, entry)

        return wrap

    def get(self, name: str) -> T:
        if name not in self._entries:
            raise KeyError(self.unknown_message(name))
        return self._entries[name].value

    def origin(self, name: str) -> str | None:
        """The plugin that registered `name`, None for HetFL's own entries."""
        if name not in self._entries:
            raise KeyError(self.unknown_message(name))
        return self._entries[name].plugin

    def unknown_message(self, name: str) -> str:
        close = difflib.get_close_matches(name, list(self._entries), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        allowed = ", ".join(sorted(self._entries)) or "none is registered"
        return f"unknown {self.kind} {name!r}{hint} (allowed: {allowed})"

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
