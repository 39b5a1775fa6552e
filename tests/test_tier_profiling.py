"""DTFL's first tier from a client's device profile (`no_history: profile`): the scheduler's
rule on profiled times by hand, the default tier kept where no profile is known, the option
validated and left out of the description at its default, and in a run the round-1 tiers
are the profiled choice and take exactly the profiled time."""

from __future__ import annotations

import json

import pytest
import torch

from hetfl.algorithms import ALGORITHMS
from hetfl.algorithms.parts.tier_scheduler import TierScheduler, estimate
from hetfl.core.client.program import Programs
from hetfl.core.pricing import CutCost
from hetfl.core.spec import Spec
from hetfl.core.training import LocalTraining
from hetfl.core.types import ClientData, ClientInfo, ClientTimes, DeviceRates
from hetfl.engine.round_settings import RoundSettings
from hetfl.models import make_family
from hetfl.sim import Simulation
from hetfl.systems.profiles import DeviceProfile, SystemSettings
from hetfl.systems.split_pricing import SplitPricer

#: Three tiers priced on a batch of 10; the server does 100 MAC/s; links of 1000 B/s.
COSTS = {
    1: CutCost(10, client_macs=100, server_macs=400, batch_bytes=1000, model_bytes=100),
    2: CutCost(10, client_macs=200, server_macs=300, batch_bytes=500, model_bytes=200),
    3: CutCost(10, client_macs=400, server_macs=100, batch_bytes=250, model_bytes=400),
}
MBPS = 0.008
TRAIN = LocalTraining(lr=0.1, batch_size=10)  # a client of 20 samples: 2 batches a round


def scheduler(no_history="profile", default_tier=1) -> TierScheduler:
    return TierScheduler(
        COSTS,
        100.0,
        lambda m: Spec(model="toy", tier=m),
        lambda s: s["tier"],
        Spec(model="toy"),
        TRAIN,
        default_tier=default_tier,
        no_history=no_history,
    )


def info(cid: int, rate: float | None, history: ClientTimes | None = None) -> ClientInfo:
    device = None if rate is None else DeviceRates("d", rate, MBPS, MBPS)
    return ClientInfo(cid, 20, (1,), (0, 1), history=history, device=device)


def test_a_profiled_client_gets_the_schedulers_tier_by_hand():
    # at 100 MAC/s: client 2 x MACs / 100 = 2, 4, 8 s; server 2 x MACs / 100 = 8, 6, 2 s;
    # communication 0.1 + 2.1, 0.2 + 1.2, 0.4 + 0.9 s -> T(m) = 10.2, 7.4, 9.3 (best 7.4)
    s = scheduler()
    assert s.profiled(info(0, 100.0)) == pytest.approx({1: 10.2, 2: 7.4, 3: 9.3})
    # at 1000 MAC/s: 0.2, 0.4, 0.8 s -> T(m) = 10.2, 7.4, 3.3 (best 3.3); T_max = 7.4
    assert s.tiers([info(0, 100.0), info(1, 1000.0)]) == [2, 3]
    # the default tier rule ignores the profile
    assert scheduler("default-tier").tiers([info(0, 100.0), info(1, 1000.0)]) == [1, 1]


def test_without_a_profile_the_default_tier_stays_and_histories_still_count():
    s = scheduler()
    assert s.profiled(info(0, None)) is None
    assert s.tiers([info(0, None), info(1, 1000.0)]) == [1, 3]
    # a client with a history (tier 2, 4.4 s on its side, 1.4 s of it communication: 3 s
    # of compute, T = 10.2, 7.4, 7.3) beside a profiled slow one (best 7.4): T_max 7.4
    up = 4.4
    seen = ClientTimes(
        1, Spec(model="toy", tier=2), "d", 0.0, 0.0, 0.0, up, up, True, 0, 0, 0, 0, MBPS, MBPS
    )
    assert s.tiers([info(0, 100.0), info(1, 1000.0, seen)]) == [2, 3]


def test_the_option_is_validated_and_described_only_when_set():
    dtfl = ALGORITHMS.get("dtfl")
    with pytest.raises(ValueError, match="no_history"):
        dtfl.options(no_history="scheduler")
    assert "no_history" in dtfl.options().paper_rule()
    assert "no_history" not in dtfl.options(no_history="profile").paper_rule()
    opts = dtfl.options(tiers=[2, 3, 4, 5, 6, 7], no_history="profile")
    assert opts.tiers == (2, 3, 4, 5, 6, 7) and opts.default_tier == 2
    with pytest.raises(ValueError, match="default_tier 2 is not one of tiers"):
        dtfl.options(tiers=[3, 4, 5, 6, 7])


SHAPE, CLASSES = (1, 8, 8), 4
FAMILY = make_family("resnet-cifar", SHAPE, CLASSES, blocks=1)
RUN_TRAIN = LocalTraining(lr=1e-3, batch_size=16, optimizer="amsgrad", weight_decay=5e-4)
SYSTEM = SystemSettings(
    (DeviceProfile("slow", 2e6, 1.0, 1.0), DeviceProfile("fast", 2e9, 50.0, 50.0)),
    assignment=("slow", "fast", "fast"),
    server_rate=5e8,
)


def test_in_a_run_round_1_takes_the_profiled_tiers_and_their_estimated_time(tmp_path):
    pricer = SplitPricer(FAMILY, SHAPE, SYSTEM.server_rate)
    dtfl = ALGORITHMS.get("dtfl")
    strategy, recipe = dtfl.build(
        FAMILY,
        {"tiers": [2, 3, 4, 5, 6, 7], "no_history": "profile", "observed": "compute"},
        clients_per_round=3,
        train=RUN_TRAIN,
        costs=pricer,
    )
    g = torch.Generator().manual_seed(0)
    clients = []
    for cid, n in enumerate((40, 24, 56)):
        x, y = torch.randn(n, *SHAPE, generator=g), torch.randint(0, CLASSES, (n,), generator=g)
        clients.append(ClientData(cid, x, y, x[:8], y[:8], CLASSES))
    test = (torch.randn(20, *SHAPE, generator=g), torch.randint(0, CLASSES, (20,), generator=g))
    settings = RoundSettings(rounds=1, seed=0, system=SYSTEM)
    sim = Simulation(strategy, Programs(FAMILY, recipe, seed=0), clients, test, settings, tmp_path)
    sim.run()
    rows = [json.loads(line) for line in (tmp_path / "clients.jsonl").read_text().splitlines()]
    tiers = {r["cid"]: r["fields"]["tier"] for r in rows if r["sampled"]}
    # the slow device on its 1 Mbit/s link is upload-bound: it takes the tier with the
    # smallest activations the profiled T_max allows; the fast ones train all of md1..md7
    assert tiers[1] == tiers[2] == 7 and tiers[0] < 7
    scheduler = sim.strategy.assignment
    for cid, profile in enumerate(SYSTEM.assignment):
        device = next(p for p in SYSTEM.profiles if p.name == profile)
        batches = clients[cid].n_train / 16
        guess = estimate(
            scheduler.costs,
            SYSTEM.server_rate,
            7,
            scheduler.costs[7].client_macs * batches / device.rate,
            batches,
            device.down_mbps,
            device.up_mbps,
        )
        # the profiled estimate of the chosen tier is the time the clock then gave
        assert guess[tiers[cid]] == pytest.approx(sim.infos[cid].history.total_s, rel=1e-9)
