"""The `attack:` section: which share of the clients is malicious and which registered
attack (`hetfl.attacks.registry.ATTACKS`, e.g. `hetfl.attacks.poisoning`) each of them runs
around its honest program, validated once into a frozen `Attack`.

    attack: {kind: fedfa-poison, fraction: 0.2, lambda: 20}

`fraction` belongs to the section, and so does `largest` (default true): whether the
malicious clients claim the largest model, the threat model of Park and Joe-Wong,
"Federated Learning with Flexible Architectures" (ECML-PKDD 2024), §5, its worst case for
the rules that read each element's coverage. With `largest: false` they train what the
method's assignment gives them, as in the clean run (`hetfl.attacks.malicious`). Every
other key is the kind's own option, validated by the kind (unknown keys are refused,
naming the kind's options). No section, no attack: the run is exactly the clean run.

What the section cannot mean is refused here, against the rest of the config
(`check_attack`, `refuse_attacks_in_wrappers`):

- an attack under `wrappers:`, which every client runs: it would make every client
  malicious and record no attack; the error points to `attack:`;
- a method the attacks cannot reach (`UNREACHED`): FedGKT's clients aggregate no model
  tensor; its server trains on the features and logits they upload, which no attack
  poisons, so an attacked FedGKT run would be the clean run under an attack's name;
- a `fraction` above 0 that selects no client of `data.num_clients` (20 % of 2 clients
  rounds to 0): the run would be clean while it says it is attacked. A fraction of exactly
  0 is allowed, the paper's 0 % scenario (Park and Joe-Wong, §5), e.g. as a sweep's clean
  point.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import PlainSerializer, PlainValidator

import hetfl.attacks  # noqa: F401 (registers the built-in attacks before validation)
from hetfl.attacks.malicious import check_fraction, malicious_count
from hetfl.attacks.registry import ATTACKS
from hetfl.core.client.program import Wrapper
from hetfl.core.kinds import Chosen, choose


@dataclass(frozen=True)
class Attack:
    """A validated `attack:` section: the malicious `fraction` of the clients, the
    wrapper `chosen` for them and whether they claim the `largest` model."""

    fraction: float
    chosen: Chosen[Wrapper]
    largest: bool = True

    @property
    def kind(self) -> str:
        return self.chosen.kind.name

    def describe(self) -> dict[str, Any]:
        """`{kind, fraction, ...options}`: what summary.json records, and a value `parse`
        accepts back (a resolved config round-trips). `largest` is written only when off,
        so that the records of runs with the claim read as they always have."""
        described = self.chosen.describe()
        claim = {} if self.largest else {"largest": False}
        return {"kind": described.pop("kind"), "fraction": self.fraction, **claim, **described}


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
    largest = value.get("largest", True)
    if not isinstance(largest, bool):
        raise ValueError(
            "attack.largest must be true (the malicious clients claim the largest model) or "
            f"false (they train what the assignment gives them), got {largest!r}"
        )
    rest = {k: v for k, v in value.items() if k not in ("fraction", "largest")}
    return Attack(float(fraction), choose(ATTACKS, rest), largest)


#: The `attack:` field of `RunConfig`: validated by `parse_attack`, written back flat.
AttackSection = Annotated[
    Attack,
    PlainValidator(parse_attack),
    PlainSerializer(Attack.describe),
]


#: Methods whose clients' uploads no attack changes, with why: `attack:` is refused for them.
UNREACHED: dict[str, str] = {
    "fedgkt": (
        "FedGKT's clients aggregate no model tensor: its server trains on the features and "
        "logits they upload, which the attacks (they change the uploaded model tensors) do "
        "not poison, so the run would be the clean run under an attack's name"
    ),
}


def check_attack(attack: Attack, algorithm: str, num_clients: int) -> None:
    """ValueError unless `attack` reaches `algorithm`'s clients (`UNREACHED`) and its
    fraction, when above 0, selects at least one of `num_clients` clients."""
    if algorithm in UNREACHED:
        raise ValueError(
            f"attack: {attack.kind!r} cannot attack algorithm {algorithm!r}: "
            f"{UNREACHED[algorithm]}; remove the attack: section or choose another method"
        )
    if attack.fraction > 0 and malicious_count(num_clients, attack.fraction) == 0:
        least = 0.5 / num_clients
        raise ValueError(
            f"attack.fraction = {attack.fraction} of data.num_clients = {num_clients} rounds to "
            f"0 malicious clients (round(fraction x clients), halves up), so the run would be "
            f"clean; set attack.fraction to at least {least:g} (one client), or to 0 for an "
            "explicitly clean run"
        )


def refuse_attacks_in_wrappers(value: object) -> object:
    """`value` (the `wrappers:` list as given) unchanged; ValueError, pointing to `attack:`,
    when an entry names an attack (`ATTACKS`)."""
    if not isinstance(value, list):
        return value
    for i, entry in enumerate(value):
        name = entry.get("kind") if isinstance(entry, Mapping) else entry
        if isinstance(name, str) and name in ATTACKS:
            raise ValueError(
                f"wrappers.{i}: {name!r} is an attack, not a wrapper every client runs: there "
                "it would make every client malicious and record no attack; write it as "
                f"attack: {{kind: {name}, fraction: <share of clients>, ...its options}}"
            )
    return value
