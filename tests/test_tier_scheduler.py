"""DTFL's tier scheduler on hand-made profiles and histories: the EMA, Eq. (5)'s estimates,
the largest tier within T_max, the default tier, every tier reachable, a server-bound
client judged by its own side's time, and its extra state."""

from __future__ import annotations

import pytest
import torch

from hetfl.algorithms.parts.tier_scheduler import TierScheduler, choose_tiers, comm_s, ema, estimate
from hetfl.core.pricing import CutCost
from hetfl.core.spec import Spec
from hetfl.core.training import LocalTraining
from hetfl.core.types import ClientInfo, ClientTimes

#: Three tiers priced on a batch of 10 (more client MACs, less server work, smaller
#: activations as the tier grows); the server does 100 MAC/s.
COSTS = {
    1: CutCost(10, client_macs=100, server_macs=400, batch_bytes=1000, model_bytes=100),
    2: CutCost(10, client_macs=200, server_macs=300, batch_bytes=500, model_bytes=200),
    3: CutCost(10, client_macs=400, server_macs=100, batch_bytes=250, model_bytes=400),
}
SERVER_RATE = 100.0
MBPS = 0.008  # 1000 bytes per second
TRAIN = LocalTraining(lr=0.1, batch_size=10)  # one epoch: a client of 20 samples, 2 batches


def spec(tier: int) -> Spec:
    return Spec(model="toy", tier=tier)


def info(cid: int, history: ClientTimes | None = None, n: int = 20) -> ClientInfo:
    return ClientInfo(cid, n, (1,), (0, 1), history=history)


def times(rnd: int, tier: int, elapsed_s: float, *, compute_s=0.0, server_s=0.0, profile="p"):
    """A round in which the client side took `elapsed_s` (its compute, the rest uploads)
    and the server side `server_s` beside it: Eq. (5)'s total."""
    up_s = elapsed_s - compute_s
    return ClientTimes(
        round=rnd,
        spec=spec(tier),
        profile=profile,
        compute_s=compute_s,
        server_s=server_s,
        down_s=0.0,
        up_s=up_s,
        total_s=up_s + max(compute_s, server_s),
        parallel=True,
        macs=0,
        server_macs=0,
        bytes_down=0,
        bytes_up=0,
        down_mbps=MBPS,
        up_mbps=MBPS,
    )


def scheduler(
    costs=COSTS, observed="elapsed-minus-comm", default_tier=2, on_profile_change="keep"
) -> TierScheduler:
    return TierScheduler(
        costs,
        SERVER_RATE,
        spec,
        lambda s: s["tier"],
        Spec(model="toy"),
        TRAIN,
        default_tier=default_tier,
        observed=observed,
        on_profile_change=on_profile_change,
    )


def test_ema_of_span_two_puts_two_thirds_on_the_newest_value():
    # pandas' ewm(span=2, adjust=False) on [3, 6, 0, 9], by hand
    values = []
    smoothed = None
    for x in (3.0, 6.0, 0.0, 9.0):
        smoothed = ema(smoothed, x)
        values.append(smoothed)
    assert values == pytest.approx([3.0, 5.0, 5 / 3, 6 + 5 / 9])


def test_communication_is_the_model_both_ways_and_the_batches_up():
    # tier 1 over 2 batches: 100 B down; 100 B + 2 x 1000 B up; at 1000 B/s
    assert comm_s(COSTS[1], 2.0, MBPS, MBPS) == pytest.approx(0.1 + 2.1)
    assert comm_s(COSTS[3], 2.0, MBPS, 2 * MBPS) == pytest.approx(0.4 + 0.9 / 2)


def test_estimates_follow_eq_5_for_every_tier():
    # tier 2, smoothed client-side time 4 s: client times scale by MACs (2, 4, 8 s), the
    # server's are MACs x 2 batches / 100 (8, 6, 2 s), communication 2.2, 1.4, 1.3 s
    got = estimate(COSTS, SERVER_RATE, 2, 4.0, 2.0, MBPS, MBPS)
    assert got == pytest.approx({1: 2.2 + 8, 2: 1.4 + 6, 3: 1.3 + 8})


def test_each_client_gets_its_largest_tier_within_the_straggler_time():
    fast = {1: 5.0, 2: 6.0, 3: 7.5}
    slow = {1: 9.0, 2: 7.0, 3: 8.0}  # its best is tier 2: T_max = 7
    t_max, tiers = choose_tiers([fast, slow])
    assert t_max == 7.0 and tiers == [2, 2]
    t_max, tiers = choose_tiers([fast, {1: 9.0, 2: 7.5, 3: 8.0}])
    assert t_max == 7.5 and tiers == [3, 2]  # the fast client now fits tier 3


def test_histories_are_smoothed_per_tier_from_the_client_sides_time_minus_communication():
    s = scheduler()
    # round 1 in tier 2: 4.4 s on the client side, 1.4 s of it communication -> 3 s;
    # estimates 2.2 + max(1.5, 8), 1.4 + max(3, 6), 1.3 + max(6, 2): tier 3 is the fastest
    assert s.tiers([info(0, times(1, 2, 4.4))]) == [3]
    assert s.smoothed == {(0, 2): pytest.approx(3.0)}
    s.tiers([info(0, times(2, 2, 7.4))])  # 6 s client side: EMA 2/3 x 6 + 1/3 x 3
    assert s.smoothed == {(0, 2): pytest.approx(5.0)}
    s.tiers([info(0, times(2, 2, 7.4))])  # the same round's times are taken once
    assert s.smoothed == {(0, 2): pytest.approx(5.0)}


