"""DTFL's dynamic tier scheduler: which tier each of a round's clients trains.

"Speed up Federated Learning in Heterogeneous Environment: A Dynamic Tiering Approach",
§3.3 and Algorithm 1 (`TierScheduler`, lines 21-35), with the authors' code
(mahmoudsajjadi/DTFL `utils/TierScheduler.py`) where the text is silent. In tier m a client
trains the first m modules and a head; the server trains the rest (more layers on the
client as m grows). Per round:

1. A client's observed client-side time in the tier m_k it last trained is the time its
   side took, minus the estimated communication, T^c_k - T^com_k(m_k) (line 22). The client
   side never waits for the server in local-loss training, so its elapsed time is its
   compute and its transfers, whatever the server side took: the code measures the
   client's training alone (`duration`, the server's step left out of the timer) and adds
   its transfers (`simulated_delay`). A round's total time by Eq. (5) would not do: when the
   server side is the longer, it would take the server's time for the client's, and a
   client moved to a fast device while in a low tier would never be offered more layers.
   With `observed="compute"`, the exact simulated compute time (under the simulated clock
   the two differ only by the communication estimate's error). It is smoothed per
   (client, tier) by an EMA of span 2 (pandas `ewm(span=2, adjust=False)` in
   the code: 2/3 on the newest value; line 23).
2. For every tier m (all of them: the code skips one), Eq. (5):
   T̂_k(m) = T̂^com + max(T̂^c, T̂^s), with T̂^c = (T^cp(m) / T^cp(m_k)) T̄^c_k (lines
   24-29), T̂^s = T^sp(m) Ñ_k, T̂^com the communication of tier m (line 26 prints tier
   m_k's, a typo the code does not make).
3. T_max = max over this round's clients with a history of min_m T̂_k(m) (line 31), computed
   and used in the same round (the code uses the previous round's), and each such client
   gets the largest m with T̂_k(m) <= T_max (line 33): the most layers it can train
   without becoming the straggler.

A client without a history (every client in round 1) is placed by `no_history`:
`default-tier` gives it a fixed tier (`default_tier`; the code's scheduler gives paper
tier 2, its `SMALLEST_TIER = 6` in the code's reversed numbering, and the code's `main.py`
starts every client of its 7-tier runs in paper tier 7, code tier 1); `profile` applies the
scheduler's own rule to the client's device profile, the paper's tier profiling "before
the training starts" (§3.3): its client-side time in tier m is T^cp(m) Ñ_k over its
device's compute rate, its communication at its device's link rates, and it enters T_max
and the choice with the clients that have a history. The paper is silent on round 1
(Algorithm 1 line 2 calls the scheduler before any time is measured).

When a client's device profile changes (DTFL §4.2 switches 30 % of them every 50 rounds),
the paper's EMA keeps mixing times from its earlier device: a client moved to a fast device
climbs one smoothed step at a time, and its estimates for tiers it has not retrained since
still describe the old device. `on_profile_change` chooses: `keep` (the paper's rule, the
default), or `reset`, which forgets the client's estimates for every tier when the profile
named in its times differs from the one of its last absorbed times, so that the new
device's first observation is its own mean.

Profiles (`CutCost`, `hetfl.core.pricing`) come from HetFL's cost model: T^cp(m) the
client MACs of one batch (a ratio, so the client's rate cancels), T^sp(m) the server MACs
of one batch over the server rate. Communication is the client model down and back up plus
Ñ_k batches of activations and labels up, at the client's last observed link rates (the
paper's D_size(m) Ñ_k / ν_k, with the model's transfer amortised over the batches and the two
directions priced at their own rates). Ñ_k = samples trained / batch size, counted
fractionally, so that a short last batch is priced as what it is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

import torch

from hetfl.core.pricing import CutCost
from hetfl.core.spec import Spec
from hetfl.core.training import LocalTraining
from hetfl.core.types import ClientInfo, ClientTimes

#: What the scheduler takes as a client's client-side time in its tier.
Observed = Literal["elapsed-minus-comm", "compute"]
#: What becomes of a client's smoothed times when its device profile changes.
OnSwitch = Literal["keep", "reset"]
#: Where a client without a history goes: the default tier, or its device profile's tier.
NoHistory = Literal["default-tier", "profile"]
#: The EMA's span (the code's `ewm(span=2)`): weight 2 / (span + 1) on the newest value.
SPAN = 2


def ema(previous: float | None, value: float, span: int = SPAN) -> float:
    """pandas' `ewm(span, adjust=False).mean()` one value further: the first value is its
    own mean, then alpha = 2 / (span + 1) on each new one."""
    if previous is None:
        return value
    alpha = 2 / (span + 1)
    return alpha * value + (1 - alpha) * previous


def comm_s(cost: CutCost, batches: float, down_mbps: float, up_mbps: float) -> float:
    """Seconds to move a tier's round: its client model down, and the model and `batches`
    batches of activations and labels up, at Mbit/s (10^6 bits) rates."""
    up_bytes = cost.model_bytes + batches * cost.batch_bytes
    return cost.model_bytes * 8 / (down_mbps * 1e6) + up_bytes * 8 / (up_mbps * 1e6)


def estimate(
    costs: Mapping[int, CutCost],
    server_rate: float,
    tier: int,
    client_s: float,
    batches: float,
    down_mbps: float,
    up_mbps: float,
) -> dict[int, float]:
    """T̂_k(m) for every tier m of `costs` (Eq. 5), for a client whose smoothed client-side
    time in `tier` is `client_s` and which trains `batches` batches a round."""
    base = costs[tier].client_macs
    out = {}
    for m, cost in costs.items():
        client = cost.client_macs / base * client_s if base else 0.0
        server = cost.server_macs * batches / server_rate
        out[m] = comm_s(cost, batches, down_mbps, up_mbps) + max(client, server)
    return out


class PricedCuts(Mapping[int, CutCost]):
    """Each tier's profile, priced when first read (the start banner, the first schedule),
    not when the strategy is built: building a run to check it prices nothing."""

    def __init__(self, tiers: Sequence[int], price: Callable[[int], CutCost]) -> None:
        self.tiers, self.price = tuple(tiers), price
        self._priced: dict[int, CutCost] = {}

    def __getitem__(self, tier: int) -> CutCost:
        if tier not in self.tiers:
            raise KeyError(tier)
        if tier not in self._priced:
            self._priced[tier] = self.price(tier)
        return self._priced[tier]

    def __contains__(self, tier: object) -> bool:  # without pricing it
        return tier in self.tiers

    def __iter__(self) -> Iterator[int]:
        return iter(self.tiers)

    def __len__(self) -> int:
        return len(self.tiers)


def choose_tiers(estimates: Sequence[Mapping[int, float]]) -> tuple[float, list[int]]:
    """(T_max, each client's tier): T_max = max_k min_m T̂_k(m), and each client's largest
    m with T̂_k(m) <= T_max (never empty: its own minimum is at most T_max)."""
    t_max = max(min(e.values()) for e in estimates)
    return t_max, [max(m for m, t in e.items() if t <= t_max) for e in estimates]


class TierScheduler:
    """The assignment part of DTFL's strategy (`hetfl.core.server.assign.JointAssignment`): the
    round's clients' tiers, chosen together. It keeps each (client, tier)'s smoothed time
    and the round of each client's last absorbed times, as extra state."""

    def __init__(
        self,
        costs: Mapping[int, CutCost],
        server_rate: float,
        tier_spec: Callable[[int], Spec],
        tier_of: Callable[[Spec], int],
        eval_spec: Spec,
        train: LocalTraining,
        *,
        default_tier: int,
        observed: Observed = "elapsed-minus-comm",
        on_profile_change: OnSwitch = "keep",
        no_history: NoHistory = "default-tier",
    ) -> None:
        if default_tier not in costs:
            raise ValueError(f"default_tier {default_tier} is not one of the tiers {sorted(costs)}")
        self.costs, self.server_rate = costs, server_rate
        self.tier_spec, self.tier_of, self.eval_spec = tier_spec, tier_of, eval_spec
        self.train, self.default_tier, self.observed = train, default_tier, observed
        self.on_profile_change, self.no_history = on_profile_change, no_history
        self.smoothed: dict[tuple[int, int], float] = {}
        self.absorbed: dict[int, int] = {}
        self.profiles: dict[int, str] = {}  # the profile of each client's last absorbed times

    # -- the assignment protocol ---------------------------------------------------------
    def setup(self, clients: Sequence[ClientInfo]) -> None:
        """A run starts without histories (a resumed one then loads its extra state)."""
        self.smoothed, self.absorbed, self.profiles = {}, {}, {}

    def spec_of(self, info: ClientInfo) -> Spec:
        """Every client is judged by the aggregated full model."""
        return self.eval_spec

    def possible_specs(self) -> list[Spec]:
        return [self.tier_spec(m) for m in sorted(self.costs)]

    def spec_in_round(self, round: int, info: ClientInfo, rng: torch.Generator) -> Spec:
        return self.specs_in_round(round, [info], rng)[0]

    def specs_in_round(
        self, round: int, infos: Sequence[ClientInfo], rng: torch.Generator
    ) -> list[Spec]:
        return [self.tier_spec(m) for m in self.tiers(infos)]

    # -- the scheduler ------------------------------------------------------------------
    def batches(self, info: ClientInfo) -> float:
        """Ñ_k: the samples a round trains over the batch size (fractional)."""
        t = self.train
        samples = t.steps * t.batch_size if t.steps is not None else t.epochs * info.n_train
        return samples / t.batch_size

    def absorb(self, info: ClientInfo) -> None:
        """Add the client's last round's client-side time to its tier's EMA, once."""
        times = info.history
        if times is None or self.absorbed.get(info.cid) == times.round:
            return
        moved = self.profiles.get(info.cid, times.profile) != times.profile
        if moved and self.on_profile_change == "reset":
            self.smoothed = {k: t for k, t in self.smoothed.items() if k[0] != info.cid}
        tier = self.tier_of(times.spec)
        key = (info.cid, tier)
        self.smoothed[key] = ema(self.smoothed.get(key), self.client_side_s(info, times, tier))
        self.absorbed[info.cid] = times.round
        self.profiles[info.cid] = times.profile

    def client_side_s(self, info: ClientInfo, times: ClientTimes, tier: int) -> float:
        if self.observed == "compute":
            return times.compute_s
        elapsed = times.down_s + times.compute_s + times.up_s  # the client side's own time
        comm = comm_s(self.costs[tier], self.batches(info), times.down_mbps, times.up_mbps)
        return max(elapsed - comm, 0.0)

    def estimates(self, info: ClientInfo) -> dict[int, float] | None:
        """T̂_k(m) for every tier, or None for a client the scheduler cannot place (no
        history, and no device profile to read under `no_history="profile"`)."""
        times = info.history
        if times is None:
            return self.profiled(info)
        tier = self.tier_of(times.spec)
        client_s = self.smoothed[(info.cid, tier)]
        return estimate(
            self.costs,
            self.server_rate,
            tier,
            client_s,
            self.batches(info),
            times.down_mbps,
            times.up_mbps,
        )

    def profiled(self, info: ClientInfo) -> dict[int, float] | None:
        """T̂_k(m) of a client without a history from its device profile: the client side's
        time in tier m is exactly T^cp(m) Ñ_k / rate under the simulated clock."""
        device = info.device
        if self.no_history != "profile" or device is None:
            return None
        tier = max(self.costs)  # any tier: the estimate scales its time by the MAC ratio
        batches = self.batches(info)
        client_s = self.costs[tier].client_macs * batches / device.rate
        return estimate(
            self.costs,
            self.server_rate,
            tier,
            client_s,
            batches,
            device.down_mbps,
            device.up_mbps,
        )

    def tiers(self, infos: Sequence[ClientInfo]) -> list[int]:
        """The tier of each of `infos`, in their order."""
        for info in infos:
            self.absorb(info)
        found = {info.cid: e for info in infos if (e := self.estimates(info)) is not None}
        chosen: dict[int, int] = {}
        if found:
            _, tiers = choose_tiers(list(found.values()))
            chosen = dict(zip(found, tiers, strict=True))
        return [chosen.get(info.cid, self.default_tier) for info in infos]

    def extra_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "tier_smoothed": [[k, m, t] for (k, m), t in sorted(self.smoothed.items())],
            "tier_absorbed": sorted(self.absorbed.items()),
        }
        if self.on_profile_change != "keep":  # the paper's rule never reads them
            state["tier_profiles"] = sorted(self.profiles.items())
        return state

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        self.smoothed = {(int(k), int(m)): float(t) for k, m, t in state["tier_smoothed"]}
        self.absorbed = {int(k): int(r) for k, r in state["tier_absorbed"]}
        # absent under `keep`, and in checkpoints from before `on_profile_change`
        self.profiles = {int(k): str(p) for k, p in state.get("tier_profiles", [])}
