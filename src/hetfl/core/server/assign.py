"""Which clients a round asks (sampling) and which model spec each one trains (assignment):
two of the parts a `Strategy` is composed from (`hetfl.core.server.strategy`).

A sampler picks the round's clients from those the engine can reach; an assignment gives
every client known at set-up its spec, says which spec a sampled client trains this round
(a fixed spec, a width redrawn per round) and lists every spec a client may train, from
which the global spec is derived. Both are set up once with the known clients; what they
derive there is recomputed on resume (set-up is deterministic), so it is not round state.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

import torch

from hetfl.core.init import build_model
from hetfl.core.spec import Spec
from hetfl.core.types import ClientInfo, ModelFamily

#: The attribute a client declares to take the largest model an assignment has: FedFA's
#: threat model gives malicious clients the largest architecture (Park and Joe-Wong,
#: "Federated Learning with Flexible Architectures", ECML-PKDD 2024, §5). `LargestClaims`
#: applies it, around any assignment; no assignment reads it.
LARGEST = "largest"


def uniform_sample(
    available: Sequence[ClientInfo], k: int, rng: torch.Generator
) -> list[ClientInfo]:
    """`min(k, len(available))` clients drawn uniformly without replacement, sorted by id."""
    pool = sorted(available, key=lambda c: c.cid)
    if k >= len(pool):
        return pool
    chosen = torch.randperm(len(pool), generator=rng)[:k].tolist()
    return [pool[i] for i in sorted(chosen)]


class Sampler(Protocol):
    """Whom a round asks."""

    def setup(self, clients: Sequence[ClientInfo]) -> None:
        """Called once with every client the run knows (per-group counts, shares)."""

    def sample(
        self, round: int, available: Sequence[ClientInfo], rng: torch.Generator
    ) -> list[ClientInfo]:
        """The round's clients among `available` (sorted by id), sorted by id."""
        ...


class UniformSampling:
    """`clients_per_round` clients drawn uniformly without replacement (McMahan et al.,
    "Communication-Efficient Learning of Deep Networks from Decentralized Data", Alg. 1:
    a random set of max(C·K, 1) clients)."""

    def __init__(self, clients_per_round: int) -> None:
        if clients_per_round < 1:
            raise ValueError(f"clients_per_round must be >= 1, got {clients_per_round}")
        self.clients_per_round = clients_per_round

    def setup(self, clients: Sequence[ClientInfo]) -> None:
        return None

    def sample(
        self, round: int, available: Sequence[ClientInfo], rng: torch.Generator
    ) -> list[ClientInfo]:
        return uniform_sample(available, self.clients_per_round, rng)


class CyclicSampling:
    """`clients_per_round` clients drawn uniformly without replacement across rounds: a
    round draws from the available clients not yet drawn in the current pass over the
    clients; when fewer remain, it takes them all, a new pass begins and the rest of the
    round is drawn from the other available clients. So every client takes part once per
    pass (N / clients_per_round rounds with every client available), which lets a run of
    that many rounds give every client private state. A client unavailable when its pass
    ends waits for the next. The clients drawn in the current pass are checkpointed
    (`extra_state`)."""

    def __init__(self, clients_per_round: int) -> None:
        if clients_per_round < 1:
            raise ValueError(f"clients_per_round must be >= 1, got {clients_per_round}")
        self.clients_per_round = clients_per_round
        self.drawn: set[int] = set()

    def setup(self, clients: Sequence[ClientInfo]) -> None:
        self.drawn = set()

    def sample(
        self, round: int, available: Sequence[ClientInfo], rng: torch.Generator
    ) -> list[ClientInfo]:
        k = self.clients_per_round
        fresh = [c for c in available if c.cid not in self.drawn]
        if len(fresh) >= k:
            chosen = uniform_sample(fresh, k, rng)
            self.drawn |= {c.cid for c in chosen}
            return chosen
        ending = {c.cid for c in fresh}
        starting = uniform_sample(
            [c for c in available if c.cid not in ending], k - len(fresh), rng
        )
        self.drawn = {c.cid for c in starting}
        return sorted([*fresh, *starting], key=lambda c: c.cid)

    def extra_state(self) -> dict[str, Any]:
        return {"sampler_drawn": sorted(self.drawn)}

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        self.drawn = set(state["sampler_drawn"])


#: A client group's key (ScalableFL's (input side, classes)); keys are sorted.
GroupKey = tuple[int, ...]


