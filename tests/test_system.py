"""System heterogeneity: the cost model, device profiles, the simulated clock, deadlines,
and their place in runs and reports, against hand computations."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from hetfl.core.spec import Spec, full_map
from hetfl.core.types import PassRecord
from hetfl.models import PlainFamily
from hetfl.sim.clock import Clock, Usage, transfer_s
from hetfl.sim.costs import MacCounter
from hetfl.sim.profiles import (
    DeviceProfile,
    ProfileSchedule,
    SystemConfig,
    SystemSettings,
    dtfl_cpu_profiles,
    dtfl_profiles,
)


# -- the cost model ---------------------------------------------------------------------------
class _TinyConv(nn.Module):
    """conv 1->c (3x3, padding 1) + ReLU | 2x2 max-pool | flatten + linear c*3*3 -> 4."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(1, c, 3, padding=1), nn.ReLU())
        self.pool = nn.MaxPool2d(2)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(c * 9, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(self.conv(x)))


class _TinyConvFamily:
    """Width w gives ceil(4 w) channels; inputs are 1x6x6."""

    def build(self, spec: Spec) -> nn.Module:
        return _TinyConv(math.ceil(4 * spec["width"]))

    def index_map(self, spec: Spec):
        return full_map(list(self.build(spec).state_dict()))

    def global_spec(self, specs):
        return Spec(width=1.0)

    def modules(self, spec: Spec) -> list[str]:
        return ["conv", "pool", "head"]


class _Whole(_TinyConvFamily):
    """The same models from a family that does not name its modules."""

    modules = None  # type: ignore[assignment]


@pytest.mark.parametrize("width, channels", [(1.0, 4), (0.5, 2)])
def test_macs_per_module_and_width_match_hand_computation(width, channels):
    counter, b = MacCounter(_TinyConvFamily()), 5
    spec = Spec(width=width)
    fwd = counter.pass_cost(PassRecord(spec, "forward", b, 1), (1, 6, 6))
    conv = b * channels * 36 * 9  # output elements x (in channels x 3 x 3)
    head = b * (channels * 9) * 4
    assert fwd.modules == ("conv", "pool", "head")
    assert fwd.module_macs == (conv, 0, head) and fwd.total == conv + head
    train = counter.pass_cost(PassRecord(spec, "train", b, 1), (1, 6, 6))
    # backward: the first conv needs only its weight gradient (the input has none);
    # the linear layer needs the gradients of its weight and of its input
    assert train.module_macs == (2 * conv, 0, 3 * head)
    assert train.total == 2 * conv + 3 * head
    assert counter.price([PassRecord(spec, "train", b, 3)], (1, 6, 6)) == 3 * train.total


@pytest.mark.parametrize("width, channels", [(1.0, 4), (0.5, 2)])
def test_activation_bytes_and_macs_at_each_split_point(width, channels):
    cost = MacCounter(_TinyConvFamily()).pass_cost(
        PassRecord(Spec(width=width), "train", 5, 1), (1, 6, 6)
    )
    conv, head = 2 * 5 * channels * 36 * 9, 3 * 5 * channels * 9 * 4
    # after conv: 5 x c x 6 x 6 float32; after pool: 5 x c x 3 x 3 float32
    assert cost.activation_bytes(1) == 5 * channels * 36 * 4
    assert cost.activation_bytes(2) == 5 * channels * 9 * 4
    assert cost.split_macs(1) == (conv, head)
    assert cost.split_macs(2) == (conv, head)
    for bad in (0, 3):
        with pytest.raises(ValueError, match="allowed: 1..2"):
            cost.split_macs(bad)


def test_family_without_modules_is_priced_whole():
    record = PassRecord(Spec(width=1.0), "train", 5, 1)
    whole = MacCounter(_Whole()).pass_cost(record, (1, 6, 6))
    assert whole.total == MacCounter(_TinyConvFamily()).pass_macs(record, (1, 6, 6))
    assert whole.modules == ()
    with pytest.raises(ValueError, match="does not name its modules"):
        whole.split_macs(1)


