"""One job: device profiles, what each simulated client's hardware and link can do, round by
round (preset, listed or from traces), and the `system:` section that configures them.

A profile has a compute rate (MAC/s), downlink and uplink bandwidths (Mbit/s) and the
probability of being available in a round; the server has its own compute rate. Clients
get profiles at the start by fractions (the largest-remainder rounding of `fraction * N`,
on a seeded permutation of the clients, so profiles are not tied to client ids and hence
to the partition) or by an explicit per-client list. Every `switch_every` rounds a
`switch_fraction` of the clients moves to another profile, drawn from the
`(seed, round, SERVER, "profile-switch")` generator: the assignment in round r is a pure
function of the seed and r, so it is the same on resume and in any execution order.

The presets reproduce DTFL's heterogeneity simulation ("Speed up Federated Learning in
Heterogeneous Environment: A Dynamic Tiering Approach", §4.1-4.2, and the authors' code,
mahmoudsajjadi/DTFL `main.py`): five profiles on 20 % of the clients each, bandwidths 100,
30, 30, 30, 10 Mbit/s; `dtfl` takes the relative slowdowns of the authors' code (rates
proportional to 1/16, 1/20, 1/34, 1/130, 1/250), `dtfl-cpus` the paper's CPU counts
(proportional to 4, 2, 1, 0.2, 0.1). The fastest profile's rate is `fastest_rate`. DTFL
switches 30 % of the clients every 50 rounds; the presets leave switching to the config
(`switch_every`, `switch_fraction`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from hetfl.core.rng import SERVER, torch_generator
from hetfl.systems.asynchrony import AsyncConfig, AsyncSettings
from hetfl.systems.traces import (
    FIXTURE,
    REFERENCE_MACS,
    Behaviour,
    DeviceCapacity,
    load_behaviours,
    load_capacities,
)

Clock = Literal["simulated", "measured"]
CLOCKS = ("simulated", "measured")

#: Default rate of the fastest preset profile and of one CPU of this machine: 10 GMAC/s,
#: about what one core of the development machine sustains in training.
DEFAULT_RATE = 1e10
#: Default server compute rate (MAC/s): a server ten times the fastest client.
DEFAULT_SERVER_RATE = 1e11


def _positive(name: str, value: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


@dataclass(frozen=True)
class DeviceProfile:
    """One kind of device: `rate` in MAC/s, bandwidths in Mbit/s (10^6 bits per second),
    `availability` the probability of being reachable in a given round."""

    name: str
    rate: float
    down_mbps: float
    up_mbps: float
    availability: float = 1.0

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a device profile needs a non-empty name")
        for field_name in ("rate", "down_mbps", "up_mbps"):
            _positive(f"profile {self.name!r}: {field_name}", getattr(self, field_name))
        if not (math.isfinite(self.availability) and 0 < self.availability <= 1):
            raise ValueError(
                f"profile {self.name!r}: availability must be in (0, 1], got {self.availability!r}"
            )


def check_fractions(fractions: Sequence[float]) -> None:
    """Shares of clients: finite, >= 0 and summing to 1."""
    if any(not (math.isfinite(f) and f >= 0) for f in fractions):
        raise ValueError(f"system.fractions must be finite and >= 0, got {list(fractions)}")
    if not math.isclose(sum(fractions), 1.0, abs_tol=1e-9):
        raise ValueError(
            f"system.fractions must sum to 1, got {list(fractions)} (sum {sum(fractions):.6g})"
        )


_DTFL_BANDWIDTHS = (100.0, 30.0, 30.0, 30.0, 10.0)


def _dtfl(rates: Sequence[float], names: Sequence[str]) -> tuple[DeviceProfile, ...]:
    return tuple(
        DeviceProfile(name, rate, mbps, mbps)
        for name, rate, mbps in zip(names, rates, _DTFL_BANDWIDTHS, strict=True)
    )


def dtfl_profiles(fastest_rate: float = DEFAULT_RATE) -> tuple[DeviceProfile, ...]:
    """DTFL code's slowdowns 16, 20, 34, 130, 250: rate_i = fastest_rate * 16 / slowdown_i."""
    _positive("fastest_rate", fastest_rate)
    slowdowns = (16, 20, 34, 130, 250)
    return _dtfl([fastest_rate * 16 / s for s in slowdowns], [f"dtfl-x{s}" for s in slowdowns])


