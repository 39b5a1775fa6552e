"""System heterogeneity: the cost model, device profiles, the simulated clock, deadlines,
and their place in runs and reports, against hand computations."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from hetfl.cli import main
from hetfl.core.client.program import Programs
from hetfl.core.client.recipe import LocalRecipe
from hetfl.core.rng import torch_generator
from hetfl.core.spec import Spec, full_map
from hetfl.core.state import state_bytes
from hetfl.core.training import LocalTraining
from hetfl.core.types import PassRecord, Problem
from hetfl.data import PARTITIONERS, build_clients, global_test, load_synthetic
from hetfl.engine.outputs import read_metrics
from hetfl.engine.round_settings import RoundSettings
from hetfl.models import ARCHITECTURES, PlainFamily, make_family
from hetfl.sim import Simulation
from hetfl.systems.clock import Clock, Usage, transfer_s
from hetfl.systems.costs import MacCounter
from hetfl.systems.profiles import (
    DeviceProfile,
    ProfileSchedule,
    SystemConfig,
    SystemSettings,
    dtfl_cpu_profiles,
    dtfl_profiles,
)
from hetfl.systems.traces import Behaviour
from strategies import fedavg


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
    through = counter.pass_cost(PassRecord(spec, "train+input", b, 1), (1, 6, 6))
    assert through.module_macs == (3 * conv, 0, 3 * head)  # + the input's gradient
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
        with pytest.raises(ValueError, match=r"allowed: 1\.\.2"):
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


@pytest.mark.parametrize("name", ARCHITECTURES.names())
def test_every_scalable_family_splits_into_modules_that_carry_all_its_macs(name):
    # a language model's sample is a context of tokens, an image model's an image
    # (the detector halves its input six times; BatchNorm needs a 2x2 map at batch 1)
    shape = (16,) if name.startswith("transformer") else (3, 32, 32)
    shape = (3, 128, 128) if name.startswith("ssd") else shape
    family = make_family(name, shape, 10)
    cost = MacCounter(family).pass_cost(PassRecord(family.global_spec([]), "train", 1, 1), shape)
    assert len(cost.modules) >= 2
    # every product runs inside some module, so any split point prices the whole model
    assert sum(cost.module_macs) == cost.total
    assert sum(cost.split_macs(1)) == cost.total


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


def test_custom_profiles_take_a_rate_or_cpus_times_the_cpu_rate():
    config = SystemConfig(
        profiles=[
            {"name": "phone", "rate": 2e9, "down_mbps": 20, "up_mbps": 5, "availability": 0.8},
            {"name": "laptop", "cpus": 4, "down_mbps": 100, "up_mbps": 40},
        ],
        cpu_rate=3e9,
        fractions=[0.75, 0.25],
    )
    settings = config.settings()
    assert settings is not None
    assert settings.profiles == (
        DeviceProfile("phone", 2e9, 20, 5, 0.8),
        DeviceProfile("laptop", 12e9, 100, 40, 1.0),
    )
    assert _counts(ProfileSchedule(settings, 0, range(8)).indices(1), 2) == [6, 2]


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
    fast_server = Usage(
        3_000_000_000, 2_500_000, 1_250_000, server_macs=4_000_000_000, parallel=True
    )
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
    assert late.deadline_problem(times[0]) is None
    assert late.deadline_problem(times[1]) == Problem(
        "deadline", "missed the deadline: 4 s > 2.5 s"
    )
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
        (
            lambda: DeviceProfile("a", 1e9, 1, 1, availability=0),
            r"availability must be in \(0, 1\]",
        ),
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


# -- runs with profiles -----------------------------------------------------------------------
TRAIN = LocalTraining(lr=0.1, epochs=1, batch_size=16)
# the MLP on 1x8x8 inputs: linear 64->200, 200->200, 200->10; a training sample costs the
# forward, every weight gradient, and the input gradients of the two deeper layers
MLP_TRAIN_MACS = 3 * (64 * 200 + 200 * 200 + 200 * 10) - 64 * 200


def _sim(fed, tmp_path, system, *, rounds=1, cpr=8, strategy=None, **settings):
    family, clients, test = fed
    strategy = strategy or fedavg(family, clients_per_round=cpr, train=TRAIN)
    return Simulation(
        strategy,
        Programs(family, seed=0),
        clients,
        test,
        RoundSettings(rounds=rounds, seed=0, system=system, **settings),
        tmp_path,
    )


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def test_deadline_drops_exactly_the_clients_over_it(synthetic_federation, tmp_path):
    family, clients, _ = synthetic_federation
    # client k alone on a profile of (k + 1) * 1e7 MAC/s and 100 Mbit/s both ways
    profiles = tuple(DeviceProfile(f"p{k}", (k + 1) * 1e7, 100.0, 100.0) for k in range(8))
    model_bytes = state_bytes(family.build(family.global_spec([])).state_dict())
    expected = {
        c.cid: c.n_train * MLP_TRAIN_MACS / ((c.cid + 1) * 1e7) + 2 * model_bytes * 8 / 1e8
        for c in clients
    }
    deadline = 0.4
    assert all(abs(t - deadline) > 0.01 for t in expected.values())  # no borderline client
    system = SystemSettings(profiles, assignment=tuple(p.name for p in profiles), deadline_s=0.4)
    sim = _sim(synthetic_federation, tmp_path, system)
    sim.run()
    late = {cid for cid, t in expected.items() if t > deadline}
    assert 0 < len(late) < 8
    row = _rows(tmp_path)[0]
    assert row["failed"] == len(late) and row["clients"] == 8 - len(late)
    assert set(sim.store) == set(expected) - late  # dropped clients keep no new state
    for cid, t in expected.items():
        assert sim.infos[cid].history.total_s == pytest.approx(t)
    assert row["sim_time_s"] == deadline  # someone was late: the server waited until then
    assert row["macs"] == MLP_TRAIN_MACS * sum(c.n_train for c in clients)  # work was done


class _Recorder:
    """A sampler: the clients that were fastest last round (unknown ones first); records
    what `plan` was offered."""

    def __init__(self, clients_per_round):
        self.clients_per_round = clients_per_round
        self.offered: list[set[int]] = []
        self.seen_times: list[dict[int, float]] = []

    def setup(self, clients):
        return None

    def sample(self, round, available, rng):
        self.offered.append({c.cid for c in available})
        known = {c.cid: c.history.total_s for c in available if c.history is not None}
        self.seen_times.append(known)
        ranked = sorted(available, key=lambda c: (c.cid in known, known.get(c.cid, 0.0), c.cid))
        return sorted(ranked[: self.clients_per_round], key=lambda c: c.cid)


def test_unavailable_clients_are_never_planned(synthetic_federation, tmp_path):
    family = synthetic_federation[0]
    profiles = (DeviceProfile("on", 1e9, 10, 10), DeviceProfile("flaky", 1e9, 10, 10, 0.3))
    system = SystemSettings(profiles, assignment=("on", "flaky") * 4)
    strategy = fedavg(family, clients_per_round=8, train=TRAIN, sampler=_Recorder(8))
    sim = _sim(synthetic_federation, tmp_path, system, rounds=5, strategy=strategy)
    sim.run()
    for rnd, offered in enumerate(strategy.sampler.offered, start=1):
        draws = {
            c: float(torch.rand(1, generator=torch_generator(0, rnd, c, "availability")))
            for c in range(8)
        }
        # always-on clients are always offered, the flaky ones when their draw is below 0.3
        assert offered == {c for c in range(8) if c % 2 == 0 or draws[c] < 0.3}
    assert any(len(o) < 8 for o in strategy.sampler.offered)
    rows = _rows(tmp_path)
    assert [r["clients"] for r in rows] == [len(o) for o in strategy.sampler.offered]


def test_sim_times_reach_the_next_plan_and_rounds_add_up(synthetic_federation, tmp_path):
    family = synthetic_federation[0]
    system = SystemSettings(dtfl_profiles(1e8), switch_every=1, switch_fraction=0.5)
    strategy = fedavg(family, clients_per_round=4, train=TRAIN, sampler=_Recorder(4))
    sim = _sim(synthetic_federation, tmp_path, system, rounds=3, cpr=4, strategy=strategy)
    summary = sim.run()
    assert strategy.sampler.seen_times[0] == {}  # nothing measured before round 1
    assert sorted(strategy.sampler.seen_times[1]) == [0, 1, 2, 3]  # round 1's clients
    rows = _rows(tmp_path)
    per_round = [rows[0]["sim_time_s"]] + [
        b["sim_time_s"] - a["sim_time_s"] for a, b in itertools.pairwise(rows)
    ]
    assert per_round[0] == pytest.approx(max(strategy.sampler.seen_times[1].values()))
    assert all(t > 0 for t in per_round)
    assert summary["sim_clock"] == {"mode": "simulated", "reproducible": True}


class _InfoRecorder:
    """A tracker that records, per client, the `ClientInfo` attrs and history its local
    training was given (in itself: a test's recorder, not a part a method would keep state
    in)."""

    def __init__(self) -> None:
        self.attrs: dict[int, list[dict]] = {}
        self.history: dict[int, list] = {}

    def after_step(self, ctx):
        return None

    def finish(self, ctx):
        self.attrs.setdefault(ctx.task.cid, []).append(dict(ctx.info.attrs))
        self.history.setdefault(ctx.task.cid, []).append(ctx.info.history)
        return {}


def test_parts_see_the_declared_attrs_and_last_rounds_sim_times(tmp_path):
    ds = load_synthetic(n_train=60, n_test=10, num_classes=3, shape=(4,), seed=0)
    parts = PARTITIONERS.get("iid")(ds.y_train, 3, np.random.default_rng(0))
    clients = build_clients(ds, parts, test_per_client=0, seed=0)
    family = PlainFamily("linear", ds.input_shape, ds.num_classes)
    strategy = fedavg(family, clients_per_round=3, train=TRAIN, sampler=_Recorder(3))
    hooks = _InfoRecorder()
    declared = {c.cid: {"tier": c.cid % 2} for c in clients}
    settings = RoundSettings(
        rounds=2, seed=0, local_eval="none", system=SystemSettings(dtfl_profiles(1e8))
    )
    programs = Programs(family, LocalRecipe(trackers=(hooks,)), seed=0)
    test = global_test(ds, "cpu")
    sim = Simulation(strategy, programs, clients, test, settings, tmp_path, attrs=declared)
    sim.run()
    for cid, (first, second) in hooks.attrs.items():
        assert first == second == declared[cid]  # what the client declared, in every round
        before, after = hooks.history[cid]
        assert before is None  # round 1: nothing measured
        assert after.round == 1  # round 2: the times of round 1, as plan saw them
        assert after.total_s == strategy.sampler.seen_times[1][cid]
    assert sorted(hooks.attrs) == [c.cid for c in clients]


def _whole_and_resumed(make, tmp_path, rounds):
    """An uninterrupted run and one stopped halfway and resumed, checked equal: states,
    histories, metrics rows (but wall time) and per-client traces; returns (whole,
    resumed, rows, trace)."""
    whole = make(tmp_path / "whole", rounds)
    whole.run()
    make(tmp_path / "part", rounds // 2).run()
    resumed = make(tmp_path / "part", rounds)
    resumed.run(resume=True)
    for k, v in whole.state.items():
        assert torch.equal(v, resumed.state[k]), k
    assert whole.history == resumed.history
    strip = [{k: v for k, v in r.items() if k != "wall_time_s"} for r in _rows(tmp_path / "whole")]
    assert strip == [
        {k: v for k, v in r.items() if k != "wall_time_s"} for r in _rows(tmp_path / "part")
    ]
    trace = read_metrics(tmp_path / "whole" / "clients.jsonl")
    assert trace == read_metrics(tmp_path / "part" / "clients.jsonl")
    return whole, resumed, strip, trace


def test_resume_with_profiles_equals_an_uninterrupted_run(synthetic_federation, tmp_path):
    family = synthetic_federation[0]
    system = SystemSettings(
        dtfl_cpu_profiles(2e8), switch_every=1, switch_fraction=0.5, deadline_s=1.0
    )

    def make(path, rounds):
        strategy = fedavg(family, clients_per_round=4, train=TRAIN, sampler=_Recorder(4))
        return _sim(synthetic_federation, path, system, rounds=rounds, cpr=4, strategy=strategy)

    whole, resumed, strip, trace = _whole_and_resumed(make, tmp_path, 4)
    # the plans saw the same times; the per-client trace has deadline failures
    assert resumed.strategy.sampler.seen_times == whole.strategy.sampler.seen_times[2:]
    assert {r["failure"] for r in trace} == {None, "deadline"}
    assert all(r["sim"]["total_s"] > 0 for r in trace if r["sampled"])
    assert any(r["failed"] for r in strip)  # the deadline bit at least once


def test_measured_clock_is_labelled_not_reproducible(synthetic_federation, tmp_path):
    system = SystemSettings(dtfl_profiles(), clock="measured")
    summary = _sim(synthetic_federation, tmp_path, system).run()
    assert summary["sim_clock"] == {"mode": "measured", "reproducible": False}
    assert summary["final"]["sim_time_s"] > 0


# -- configs, reports -------------------------------------------------------------------------
CONFIG = """
name: t
seed: 0
algorithm: fedavg
data:
  dataset: digits
  num_clients: 6
  partition: {kind: iid}
  test_per_client: 20