def test_plain_family_modules_are_its_pipeline_and_sum_to_the_total():
    family = PlainFamily("small-cnn", (1, 8, 8), 10)
    spec = family.global_spec([])
    assert family.modules(spec) == ["features", "head"]
    cost = MacCounter(family).pass_cost(PassRecord(spec, "train", 4, 1), (1, 8, 8))
    assert sum(cost.module_macs) == cost.total
    # the head sees the flattened 32 x 2 x 2 features of 4 samples
    assert cost.activation_bytes(1) == 4 * 32 * 2 * 2 * 4


# -- device profiles --------------------------------------------------------------------------
def test_dtfl_presets():
    slow = dtfl_profiles(1e10)
    assert [p.rate for p in slow] == pytest.approx([1e10 * 16 / s for s in (16, 20, 34, 130, 250)])
    cpus = dtfl_cpu_profiles(8e9)
    assert [p.rate for p in cpus] == pytest.approx([8e9 * c / 4 for c in (4, 2, 1, 0.2, 0.1)])
    for profiles in (slow, cpus):
        assert [p.down_mbps for p in profiles] == [100, 30, 30, 30, 10]
        assert [p.up_mbps for p in profiles] == [100, 30, 30, 30, 10]
    settings = SystemConfig(preset="dtfl").settings()
    assert settings is not None and settings.profiles[0].rate == 1e10
    counts = _counts(ProfileSchedule(settings, 0, range(20)).indices(1), 5)
    assert counts == [4, 4, 4, 4, 4]  # 20 % each at the start


def _counts(indices, n):
    return [indices.count(i) for i in range(n)]


def _profiles(n: int) -> tuple[DeviceProfile, ...]:
    return tuple(DeviceProfile(f"p{i}", 1e9 * (i + 1), 10.0, 10.0) for i in range(n))


def test_fractions_round_by_largest_remainder_and_lists_assign_by_client():
    settings = SystemSettings(_profiles(3), fractions=(0.5, 0.3, 0.2))
    # 7 clients: 3.5, 2.1, 1.4 -> floors 3, 2, 1 and the largest remainder (0.5) gets one
    assert _counts(ProfileSchedule(settings, 0, range(7)).indices(1), 3) == [4, 2, 1]
    listed = SystemSettings(_profiles(3), assignment=("p2", "p0", "p0"))
    assert ProfileSchedule(listed, 0, [5, 3, 9]).at(1) == {
        3: listed.profiles[2],
        5: listed.profiles[0],
        9: listed.profiles[0],
    }
    with pytest.raises(ValueError, match="lists 3 profiles for 2 clients"):
        ProfileSchedule(listed, 0, [0, 1])


def test_profile_switch_at_configured_rounds_for_configured_fraction_reproducibly():
    settings = SystemSettings(_profiles(5), switch_every=3, switch_fraction=0.3)
    schedule = ProfileSchedule(settings, seed=7, cids=range(20))
    by_round = {r: schedule.indices(r) for r in range(1, 11)}
    for r in range(2, 11):
        changed = sum(a != b for a, b in zip(by_round[r - 1], by_round[r], strict=True))
        # switches before rounds 4, 7, 10 (after every 3 rounds), 30 % of 20 = 6 clients
        assert changed == (6 if r in (4, 7, 10) else 0), r
    again = ProfileSchedule(settings, seed=7, cids=range(20))
    assert again.indices(10) == by_round[10]  # straight to round 10: same as step by step
    assert again.indices(4) == by_round[4]  # and back
    other = ProfileSchedule(settings, seed=8, cids=range(20))
    assert other.indices(4) != by_round[4]


# -- the clock --------------------------------------------------------------------------------
def _clock(**kw) -> Clock:
    return Clock(SystemSettings(_profiles(2), server_rate=4e9, **kw))