def dtfl_cpu_profiles(fastest_rate: float = DEFAULT_RATE) -> tuple[DeviceProfile, ...]:
    """DTFL paper's 4, 2, 1, 0.2, 0.1 CPUs: rate_i = fastest_rate * cpus_i / 4."""
    _positive("fastest_rate", fastest_rate)
    cpus = (4.0, 2.0, 1.0, 0.2, 0.1)
    return _dtfl([fastest_rate * c / 4 for c in cpus], [f"cpus-{c:g}" for c in cpus])


PRESETS = {"dtfl": dtfl_profiles, "dtfl-cpus": dtfl_cpu_profiles}


def device_name(device: int) -> str:
    return f"device-{device}"


def trace_profiles(
    capacities: Mapping[int, DeviceCapacity], reference_macs: float = REFERENCE_MACS
) -> tuple[DeviceProfile, ...]:
    """One profile per measured device, in device-id order: its rate from the reference
    model's MACs per sample (`hetfl.systems.traces`), its bandwidth both ways."""
    return tuple(
        DeviceProfile(device_name(d), c.rate(reference_macs), c.mbps, c.mbps)
        for d, c in sorted(capacities.items())
    )


@dataclass(frozen=True)
class SystemSettings:
    """Device profiles and the simulated clock of a run (validated on construction).

    `fractions` (one per profile, summing to 1; None = equal shares) or `assignment` (a
    profile name per client, in client-id order) place profiles at the start. The clock
    is `simulated` (time = MACs / rate + bytes / bandwidth: reproducible) or `measured`
    (measured wall time times the profile's slowdown `cpu_rate / rate`: not reproducible,
    excluded from resume equality). `deadline_s` drops clients whose round takes longer.
    `by_device` (trace-driven profiles, one per measured device) places the clients on a
    seeded permutation of the profiles instead, one device each while there are enough.
    `behaviours` (profile name -> `hetfl.systems.traces.Behaviour`) says when each device
    is reachable on the simulated clock. `overcommit` (FedScale's over-commitment, 1.3 in
    its paper) samples `committed(K)` clients; the engine keeps the first `keep_first` (K)
    to finish. `asynchronous` switches synchronous rounds for asynchronous aggregation
    (`hetfl.systems.asynchrony`).
    """

    profiles: tuple[DeviceProfile, ...]
    fractions: tuple[float, ...] | None = None
    assignment: tuple[str, ...] | None = None
    switch_every: int | None = None
    switch_fraction: float = 0.0
    server_rate: float = DEFAULT_SERVER_RATE
    cpu_rate: float = DEFAULT_RATE
    deadline_s: float | None = None
    clock: Clock = "simulated"
    by_device: bool = False
    behaviours: Mapping[str, Behaviour] | None = None
    overcommit: float | None = None
    keep_first: int | None = None
    asynchronous: AsyncSettings | None = None

    def __post_init__(self) -> None:
        if not self.profiles:
            raise ValueError("system: at least one device profile is needed")
        names = [p.name for p in self.profiles]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"system.profiles: names must be unique, repeated {duplicates}")
        if self.fractions is not None and self.assignment is not None:
            raise ValueError("system: give either fractions or assignment, not both")
        if self.by_device and (self.fractions is not None or self.assignment is not None):
            raise ValueError(
                "system.trace places clients on devices itself: no fractions or assignment"
            )
        if self.behaviours is not None:
            lacking = sorted(set(names) - set(self.behaviours))
            if lacking:
                raise ValueError(
                    f"system.trace.behaviour has no trace for {len(lacking)} devices "
                    f"(first: {lacking[:3]})"
                )
        if self.fractions is not None:
            check_fractions(self.fractions)
            if len(self.fractions) != len(self.profiles):
                raise ValueError(
                    f"system.fractions has {len(self.fractions)} values for "
                    f"{len(self.profiles)} profiles"
                )
        if self.assignment is not None:
            unknown = sorted({a for a in self.assignment if a not in names})
            if unknown:
                raise ValueError(
                    f"system.assignment names unknown profiles {unknown} (known: {names})"
                )
        if self.switch_every is not None:
            if self.switch_every < 1:
                raise ValueError(f"system.switch_every must be >= 1, got {self.switch_every}")
            if len(self.profiles) < 2:
                raise ValueError("system.switch_every needs at least two profiles to switch")
        if not 0 <= self.switch_fraction <= 1:
            raise ValueError(
                f"system.switch_fraction must be in [0, 1], got {self.switch_fraction!r}"
            )
        if self.overcommit is not None and not (
            math.isfinite(self.overcommit) and self.overcommit >= 1
        ):
            raise ValueError(f"system.overcommit must be >= 1, got {self.overcommit!r}")
        if self.asynchronous is not None and self.overcommit is not None:
            raise ValueError(
                "system.overcommit keeps the first of a synchronous round's clients; "
                "system.asynchronous has no rounds to over-commit: drop one of them"
            )
        if self.keep_first is not None and self.keep_first < 1:
            raise ValueError(f"keep_first must be >= 1, got {self.keep_first}")
        _positive("system.server_rate", self.server_rate)
        _positive("system.cpu_rate", self.cpu_rate)
        if self.deadline_s is not None:
            _positive("system.deadline_s", self.deadline_s)
        if self.clock not in CLOCKS:
            raise ValueError(f"system.clock must be one of {CLOCKS}, got {self.clock!r}")

    @property
    def reproducible(self) -> bool:
        return self.clock == "simulated"

    def committed(self, cohort: int, num_clients: int) -> int:
        """How many clients a round samples for a cohort of `cohort`: ceil(overcommit x
        cohort), at most every client (the product rounded first, so 1.3 x 10 is 13)."""
        if self.overcommit is None:
            return cohort
        return min(num_clients, math.ceil(round(self.overcommit * cohort, 9)))

    def describe(self) -> str:
        """One line for the start-of-run banner."""
        devices = f"{len(self.profiles)} trace devices" + (
            ", behaviour traces" if self.behaviours is not None else ""
        )
        parts = [
            devices
            if self.by_device
            else f"{len(self.profiles)} profiles ({', '.join(p.name for p in self.profiles)})",
            f"server {self.server_rate / 1e9:g} GMAC/s",
        ]
        if self.switch_every is not None and self.switch_fraction > 0:
            parts.append(f"{self.switch_fraction:.0%} switch every {self.switch_every} rounds")
        if self.deadline_s is not None:
            parts.append(f"deadline {self.deadline_s:g} s")
        if self.overcommit is not None:
            parts.append(f"over-commit x{self.overcommit:g}")
        if self.asynchronous is not None:
            parts.append(self.asynchronous.describe())
        parts.append(
            "clock simulated" if self.reproducible else "clock measured (not reproducible)"
        )
        return ", ".join(parts)