class GroupQuotas:
    """max(1, round(xi · n_g)) clients drawn uniformly within each group g, halves rounded
    up (Nitta et al., "Scalable Federated Learning for Clients with Different Input Image
    Sizes and Numbers of Output Categories", Algorithm 1), groups in key order, one shared
    generator. n_g counts the group's clients at set-up; xi is `participation`, or
    `clients_per_round` over the number of clients when None. A group with fewer clients
    available than its quota trains those available."""

    def __init__(
        self,
        group_of: Callable[[ClientInfo], GroupKey],
        participation: float | None,
        clients_per_round: int,
    ) -> None:
        if participation is not None and not 0 < participation <= 1:
            raise ValueError(f"participation must be in (0, 1], got {participation}")
        self.group_of = group_of
        self.participation, self.clients_per_round = participation, clients_per_round
        self.sizes: Counter[GroupKey] = Counter()
        self.xi = 1.0

    def setup(self, clients: Sequence[ClientInfo]) -> None:
        self.sizes = Counter(self.group_of(c) for c in clients)
        if self.participation is None:
            self.xi = min(1.0, self.clients_per_round / len(clients))
        else:
            self.xi = self.participation

    def quota(self, group: GroupKey) -> int:
        return max(1, math.floor(self.xi * self.sizes[group] + 0.5))

    def sample(
        self, round: int, available: Sequence[ClientInfo], rng: torch.Generator
    ) -> list[ClientInfo]:
        by_group: dict[GroupKey, list[ClientInfo]] = {}
        for info in available:
            by_group.setdefault(self.group_of(info), []).append(info)
        chosen = [
            info
            for g in sorted(by_group)
            for info in uniform_sample(by_group[g], self.quota(g), rng)
        ]
        return sorted(chosen, key=lambda c: c.cid)


class Assignment(Protocol):
    """Which spec each client trains."""

    def setup(self, clients: Sequence[ClientInfo]) -> None:
        """Assign every known client its spec."""

    def spec_of(self, info: ClientInfo) -> Spec:
        """A client's own spec (the one it is evaluated with)."""
        ...

    def spec_in_round(self, round: int, info: ClientInfo, rng: torch.Generator) -> Spec:
        """The spec a sampled client trains in `round` (drawn from `rng` when it varies)."""
        ...

    def possible_specs(self) -> list[Spec]:
        """Every spec a client may train in some round; the global spec is derived from
        them (`ModelFamily.global_spec`)."""
        ...


@runtime_checkable
class SeededAssignment(Protocol):
    """An assignment that draws at set-up (FedFA's budgets and seeded choices): the
    strategy calls `setup_seeded(clients, generator)` in place of `setup`, with a generator
    of its own (`hetfl.core.rng.sibling_generator` of the run's initialisation generator,
    purpose "assignment"), so that its draws never shift the model's initialisation and
    are the same on resume."""

    def setup_seeded(self, clients: Sequence[ClientInfo], generator: torch.Generator) -> None: ...


@runtime_checkable
class JointAssignment(Protocol):
    """An assignment that chooses the specs of a round's clients together (FLANC's draw,
    redrawn until every level appears), rather than one client at a time."""

    def specs_in_round(
        self, round: int, infos: Sequence[ClientInfo], rng: torch.Generator
    ) -> list[Spec]: ...


def round_specs(
    assignment: Assignment, round: int, infos: Sequence[ClientInfo], rng: torch.Generator
) -> list[Spec]:
    """The specs the round's sampled clients train, in their order: together for a
    `JointAssignment`, else client by client (`spec_in_round`)."""
    if isinstance(assignment, JointAssignment):
        return assignment.specs_in_round(round, infos, rng)
    return [assignment.spec_in_round(round, info, rng) for info in infos]


class PerClient:
    """A spec per client from a rule on its `ClientInfo` (the family's one spec, a spec
    the client declares in its attributes), fixed for the whole run."""

    def __init__(self, rule: Callable[[ClientInfo], Spec]) -> None:
        self.rule = rule
        self.specs: dict[int, Spec] = {}

    def setup(self, clients: Sequence[ClientInfo]) -> None:
        self.specs = {c.cid: self.rule(c) for c in clients}

    def spec_of(self, info: ClientInfo) -> Spec:
        return self.specs.get(info.cid) or self.rule(info)

    def spec_in_round(self, round: int, info: ClientInfo, rng: torch.Generator) -> Spec:
        return self.spec_of(info)

    def possible_specs(self) -> list[Spec]:
        return list(self.specs.values())


def one_spec(spec: Spec) -> PerClient:
    """Every client trains `spec` (the family's one model)."""
    return PerClient(lambda info: spec)


class GroupPlan(Protocol):
    """What a method decides for one client group; the group's members train its `spec`."""

    @property
    def spec(self) -> Spec: ...


Plan = TypeVar("Plan", bound=GroupPlan)
#: Plans every group at set-up: the groups (key -> members, keys sorted) -> key -> plan.
GroupPlanner = Callable[[Mapping[GroupKey, Sequence[ClientInfo]]], dict[GroupKey, Plan]]


