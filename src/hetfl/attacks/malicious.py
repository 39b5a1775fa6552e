"""Which clients attack, and how an attack reaches only them.

Park and Joe-Wong, "Federated Learning with Flexible Architectures" (ECML-PKDD 2024), §5
(robustness): a fraction of the clients is malicious for the whole run, and the threat model
gives them the largest architecture. Here the set is drawn once from the run's seed, with a
generator of its own, (seed, 0, server, "malicious"), before any architecture or width is
assigned, so that it depends on the seed, the fraction and the client ids alone: the same
clients attack under every compared method, and a resumed run draws the same set again
(the checkpoint records it and refuses another). A malicious client declares
`attrs[LARGEST]` (`hetfl.core.server.assign`), which `LargestClaims`, wrapped around the
method's assignment (any one, a plugin's included), applies: it trains the largest spec
(FedFA's, FlexiFed's and NeFL's largest candidate, HeteroFL's, FjORD's and FLANC's widest
level, else the possible spec with the most parameters), every other client what it would
get in the clean run. With the section's `largest: false` (`hetfl.config.attack`) nothing is
declared and nothing wrapped: the malicious clients train what the clean run gives them.

`OnlyMalicious(attack, malicious)` is the `Wrapper` (`hetfl.core.client.program`) the run's programs
pass through: a malicious client's honest program goes through `attack`, every other
client's program is flagged honest; both declare `malicious` for the per-client trace.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from hetfl.core.client.program import Program, Wrapper
from hetfl.core.model_cache import ModelCache
from hetfl.core.rng import SERVER, torch_generator
from hetfl.core.server.assign import LARGEST
from hetfl.core.server_program import Channel
from hetfl.core.types import ClientData, ClientInfo, ClientOutput, ClientTask, EvalTask


def check_fraction(fraction: float) -> None:
    """ValueError unless `fraction` is a share of clients, in [0, 1]."""
    if not (isinstance(fraction, int | float) and 0.0 <= fraction <= 1.0):
        raise ValueError(
            f"attack.fraction must be a share of the clients in [0, 1], got {fraction!r}"
        )


def malicious_count(n_clients: int, fraction: float) -> int:
    """round(fraction · n), halves up: 20 % of 10 clients is 2, of 12 is 2, of 13 is 3."""
    check_fraction(fraction)
    return min(n_clients, math.floor(fraction * n_clients + 0.5))


def draw_malicious(cids: Iterable[int], fraction: float, seed: int) -> frozenset[int]:
    """`malicious_count` clients of `cids`, a seeded permutation's first ones, from the
    (seed, 0, server, "malicious") generator: independent of every other draw of the run."""
    ordered = sorted(cids)
    k = malicious_count(len(ordered), fraction)
    if k == 0:
        return frozenset()
    order = torch.randperm(len(ordered), generator=torch_generator(seed, 0, SERVER, "malicious"))
    return frozenset(ordered[i] for i in order[:k].tolist())


def check_class(attack: str, option: str, value: int, data: ClientData) -> None:
    """ValueError unless the class an attack option names is one of the client's data."""
    if value >= data.num_classes:
        raise ValueError(
            f"attack {attack}: {option} = {value} is not a class of the data "
            f"(0..{data.num_classes - 1})"
        )


def declared_attrs(malicious: Collection[int]) -> dict[int, dict[str, Any]]:
    """What each malicious client declares at set-up: that it takes the largest model."""
    return {cid: {LARGEST: True} for cid in sorted(malicious)}


@dataclass
class Delegating:
    """A client program standing in for `honest`: its identity and its evaluation are the
    honest program's, so what stands in changes only what it adds (an attack's `fit`, the
    trace's flag)."""

    honest: Program
    cid: int = field(init=False)
    device: torch.device = field(init=False)

    def __post_init__(self) -> None:
        self.cid, self.device = self.honest.cid, self.honest.device

    def evaluate(
        self,
        task: EvalTask,
        data: ClientData,
        private: Mapping[str, torch.Tensor],
        models: ModelCache,
    ) -> tuple[float, float, int]:
        return self.honest.evaluate(task, data, private, models)


@dataclass
class Flagged(Delegating):
    """A client's program, unchanged, that says in the trace whether it attacks."""

    malicious: bool = False

    def fit(
        self,
        task: ClientTask,
        data: ClientData,
        private: Mapping[str, torch.Tensor],
        generator: torch.Generator,
        *,
        info: ClientInfo,
        channel: Channel | None = None,
    ) -> ClientOutput:
        return self.honest.fit(task, data, private, generator, info=info, channel=channel)

    def trace_fields(self) -> dict[str, bool]:
        return {"malicious": self.malicious}


@dataclass(frozen=True)
class OnlyMalicious:
    """The wrapper of an attacked run: `attack` around each malicious client's program."""

    attack: Wrapper
    malicious: frozenset[int]

    def __call__(self, program: Program) -> Program:
        if program.cid in self.malicious:
            return Flagged(self.attack(program), malicious=True)
        return Flagged(program, malicious=False)