def _rounded_counts(fractions: Sequence[float], n: int) -> list[int]:
    """Counts summing to `n`, each `floor(f * n)` plus one for the largest remainders
    (ties go to the earlier profile)."""
    raw = [f * n for f in fractions]
    counts = [math.floor(r) for r in raw]
    order = sorted(range(len(raw)), key=lambda i: (-(raw[i] - counts[i]), i))
    for i in order[: n - sum(counts)]:
        counts[i] += 1
    return counts


class ProfileSchedule:
    """Each client's profile in each round, derived from the seed alone."""

    def __init__(self, settings: SystemSettings, seed: int, cids: Sequence[int]) -> None:
        self.settings = settings
        self.seed = seed
        self.cids = sorted(cids)
        self._start = self._initial()
        self._cached: tuple[int, list[int]] = (1, list(self._start))

    def _initial(self) -> list[int]:
        """Profile index per client (in `cids` order) in round 1."""
        s, n = self.settings, len(self.cids)
        if s.by_device:  # client j takes device perm[j mod D], as FedScale cycles its trace
            d = len(s.profiles)
            perm = torch.randperm(d, generator=torch_generator(self.seed, 0, SERVER, "devices"))
            return [int(perm[j % d]) for j in range(n)]
        names = [p.name for p in s.profiles]
        if s.assignment is not None:
            if len(s.assignment) != n:
                raise ValueError(
                    f"system.assignment lists {len(s.assignment)} profiles for {n} clients"
                )
            return [names.index(a) for a in s.assignment]
        fractions = s.fractions or tuple(1 / len(names) for _ in names)
        counts = _rounded_counts(fractions, n)
        slots = [i for i, c in enumerate(counts) for _ in range(c)]
        perm = torch.randperm(n, generator=torch_generator(self.seed, 0, SERVER, "profiles"))
        out = [0] * n
        for slot, pos in zip(slots, perm.tolist(), strict=True):
            out[pos] = slot
        return out

    def is_switch_round(self, rnd: int) -> bool:
        """Switches happen before rounds `k + 1, 2k + 1, ...` (after every k rounds)."""
        every = self.settings.switch_every
        return every is not None and rnd > 1 and (rnd - 1) % every == 0

    def _switch(self, current: list[int], rnd: int) -> list[int]:
        n, n_profiles = len(current), len(self.settings.profiles)
        k = math.floor(self.settings.switch_fraction * n + 0.5)
        g = torch_generator(self.seed, rnd, SERVER, "profile-switch")
        movers = torch.randperm(n, generator=g)[:k].tolist()
        out = list(current)
        for pos in sorted(movers):
            other = int(torch.randint(n_profiles - 1, (1,), generator=g))
            out[pos] = other + (other >= current[pos])  # any profile but the current one
        return out

    def indices(self, rnd: int) -> list[int]:
        """Profile index per client (in `cids` order) in round `rnd` (>= 1)."""
        if rnd < 1:
            raise ValueError(f"rounds start at 1, got {rnd}")
        at, current = self._cached
        if rnd < at:
            at, current = 1, list(self._start)
        for r in range(at + 1, rnd + 1):
            if self.is_switch_round(r):
                current = self._switch(current, r)
        self._cached = (rnd, current)
        return list(current)

    def at(self, rnd: int) -> dict[int, DeviceProfile]:
        """Each client's profile in round `rnd`."""
        profiles = self.settings.profiles
        return {cid: profiles[i] for cid, i in zip(self.cids, self.indices(rnd), strict=True)}