class PerGroup(Generic[Plan]):
    """A spec per group of clients: at set-up the clients are grouped by a key on their
    `ClientInfo` (ScalableFL's (input side, classes); a capacity, a tier) and `plan` gives
    every group its plan, which holds the group's spec and whatever else the method
    reports about it; a client trains its group's spec for the whole run. A client whose
    key no client had at set-up is refused: the global model was sized for those groups."""

    def __init__(
        self, group_of: Callable[[ClientInfo], GroupKey], plan: GroupPlanner[Plan]
    ) -> None:
        self.group_of, self.plan = group_of, plan
        self.members: dict[GroupKey, list[ClientInfo]] = {}
        self.plans: dict[GroupKey, Plan] = {}
        self._clients: list[ClientInfo] = []

    def setup(self, clients: Sequence[ClientInfo]) -> None:
        members: dict[GroupKey, list[ClientInfo]] = {}
        for info in clients:
            members.setdefault(self.group_of(info), []).append(info)
        self.members = {g: members[g] for g in sorted(members)}
        self.plans = self.plan(self.members)
        self._clients = list(clients)

    def plan_of(self, info: ClientInfo) -> Plan:
        group = self.group_of(info)
        if group not in self.plans:
            raise KeyError(
                f"client {info.cid} is in group {group}, which no client had at set-up; the "
                "global model was sized for the groups known then"
            )
        return self.plans[group]

    def spec_of(self, info: ClientInfo) -> Spec:
        return self.plan_of(info).spec

    def spec_in_round(self, round: int, info: ClientInfo, rng: torch.Generator) -> Spec:
        return self.spec_of(info)

    def possible_specs(self) -> list[Spec]:
        return [self.spec_of(c) for c in self._clients]


@runtime_checkable
class KnowsLargest(Protocol):
    """An assignment that names its largest spec itself (one it may give no client without a
    claim: FedFA's largest candidate, HeteroFL's widest level) and keeps its own record of
    each client's spec, which other parts of its method read (evaluation, the global
    spec): `give_largest(cid)` records that client `cid` takes the largest."""

    def largest_spec(self) -> Spec: ...

    def give_largest(self, cid: int) -> None: ...


def most_parameters(family: ModelFamily, specs: Sequence[Spec]) -> Spec:
    """The spec whose model has the most parameters; on a tie the first in `specs`."""
    counts = [sum(p.numel() for p in build_model(family, s).parameters()) for s in specs]
    return specs[counts.index(max(counts))]


class LargestClaims:
    """`inner`, any assignment (a plugin's included), with the largest-model claim applied
    once for every method: a client that declares `attrs[LARGEST]` (a malicious client of an
    attacked run, `hetfl.attacks.malicious`) trains the largest spec in every round; every
    other client gets what `inner` gives it, with the claimants set up and drawn for as in
    the clean run, so that the honest clients' specs are the clean run's.

    The largest spec is the one `inner` names when it `KnowsLargest` (its own measure:
    FedFA's candidate with the most MACs per sample, HeteroFL's widest level); otherwise,
    among `inner.possible_specs()` after set-up, the one whose model has the most
    parameters, on a tie the first (`most_parameters`)."""

    def __init__(self, inner: Assignment, family: ModelFamily) -> None:
        self.inner, self.family = inner, family
        self.largest: Spec | None = None

    def setup(self, clients: Sequence[ClientInfo]) -> None:
        self.inner.setup(clients)
        self._claim(clients)

    def setup_seeded(self, clients: Sequence[ClientInfo], generator: torch.Generator) -> None:
        """As `inner` sets up: seeded when it is a `SeededAssignment`."""
        if isinstance(self.inner, SeededAssignment):
            self.inner.setup_seeded(clients, generator)
        else:
            self.inner.setup(clients)
        self._claim(clients)

    def _claim(self, clients: Sequence[ClientInfo]) -> None:
        inner = self.inner
        if isinstance(inner, KnowsLargest):
            self.largest = inner.largest_spec()
            for info in clients:
                if info.attrs.get(LARGEST):
                    inner.give_largest(info.cid)
        else:
            specs = inner.possible_specs()
            self.largest = most_parameters(self.family, specs) if specs else None

    def _claimed(self, info: ClientInfo, spec: Spec) -> Spec:
        if not info.attrs.get(LARGEST):
            return spec
        if self.largest is None:
            raise RuntimeError(
                f"client {info.cid} claims the largest model, but the assignment had no "
                "possible spec to choose it from (the largest is chosen at set-up: call setup "
                "with the run's clients first)"
            )
        return self.largest

    def spec_of(self, info: ClientInfo) -> Spec:
        return self._claimed(info, self.inner.spec_of(info))

    def spec_in_round(self, round: int, info: ClientInfo, rng: torch.Generator) -> Spec:
        return self._claimed(info, self.inner.spec_in_round(round, info, rng))

    def specs_in_round(
        self, round: int, infos: Sequence[ClientInfo], rng: torch.Generator
    ) -> list[Spec]:
        """`inner`'s specs for the round (its draws made for every client), then the claims."""
        specs = round_specs(self.inner, round, infos, rng)
        return [self._claimed(i, s) for i, s in zip(infos, specs, strict=True)]

    def possible_specs(self) -> list[Spec]:
        """`inner`'s: the largest is among them (its own record holds the claims, or the
        largest was chosen from them)."""
        return self.inner.possible_specs()

    def extra_state(self) -> dict[str, Any]:
        """`inner`'s state across rounds, when it keeps one."""
        extra = getattr(self.inner, "extra_state", None)
        return {} if extra is None else dict(extra())

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        load = getattr(self.inner, "load_extra_state", None)
        if load is not None:
            load(state)