model: {name: mlp}
train: {rounds: 2, clients_per_round: 3, batch_size: 32, lr: 0.1}
targets: [{metric: global_acc, value: 0.05}, {metric: global_acc, value: 1.01}]
system: {preset: dtfl-cpus, fastest_rate: 1.0e9}
"""


def test_a_configured_run_reports_time_bytes_and_macs_to_target(tmp_path, capsys):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(CONFIG + f"output_dir: {tmp_path / 'runs'}\n")
    assert main(["run", str(cfg)]) == 0
    banner = capsys.readouterr().err
    assert "devices: 5 profiles (cpus-4, cpus-2, cpus-1, cpus-0.2, cpus-0.1)" in banner
    run = tmp_path / "runs" / "t"
    rows = _rows(run)
    assert all(r["sim_time_s"] > 0 for r in rows)
    summary = json.loads((run / "summary.json").read_text())
    hit, missed = summary["targets"]
    assert hit["round"] == 1  # any accuracy reaches 5 %
    assert hit["sim_time_s"] == rows[0]["sim_time_s"] and hit["macs"] == rows[0]["macs"]
    assert hit["bytes"] == rows[0]["bytes_down"] + rows[0]["bytes_up"]
    assert missed["round"] is None and missed["sim_time_s"] is None
    assert (run / "plots" / "accuracy_vs_sim_time.png").exists()
    assert main(["compare", str(run)]) == 0
    table = capsys.readouterr().out
    assert f"{hit['sim_time_s']:.1f} ± 0.0" in table and "sim s to global_acc>=0.05" in table
    assert "GMAC to global_acc>=0.05" in table


@pytest.mark.parametrize(
    "system, message",
    [
        ({"profiles": [{"name": "a", "rate": -1, "down_mbps": 1, "up_mbps": 1}]},
         ["system.profiles.0.rate", "greater than 0", "-1"]),
        ({"preset": "dtfl", "fractions": [0.5, 0.2, 0.2, 0.05, 0.0]},
         ["system.fractions", "must sum to 1", "0.95"]),
        ({"preset": "dtfl", "fractions": [0.5, 0.5]}, ["2 values for 5 profiles"]),
        ({"preset": "dtf"}, ["system.preset", "unknown preset 'dtf'", "dtfl-cpus"]),
        ({"deadline_s": 3}, ["deadline_s set without device profiles", "system.preset"]),
        ({"profiles": [{"name": "a", "down_mbps": 1, "up_mbps": 1}]}, ["exactly one of rate"]),
        ({"preset": "dtfl", "sped": 1}, ["system.sped", "unknown key"]),
        ({"clock": "measured"}, ["clock set without device profiles"]),
        ({"overcommit": 1.3}, ["overcommit set without device profiles", "system.trace"]),
        ({"trace": {"capacity": "nope.csv"}}, ["trace file 'nope.csv' not found"]),
        ({"preset": "dtfl", "overcommit": 0.9}, ["system.overcommit", "greater than or equal"]),
    ],
)  # fmt: skip
def test_bad_profile_configs_fail_with_clear_errors(tmp_path, capsys, system, message):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(CONFIG.replace("system: {preset: dtfl-cpus, fastest_rate: 1.0e9}\n", ""))
    overrides = [f"system.{k}={json.dumps(v)}" for k, v in system.items()]
    assert main(["run", str(cfg), *overrides, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for part in message:
        assert part in err, (part, err)


def test_resolved_configs_without_profiles_validate_again():
    """`config.yaml` lists every key at its value; resuming validates it again."""
    from hetfl.config import validate

    resolved = validate({}).model_dump(mode="json")
    assert resolved["system"]["preset"] is None
    assert validate(resolved).system.settings() is None


def _fake(path: Path, seed: int, times: list[float], macs: list[int]) -> None:
    path.mkdir(parents=True)
    rows = [
        {"round": i + 1, "global_acc": 0.5 + 0.1 * i, "local_acc": None, "sim_time_s": t,
         "bytes_down": 10**6, "bytes_up": 0, "macs": m}
        for i, (t, m) in enumerate(zip(times, macs, strict=True))
    ]  # fmt: skip
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    hit = {"metric": "global_acc", "value": 0.6, "round": 2, "sim_time_s": times[1],
           "bytes": 10**6, "macs": macs[1]}  # fmt: skip
    summary = {"seed": seed, "rounds_completed": 2, "final": rows[-1], "best": {}, "targets": [hit]}
    (path / "summary.json").write_text(json.dumps(summary))


def test_compare_shows_time_and_macs_to_target_and_plot_draws_against_time(tmp_path, capsys):
    _fake(tmp_path / "dtfl-s0", 0, [10.0, 30.0], [10**9, 2 * 10**9])
    _fake(tmp_path / "dtfl-s1", 1, [20.0, 50.0], [10**9, 4 * 10**9])
    assert main(["compare", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    # time to target 30 and 50 s: mean 40, sample sd sqrt((100 + 100) / 1) = 14.1
    assert "40.0 ± 14.1" in out
    # MACs to target 2 and 4 GMAC: mean 3, sd 1.41
    assert "3.00 ± 1.41" in out
    png = tmp_path / "t.png"
    assert main(["plot", str(tmp_path), "-o", str(png), "--x", "sim_time"]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_plot_against_time_without_profiles_is_a_clear_error(tmp_path, capsys):
    _fake(tmp_path / "a-s0", 0, [1.0, 2.0], [1, 2])
    rows = (
        (tmp_path / "a-s0" / "metrics.jsonl")
        .read_text()
        .replace('"sim_time_s": 1.0', '"sim_time_s": null')
    )
    (tmp_path / "a-s0" / "metrics.jsonl").write_text(
        rows.replace('"sim_time_s": 2.0', '"sim_time_s": null')
    )
    assert main(["plot", str(tmp_path), "-o", str(tmp_path / "x.png"), "--x", "sim_time"]) == 2
    assert "no simulated time" in capsys.readouterr().err


# -- behaviour traces and over-commitment (issue 52 item 2) ---------------------------------
ALWAYS = Behaviour((0.0,), (1e9,), 1e9)


def test_a_client_whose_device_leaves_mid_round_is_lost_and_then_not_offered(
    synthetic_federation, tmp_path
):
    family = synthetic_federation[0]
    profiles = (DeviceProfile("on", 1e9, 10, 10), DeviceProfile("leaves", 1e9, 10, 10))
    # "leaves" is reachable for the first microsecond only: at round 1's start, not after
    behaviours = {"on": ALWAYS, "leaves": Behaviour((0.0,), (1e-6,), 1e9)}
    system = SystemSettings(profiles, assignment=("on", "leaves") * 4, behaviours=behaviours)
    strategy = fedavg(family, clients_per_round=8, train=TRAIN, sampler=_Recorder(8))
    sim = _sim(synthetic_federation, tmp_path, system, rounds=2, strategy=strategy)
    sim.run()
    assert strategy.sampler.offered == [set(range(8)), {0, 2, 4, 6}]
    first = [r for r in read_metrics(tmp_path / "clients.jsonl") if r["round"] == 1]
    assert {r["cid"]: r["failure"] for r in first} == {
        c: None if c % 2 == 0 else "lost" for c in range(8)
    }
    rows = _rows(tmp_path)
    assert rows[0]["failed"] == 4 and rows[0]["clients"] == 4
    # the round waited for the clients that stayed, not for those that left
    stayed = [r["sim"]["total_s"] for r in first if r["failure"] is None]
    assert rows[0]["sim_time_s"] == pytest.approx(max(stayed))
    assert set(sim.store) == {0, 2, 4, 6}  # a lost client keeps no new state
    assert all(sim.infos[c].history is None for c in (1, 3, 5, 7))  # and reports no times


def test_when_no_device_is_reachable_the_clock_waits_for_the_first(synthetic_federation, tmp_path):
    profiles = (DeviceProfile("late", 1e9, 10, 10), DeviceProfile("later", 1e9, 10, 10))
    behaviours = {"late": Behaviour((5.0,), (1e9,), 1e9), "later": Behaviour((7.0,), (1e9,), 1e9)}
    system = SystemSettings(profiles, assignment=("late", "later") * 4, behaviours=behaviours)
    family = synthetic_federation[0]
    strategy = fedavg(family, clients_per_round=8, train=TRAIN, sampler=_Recorder(8))
    _sim(synthetic_federation, tmp_path, system, strategy=strategy).run()
    assert strategy.sampler.offered == [{0, 2, 4, 6}]  # at 5 s, the "late" devices only
    first = read_metrics(tmp_path / "clients.jsonl")
    slowest = max(r["sim"]["total_s"] for r in first if r["sampled"])
    assert _rows(tmp_path)[0]["sim_time_s"] == pytest.approx(5.0 + slowest)


def test_over_commitment_keeps_the_first_k_to_finish(synthetic_federation, tmp_path):
    family = synthetic_federation[0]
    profiles = tuple(DeviceProfile(f"p{k}", (k + 1) * 1e7, 100.0, 100.0) for k in range(8))
    system = SystemSettings(
        profiles, assignment=tuple(p.name for p in profiles), overcommit=1.5, keep_first=4
    )
    assert system.committed(4, 8) == 6 and system.committed(4, 5) == 5
    assert SystemSettings(profiles, overcommit=1.3).committed(10, 100) == 13  # not 14
    strategy = fedavg(family, clients_per_round=6, train=TRAIN, sampler=_Recorder(6))
    sim = _sim(synthetic_federation, tmp_path, system, strategy=strategy)
    sim.run()
    trace = [r for r in read_metrics(tmp_path / "clients.jsonl") if r["sampled"]]
    finish = sorted((r["sim"]["total_s"], r["cid"]) for r in trace)
    assert len(finish) == 6
    kept = {cid for _, cid in finish[:4]}
    assert {r["cid"] for r in trace if r["failure"] is None} == kept
    assert {r["failure"] for r in trace if r["cid"] not in kept} == {"overcommitted"}
    row = _rows(tmp_path)[0]
    assert row["clients"] == 4 and row["failed"] == 2
    assert row["sim_time_s"] == pytest.approx(finish[3][0])  # the 4th to finish
    with pytest.raises(ValueError, match="overcommit must be >= 1"):
        SystemSettings(profiles, overcommit=0.5)


def test_resume_with_behaviours_and_over_commitment_equals_an_uninterrupted_run(
    synthetic_federation, tmp_path
):
    family = synthetic_federation[0]
    profiles = dtfl_cpu_profiles(2e8)
    # reachable 0.4 s of every second, each profile in its own phase
    behaviours = {
        p.name: Behaviour((0.1 * i,), (0.1 * i + 0.4,), 1.0) for i, p in enumerate(profiles)
    }
    system = SystemSettings(
        profiles,
        switch_every=1,
        switch_fraction=0.5,
        behaviours=behaviours,
        overcommit=1.5,
        keep_first=2,
    )

    def make(path, rounds):
        strategy = fedavg(family, clients_per_round=3, train=TRAIN, sampler=_Recorder(3))
        return _sim(synthetic_federation, path, system, rounds=rounds, cpr=3, strategy=strategy)

    whole, resumed, _, trace = _whole_and_resumed(make, tmp_path, 6)
    assert resumed.strategy.sampler.offered == whole.strategy.sampler.offered[3:]
    # the traces bit: clients left mid-round, the over-committed were dropped, and whom
    # the plans were offered changed with the simulated time
    assert {r["failure"] for r in trace} == {None, "lost", "overcommitted"}
    assert len({len(o) for o in whole.strategy.sampler.offered}) > 1


def test_a_configured_run_on_the_shipped_trace_over_commits(tmp_path, capsys):
    cfg = tmp_path / "cfg.yaml"
    system = "system: {trace: {capacity: fixture}, overcommit: 1.5}\n"
    text = CONFIG.replace("clients_per_round: 3", "clients_per_round: 2")
    cfg.write_text(
        text.replace(CONFIG.splitlines()[-1] + "\n", system) + f"output_dir: {tmp_path}\n"
    )
    assert main(["run", str(cfg)]) == 0
    assert "devices: 300 trace devices" in capsys.readouterr().err
    trace = [r for r in read_metrics(tmp_path / "t" / "clients.jsonl") if r["sampled"]]
    for rnd in (1, 2):  # 3 sampled (ceil 1.5 x 2), the first 2 to finish kept
        failures = [r["failure"] for r in trace if r["round"] == rnd]
        assert sorted(failures, key=str) == [None, None, "overcommitted"]
    assert [r["clients"] for r in _rows(tmp_path / "t")] == [2, 2]