# -- the `system:` section of a run config ---------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ProfileConfig(_Strict):
    """One custom profile: `rate` in MAC/s, or `cpus` times `system.cpu_rate`."""

    name: str = Field(min_length=1, description="the profile's name (system.assignment uses it)")
    rate: float | None = Field(None, gt=0, allow_inf_nan=False, description="MAC/s")
    cpus: float | None = Field(None, gt=0, allow_inf_nan=False, description="x system.cpu_rate")
    down_mbps: float = Field(gt=0, allow_inf_nan=False, description="downlink, Mbit/s")
    up_mbps: float = Field(gt=0, allow_inf_nan=False, description="uplink, Mbit/s")
    availability: float = Field(1.0, gt=0, le=1, description="probability of being reachable")

    @model_validator(mode="after")
    def _one_rate(self) -> ProfileConfig:
        if (self.rate is None) == (self.cpus is None):
            raise ValueError(f"profile {self.name!r} needs exactly one of rate (MAC/s) or cpus")
        return self

    def profile(self, cpu_rate: float) -> DeviceProfile:
        rate = self.rate if self.cpus is None else self.cpus * cpu_rate
        assert rate is not None  # exactly one of the two is set (checked above)
        return DeviceProfile(self.name, rate, self.down_mbps, self.up_mbps, self.availability)


class TraceConfig(_Strict):
    """Measured devices (FedScale's formats or HetFL's CSV/JSON; `fixture`: the shipped
    300 synthetic devices), one profile per device."""

    capacity: str = Field(
        min_length=1,
        description=f"device capacity trace: a path (.csv, .json, or FedScale's pickle) or "
        f"{FIXTURE!r}",
    )
    behaviour: str | None = Field(
        None,
        description=f"behaviour trace (when each device is reachable): a path (.json or "
        f"FedScale's pickle), {FIXTURE!r}, or null (always reachable)",
    )
    reference_macs: float = Field(
        REFERENCE_MACS,
        gt=0,
        allow_inf_nan=False,
        description="MACs of the sample a device's `computation` (ms per sample) was measured "
        "on (default: MobileNetV2 inference, 300 M)",
    )

    def devices(self) -> tuple[tuple[DeviceProfile, ...], dict[str, Behaviour] | None]:
        """Each device's profile and behaviour (matched by device id). With a behaviour
        trace, the devices it does not cover are left out, as FedScale's own two traces
        cover different phones."""
        profiles = trace_profiles(load_capacities(self.capacity), self.reference_macs)
        if self.behaviour is None:
            return profiles, None
        by_name = {device_name(d): b for d, b in load_behaviours(self.behaviour).items()}
        covered = tuple(p for p in profiles if p.name in by_name)
        if not covered:
            raise ValueError(
                f"system.trace: no device of {self.capacity!r} has a behaviour in "
                f"{self.behaviour!r} (devices are matched by id)"
            )
        return covered, {p.name: by_name[p.name] for p in covered}


