"""Named registries of algorithms, models, datasets and partitioners.

They drive config validation ("allowed: ...") and the tests parameterised over every
entry; `hetfl list` prints `hetfl.catalogue`, a torch-free module of their names (and of
the algorithms' summaries, written only there) that the tests hold equal to them.
Registering a name twice is an error, not a silent override.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str, entry: T) -> T:
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._entries[name] = entry
        return entry

    def decorator(self, name: str) -> Callable[[T], T]:
        def wrap(entry: T) -> T:
            return self.register(name, entry)

        return wrap

    def get(self, name: str) -> T:
        if name not in self._entries:
            raise KeyError(self.unknown_message(name))
        return self._entries[name]

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