def test_client_time_is_transfers_plus_compute_and_parallel_sides_take_the_max():
    clock, fast = _clock(), _profiles(1)[0]  # 1e9 MAC/s, 10 Mbit/s both ways
    usage = Usage(macs=3_000_000_000, bytes_down=2_500_000, bytes_up=1_250_000)
    t = clock.client_times(1, Spec(), fast, usage)
    # down: 2.5 MB * 8 / 10 Mbit/s = 2 s; up: 1 s; compute 3e9 / 1e9 = 3 s
    assert (t.down_s, t.up_s, t.compute_s, t.server_s) == (2.0, 1.0, 3.0, 0.0)
    assert t.total_s == 6.0 and t.comm_s == 3.0 and t.profile == "p0"
    server = Usage(3_000_000_000, 2_500_000, 1_250_000, server_macs=20_000_000_000)
    waits = clock.client_times(1, Spec(), fast, server)  # the server side: 2e10 / 4e9 = 5 s
    assert waits.server_s == 5.0 and waits.total_s == 3 + 3 + 5  # SplitFed: sides add up
    overlap = Usage(3_000_000_000, 2_500_000, 1_250_000, server_macs=20_000_000_000, parallel=True)
    assert clock.client_times(1, Spec(), fast, overlap).total_s == 3 + max(3, 5)  # DTFL, Eq. 5
    fast_server = Usage(3_000_000_000, 2_500_000, 1_250_000, server_macs=4_000_000_000, parallel=True)
    assert clock.client_times(1, Spec(), fast, fast_server).total_s == 3 + max(3, 1)
    assert transfer_s(1_000_000, 8.0) == 1.0


def test_round_time_is_the_slowest_capped_by_the_deadline():
    profiles = _profiles(2)
    times = [
        _clock().client_times(1, Spec(), profiles[0], Usage(m, 0, 0)) for m in (10**9, 4 * 10**9)
    ]
    assert _clock().round_time(times) == 4.0
    assert _clock().round_time([]) == 0.0
    late = _clock(deadline_s=2.5)
    assert [late.missed_deadline(t) for t in times] == [False, True]
    assert late.round_time(times) == 2.5


def test_measured_clock_scales_wall_time_by_the_profile_slowdown():
    clock = Clock(SystemSettings(_profiles(1), clock="measured", cpu_rate=2e9, server_rate=8e9))
    usage = Usage(macs=1, bytes_down=0, bytes_up=0, wall_s=3.0, server_wall_s=1.0)
    t = clock.client_times(1, Spec(), _profiles(1)[0], usage)
    # client part 2 s on a 2e9 machine, the profile runs 1e9: x2; server 1 s x 2e9/8e9
    assert (t.compute_s, t.server_s) == (4.0, 0.25)
    assert not clock.settings.reproducible


# -- bad settings -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: DeviceProfile("a", -1.0, 10, 10), "rate must be a positive finite number"),
        (lambda: DeviceProfile("a", 1e9, 0, 10), "down_mbps must be a positive"),
        (lambda: DeviceProfile("a", 1e9, 1, 1, availability=0), r"availability must be in \(0, 1\]"),
        (lambda: SystemSettings(_profiles(2), fractions=(0.5, 0.4)), "must sum to 1"),
        (lambda: SystemSettings(_profiles(2), fractions=(1.0,)), "1 values for 2 profiles"),
        (lambda: SystemSettings(_profiles(2), assignment=("p0", "x")), r"unknown profiles \['x'\]"),
        (lambda: SystemSettings(_profiles(1), switch_every=5), "at least two profiles"),
        (lambda: SystemSettings((*_profiles(1), *_profiles(1))), "repeated"),
        (lambda: SystemSettings(_profiles(1), deadline_s=0), "deadline_s must be a positive"),
    ],
)
def test_bad_system_settings_fail_clearly(make, message):
    with pytest.raises(ValueError, match=message):
        make()
