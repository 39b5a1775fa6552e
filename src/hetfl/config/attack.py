"""The `attack:` section: which share of the clients is malicious and which registered
client-program wrapper (`hetfl.core.client.wrappers`, e.g. `hetfl.attacks.poisoning`) each of them
runs around its honest program, validated once into a frozen `Attack`.

    attack: {kind: fedfa-poison, fraction: 0.2, lambda: 20}

`fraction` belongs to the section; every other key is the kind's own option, validated by
the kind (unknown keys are refused, naming the kind's options). No section, no attack: the
run is exactly the clean run.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import PlainSerializer, PlainValidator

import hetfl.attacks  # noqa: F401 (registers the built-in attacks before validation)
from hetfl.attacks.malicious import check_fraction
from hetfl.core.client.program import Wrapper
from hetfl.core.client.wrappers import WRAPPERS
from hetfl.core.kinds import Chosen, choose


@dataclass(frozen=True)
class Attack:
    """A validated `attack:` section: the malicious `fraction` of the clients and the
    wrapper `chosen` for them."""

    fraction: float
    chosen: Chosen[Wrapper]

    @property
    def kind(self) -> str:
        return self.chosen.kind.name

    def describe(self) -> dict[str, Any]:
        """`{kind, fraction, ...options}`: what summary.json records, and a value `parse`
        accepts back (a resolved config round-trips)."""
        described = self.chosen.describe()
        return {"kind": described.pop("kind"), "fraction": self.fraction, **described}


def parse_attack(value: object) -> Attack:
    """`value` (an `Attack` or the section's mapping) as an `Attack`; ValueError naming what
    is wrong otherwise."""
    if isinstance(value, Attack):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(
            "attack is a mapping, {kind: <attack>, fraction: <share of clients>, ...options}, "
            f"got {value!r}"
        )
    if "fraction" not in value:
        close = difflib.get_close_matches("fraction", [str(k) for k in value], n=1)
        hint = f" (did you mean 'fraction' for {close[0]!r}?)" if close else ""
        raise ValueError(
            f"attack.fraction is required: the share of the clients that attack, in [0, 1]{hint}"
        )
    fraction = value["fraction"]
    if isinstance(fraction, bool) or not isinstance(fraction, int | float):
        raise ValueError(f"attack.fraction must be a number in [0, 1], got {fraction!r}")
    check_fraction(float(fraction))
    rest = {k: v for k, v in value.items() if k != "fraction"}
    return Attack(float(fraction), choose(WRAPPERS, rest))


#: The `attack:` field of `RunConfig`: validated by `parse_attack`, written back flat.
AttackSection = Annotated[
    Attack,
    PlainValidator(parse_attack),
    PlainSerializer(Attack.describe),
]