class SystemConfig(_Strict):
    """Device profiles and the simulated clock (off unless `preset` or `profiles` is set)."""

    preset: str | None = Field(
        None,
        description=f"built-in profiles ({', '.join(PRESETS)}: DTFL's five, by its code's "
        "slowdowns or its paper's CPU counts)",
    )
    profiles: list[ProfileConfig] | None = Field(
        None, description="custom profiles (instead of a preset)"
    )
    trace: TraceConfig | None = Field(
        None, description="measured devices, one profile each (instead of a preset or profiles)"
    )
    fastest_rate: float = Field(
        DEFAULT_RATE, gt=0, allow_inf_nan=False, description="MAC/s of a preset's fastest profile"
    )
    cpu_rate: float = Field(
        DEFAULT_RATE,
        gt=0,
        allow_inf_nan=False,
        description="MAC/s of one CPU: the unit of a profile's cpus, and this machine's rate "
        "for the measured clock",
    )
    server_rate: float = Field(
        DEFAULT_SERVER_RATE,
        gt=0,
        allow_inf_nan=False,
        description="MAC/s of the server (its side of split learning)",
    )
    link_scale: float = Field(
        1.0,
        gt=0,
        allow_inf_nan=False,
        description="multiplies every profile's downlink and uplink (8.388608: DTFL's code, "
        "which reads its 100/30/30/30/10 as MB/s of 1024^2 bytes)",
    )
    fractions: list[float] | None = Field(
        None, description="share of clients per profile, summing to 1 (default: equal shares)"
    )
    assignment: list[str] | None = Field(
        None, description="a profile name per client, in client-id order (instead of fractions)"
    )
    switch_every: int | None = Field(None, ge=1, description="rounds between profile switches")
    switch_fraction: float = Field(
        0.0, ge=0, le=1, description="share of the clients moved to another profile at a switch"
    )
    deadline_s: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="simulated seconds a client's round may take; slower clients are "
        "dropped from the round (default: no deadline)",
    )
    overcommit: float | None = Field(
        None,
        ge=1,
        allow_inf_nan=False,
        description="sample ceil(overcommit x clients_per_round) clients and keep the first "
        "clients_per_round to finish (FedScale's over-commitment, 1.3; default: off)",
    )
    asynchronous: AsyncConfig | None = Field(
        None,
        description="aggregate as updates arrive (FedAsync or FedBuff) instead of in "
        "synchronous rounds (default: off)",
    )
    clock: Clock = Field(
        "simulated",
        description="simulated: MACs / rate + bytes / bandwidth (reproducible); measured: "
        "measured wall time x cpu_rate / rate (not reproducible)",
    )

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, v: str | None) -> str | None:
        if v is not None and v not in PRESETS:
            raise ValueError(f"unknown preset {v!r} (allowed: {', '.join(PRESETS)})")
        return v

    @field_validator("fractions")
    @classmethod
    def _shares(cls, v: list[float] | None) -> list[float] | None:
        if v is not None:
            check_fractions(v)
        return v

    @model_validator(mode="after")
    def _complete(self) -> SystemConfig:
        given = [k for k in ("preset", "profiles", "trace") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"give one of preset, profiles or trace, not {' and '.join(given)}")
        if not given:
            # keys at their defaults are fine: a resolved config.yaml lists every key
            fields = type(self).model_fields
            extra = sorted(
                k for k in self.model_fields_set if getattr(self, k) != fields[k].default
            )
            if extra:
                raise ValueError(
                    f"{', '.join(extra)} set without device profiles: set system.preset "
                    f"({', '.join(PRESETS)}), system.profiles or system.trace"
                )
            return self
        self.settings()  # the cross-field rules of SystemSettings, checked before any run
        return self

    @property
    def has_devices(self) -> bool:
        """Whether profiles are configured (a preset, listed profiles or a trace): the run has
        a simulated clock."""
        return any(d is not None for d in (self.preset, self.profiles, self.trace))

    def settings(self) -> SystemSettings | None:
        """The engine's settings, or None when no profiles are configured."""
        if not self.has_devices:
            return None
        behaviours = None
        if self.preset is not None:
            profiles = PRESETS[self.preset](self.fastest_rate)
        elif self.profiles is not None:
            profiles = tuple(p.profile(self.cpu_rate) for p in self.profiles)
        else:
            assert self.trace is not None  # has_devices
            profiles, behaviours = self.trace.devices()
        if self.link_scale != 1.0:
            profiles = tuple(
                replace(
                    p, down_mbps=p.down_mbps * self.link_scale, up_mbps=p.up_mbps * self.link_scale
                )
                for p in profiles
            )
        return SystemSettings(
            profiles=profiles,
            fractions=None if self.fractions is None else tuple(self.fractions),
            assignment=None if self.assignment is None else tuple(self.assignment),
            switch_every=self.switch_every,
            switch_fraction=self.switch_fraction,
            server_rate=self.server_rate,
            cpu_rate=self.cpu_rate,
            deadline_s=self.deadline_s,
            clock=self.clock,
            by_device=self.trace is not None,
            behaviours=behaviours,
            overcommit=self.overcommit,
            asynchronous=None if self.asynchronous is None else self.asynchronous.settings(),
        )
