"""Client-program wrappers by name: an open registry (`hetfl.core.kinds`) of `WRAPPERS`,
each kind a name, its typed options and a function building a `Wrapper`
(`hetfl.core.client.program`: the honest program in, the program to run out; an attack, a fault).

A config lists them under `wrappers: [{kind: <name>, ...options}]`; the run's `Programs`
applies them in that order to every client's honest program. Core builds none in: a module
that brings one (the attacks of `hetfl.attacks`, which the `attack:` section applies to the
malicious clients) registers it with `register_wrapper` on its build function, its summary
in `hetfl.catalogue.WRAPPERS`.

The rule every wrapper keeps (docs/contracts.md §1.3, "The pickle rule"): it pickles, since
the process executor sends `Programs`, wrappers included, to its worker processes, which
build the programs there. Define a wrapper (and the program it returns) at module level, a
frozen dataclass holding its options being the simplest, never as a lambda, a local
function or a local class; `Programs` refuses a wrapper that does not pickle before the run
starts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Annotated, TypeVar

from pydantic import PlainSerializer, PlainValidator

from hetfl import catalogue
from hetfl.core.client.program import Wrapper
from hetfl.core.kinds import Chosen, Kind, KindOptions, choose, register_kind
from hetfl.core.registry import Registry

WRAPPERS: Registry[Kind[Wrapper]] = Registry("client-program wrapper")

Build = TypeVar("Build", bound=Callable[..., Wrapper])


def register_wrapper(
    name: str,
    options: type[KindOptions] = KindOptions,
    *,
    summary: str | None = None,
    summaries: Mapping[str, str] = catalogue.WRAPPERS,
) -> Callable[[Build], Build]:
    """Registers the decorated `build(options) -> Wrapper` in `WRAPPERS` as `name` with its
    `options` model and its `summary` (a plugin's) or else its summary from `summaries` (the
    catalogue); returns it unchanged."""

    def register(build: Build) -> Build:
        register_kind(WRAPPERS, name, options, build, summaries=summaries, summary=summary)
        return build

    return register


#: A config entry choosing a wrapper: validated by `choose` at the config edge, written back
#: as `{kind: name, ...options}`.
WrapperChoice = Annotated[
    Chosen[Wrapper],
    PlainValidator(partial(choose, WRAPPERS)),
    PlainSerializer(Chosen.describe),
]