def test_a_client_without_history_gets_the_default_tier():
    s = scheduler()
    assert s.tiers([info(0), info(1)]) == [2, 2]
    assert scheduler(default_tier=3).tiers([info(0)]) == [3]
    with pytest.raises(ValueError, match="default_tier 5 is not one of the tiers"):
        scheduler(default_tier=5)


def test_every_tier_is_reachable():
    # no transfers and an instant server: T(m) = MACs(m) / speed; client k (speed k) fits
    # tier m while m <= k x the slowest client's tier-1 time, so client k gets tier k
    costs = {
        m: CutCost(10, client_macs=m, server_macs=0, batch_bytes=0, model_bytes=0)
        for m in range(1, 8)
    }
    s = scheduler(costs)
    infos = [info(k, times(1, 1, 1.0 / k)) for k in range(1, 8)]
    assert s.tiers(infos) == [1, 2, 3, 4, 5, 6, 7]


def test_a_server_bound_client_is_judged_by_its_own_side():
    # a fast client (0.5 s of compute and 1.4 s of transfers in tier 2) whose round was bound
    # by its server side (6 s, total 7.4 s by Eq. 5): its side's time tells its compute,
    # so it gets the most layers (tier 3: 1.3 + max(1, 2) s against 1.4 + max(0.5, 6) s).
    # Taking the 7.4 s total for its side would make it 6 s of compute and, in tier 3,
    # 1.3 + max(12, 2) s: a client in a low tier on a fast device would stay there.
    for observed in ("elapsed-minus-comm", "compute"):
        s = scheduler(observed=observed)
        assert s.tiers([info(0, times(1, 2, 1.9, compute_s=0.5, server_s=6.0))]) == [3]
        assert s.smoothed[(0, 2)] == pytest.approx(0.5)
    # the elapsed time minus the communication estimate; compute alone under "compute"
    late = times(1, 2, 2.4, compute_s=0.5, server_s=6.0)  # 0.5 s of uploads beyond 1.4
    assert scheduler().client_side_s(info(0), late, 2) == pytest.approx(1.0)
    assert scheduler(observed="compute").client_side_s(info(0), late, 2) == 0.5


@pytest.mark.parametrize("on_change", ["keep", "reset"])
def test_extra_state_round_trips_and_set_up_starts_afresh(on_change):
    s = scheduler(on_profile_change=on_change)
    s.tiers([info(0, times(1, 2, 4.4)), info(3, times(1, 1, 9.0))])
    kept = s.extra_state()
    again = scheduler(on_profile_change=on_change)
    again.load_extra_state(kept)
    assert again.smoothed == s.smoothed and again.absorbed == {0: 1, 3: 1}
    # the paper's rule keeps no profiles (its checkpoints are as before the option)
    assert again.profiles == ({} if on_change == "keep" else {0: "p", 3: "p"})
    again.setup([])
    assert again.smoothed == {} and again.absorbed == {} and again.profiles == {}


def _switching(s: TierScheduler) -> list[int]:
    """A client on a slow device (9 s of compute in tier 2, 4 s in tier 1), then moved to a
    device ten times faster (0.9 s in tier 2): its tier after each round."""
    return [
        s.tiers([info(0, times(1, 1, 4.0, compute_s=4.0, profile="slow"))])[0],
        s.tiers([info(0, times(2, 2, 9.0, compute_s=9.0, profile="slow"))])[0],
        s.tiers([info(0, times(3, 2, 0.9, compute_s=0.9, profile="fast"))])[0],
        s.tiers([info(0, times(4, 2, 0.9, compute_s=0.9, profile="fast"))])[0],
    ]


def test_a_switching_profile_is_smoothed_across_devices_by_default_and_forgotten_on_reset():
    # estimates from tier 2's time c (comm 2.2, 1.4, 1.3 s; server 8, 6, 2 s):
    # tier 1: 2.2 + max(c/2, 8), tier 2: 1.4 + max(c, 6), tier 3: 1.3 + max(2c, 2)
    keep = scheduler(observed="compute")
    # c = 9: 10.2, 10.4, 19.3 -> tier 1; after the switch the paper's EMA still mixes the
    # slow device: c = 2/3 0.9 + 1/3 9 = 3.6 -> 10.2, 7.4, 8.5 -> tier 2, a round late
    assert _switching(keep)[1:] == [1, 2, 3]
    assert keep.smoothed[(0, 1)] == 4.0  # the slow device's tier-1 time is kept
    reset = scheduler(observed="compute", on_profile_change="reset")
    # c = 0.9 from the first round on the fast device: 10.2, 7.4, 3.1 -> tier 3 at once
    assert _switching(reset)[1:] == [1, 3, 3]
    # the slow device's times are gone for every tier; on the same device the EMA goes on
    assert reset.smoothed == {(0, 2): pytest.approx(0.9)}
    assert reset.profiles == {0: "fast"}
    steady = scheduler(observed="compute", on_profile_change="reset")
    steady.tiers([info(0, times(1, 2, 3.0, compute_s=3.0))])
    steady.tiers([info(0, times(2, 2, 6.0, compute_s=6.0))])
    assert steady.smoothed == {(0, 2): pytest.approx(5.0)}


def test_the_assignment_protocol_gives_tier_specs_and_the_full_model_to_evaluate():
    s = scheduler()
    g = torch.Generator()
    assert s.possible_specs() == [spec(1), spec(2), spec(3)]
    assert s.specs_in_round(1, [info(0), info(1)], g) == [spec(2), spec(2)]
    assert s.spec_of(info(0)) == Spec(model="toy")
