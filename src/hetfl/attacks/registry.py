"""The attacks by name: an open registry (`hetfl.core.kinds`) of `ATTACKS`, each kind a name,
its typed options and a function building the `Wrapper` (`hetfl.core.client.program`) a
malicious client's honest program goes through.

A config names one under `attack: {kind: <name>, fraction: ..., ...options}`, which applies
it to the malicious clients only and records it (`hetfl.attacks.malicious`). Attacks are
not client-program wrappers of the `wrappers:` list (`hetfl.core.client.wrappers`), which
every client runs: an attack there would make every client malicious and record none, so
the config refuses it, pointing to `attack:`. A plugin registers its own attack with
`register_attack` (docs/plugins.md); HetFL's own carry their summaries in
`hetfl.catalogue.ATTACKS`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeVar

from hetfl import catalogue
from hetfl.core.client.program import Wrapper
from hetfl.core.kinds import Kind, KindOptions, register_kind
from hetfl.core.registry import Registry

ATTACKS: Registry[Kind[Wrapper]] = Registry("attack")

Build = TypeVar("Build", bound=Callable[..., Wrapper])


def register_attack(
    name: str,
    options: type[KindOptions] = KindOptions,
    *,
    summary: str | None = None,
    summaries: Mapping[str, str] = catalogue.ATTACKS,
) -> Callable[[Build], Build]:
    """Registers the decorated `build(options) -> Wrapper` in `ATTACKS` as `name` with its
    `options` model and its `summary` (a plugin's) or else its summary from `summaries` (the
    catalogue); returns it unchanged."""

    def register(build: Build) -> Build:
        register_kind(ATTACKS, name, options, build, summaries=summaries, summary=summary)
        return build

    return register
