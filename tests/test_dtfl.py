"""DTFL: aggregation across tiers by hand, tier profiles priced by hand, Eq. (5) for a split
client against the scheduler's estimate, activations sent batch by batch, the local-loss
part with its privacy options, resume equality, and the errors for bad settings."""

from __future__ import annotations

import json
import math
import pickle
from dataclasses import replace

import pytest
import torch

from hetfl.algorithms import ALGORITHMS
from hetfl.algorithms.parts.dtfl_local_loss import LocalLoss
from hetfl.algorithms.parts.server_copies import CopiesSide, CopySession
from hetfl.algorithms.parts.tier_scheduler import estimate
from hetfl.config import validate
from hetfl.core.client.privacy import distance_correlation
from hetfl.core.client.program import Programs
from hetfl.core.client.recipe import TrainContext
from hetfl.core.plateau import PlateauSettings
from hetfl.core.pricing import CutCost
from hetfl.core.simulator_only import SimulatorOnlyError, refuse_simulator_only
from hetfl.core.state import extract
from hetfl.core.training import LocalTraining
from hetfl.core.types import ClientData, ClientResult, ClientTask, ServerResult
from hetfl.engine.round_settings import RoundSettings
from hetfl.models import make_family
from hetfl.models.scalable import SpecError
from hetfl.sim import Simulation
from hetfl.systems.profiles import DeviceProfile, SystemSettings
from hetfl.systems.split_pricing import SplitPricer
from strategies import trained

SHAPE, CLASSES = (1, 8, 8), 4
FAMILY = make_family("resnet-cifar", SHAPE, CLASSES, blocks=1)
TRAIN = LocalTraining(lr=1e-3, batch_size=16, optimizer="amsgrad", weight_decay=5e-4)
DTFL = ALGORITHMS.get("dtfl")


class _FlatCosts:
    """Every tier costs the same: the scheduler then keeps the default tier's ties."""

    server_rate = 1.0

    def cut_cost(self, client, server, batch):
        return CutCost(batch, 1, 1, 1, 1)


def _build(costs=None, **options):
    return DTFL.build(
        FAMILY, options, clients_per_round=3, train=TRAIN, costs=costs or _FlatCosts()
    )


# -- aggregation ------------------------------------------------------------------------------
def _filled(names_like, value):
    return {k: torch.full_like(v, value) for k, v in names_like.items()}


def test_md_tensors_average_over_all_tiers_by_samples_and_heads_within_their_tier():
    strategy, _ = _build(tiers=[2, 3, 5])
    infos = [
        ClientData(c, torch.zeros(1, *SHAPE), torch.zeros(1), None, None, CLASSES).info()
        for c in range(3)
    ]
    state = strategy.setup(infos, torch.Generator().manual_seed(0))
    tiers, samples = {0: 2, 1: 2, 2: 5}, {0: 10, 1: 30, 2: 60}
    tasks = []
    for cid, m in tiers.items():
        spec = FAMILY.side_spec("client", m, aux=True)
        imap = strategy._index_map_in_round(infos[cid], spec, state)
        tasks.append(ClientTask(cid, spec, extract(state, imap), imap, TRAIN))
    # client k's side holds 1 + k everywhere, its head 100 (k + 1), its server copy 10 + k
    results = []
    for t in tasks:
        tensors = _filled(t.payload, 1.0 + t.cid)
        tensors.update(
            {
                k: torch.full_like(v, 100.0 * (t.cid + 1))
                for k, v in t.payload.items()
                if k.startswith("aux.")
            }
        )
        results.append(ClientResult(t.cid, tensors, samples[t.cid], 1, 0.0))
    served = []
    for t in tasks:
        server_spec = FAMILY.side_spec("server", tiers[t.cid])
        local = extract(state, FAMILY.index_map(server_spec))
        served.append(ServerResult(t.cid, _filled(local, 10.0 + t.cid)))
    new = strategy.aggregate(1, state, trained(tasks, results, served)).state
    # md1 is on every client's side: (10 x 1 + 30 x 2 + 60 x 3) / 100
    assert torch.all(new["md1.conv.weight"] == 2.5)
    # md4 is on the server for the tier-2 clients, on the client in tier 5:
    # (10 x 10 + 30 x 11 + 60 x 3) / 100
    assert torch.allclose(new["md4.0.conv1.weight"], torch.tensor(6.1))
    # md8 is always the server's: (10 x 10 + 30 x 11 + 60 x 12) / 100; BN buffers alike
    assert torch.allclose(new["md8.weight"], torch.tensor(11.5))
    assert torch.allclose(new["md6.0.norm1.running_var"], torch.tensor(11.5))
    # heads: uniform within the tier, (100 + 200) / 2 and 300; tier 3 had nobody: kept
    assert torch.all(new["aux2.weight"] == 150.0) and torch.all(new["aux5.bias"] == 300.0)
    assert torch.equal(new["aux3.weight"], state["aux3.weight"])


def test_tiers_are_priced_once_when_first_needed():
    asked = []

    class Counting(_FlatCosts):
        def cut_cost(self, client, server, batch):
            asked.append((client["tier"], server["tier"], batch))
            return super().cut_cost(client, server, batch)

    strategy, _ = _build(costs=Counting(), tiers=[2, 5])
    assert asked == []  # building a run (to check its config) prices nothing
    strategy.describe()
    strategy.describe()
    assert asked == [(2, 2, 16), (5, 5, 16)]


# -- tier profiles ----------------------------------------------------------------------------
def test_tier_profiles_are_priced_by_hand():
    pricer = SplitPricer(FAMILY, SHAPE, 1e9)
    b = 32
    first = pricer.cut_cost(
        FAMILY.side_spec("client", 1, aux=True), FAMILY.side_spec("server", 1), b
    )
    # md1: 3x3 conv 1 -> 16 over 8x8 (9216 MACs a sample), forward and weight gradient (its
    # input needs none); the head 16 -> 4: forward, weight and input gradients
    assert first.client_macs == b * (2 * 16 * 9 * 64 + 3 * 16 * CLASSES)
    # what a batch sends: 16 x 8 x 8 float32 activations and an int64 label a sample
    assert first.batch_bytes == b * (16 * 64 * 4 + 8)
    # md1's conv weight, BN affine and statistics (+ the int64 counter), the tier-1 head
    assert first.model_bytes == (16 * 9 + 4 * 16 + CLASSES * 16 + CLASSES) * 4 + 8
    last = pricer.cut_cost(
        FAMILY.side_spec("client", 7, aux=True), FAMILY.side_spec("server", 7), b
    )
    # the server keeps md8 alone: pooling, then 256 -> 4, forward and weight gradient
    assert last.server_macs == b * 2 * 256 * CLASSES
    assert last.batch_bytes == b * (256 * 2 * 2 * 4 + 8)  # md7's output is 256 x 2 x 2


# -- a run ------------------------------------------------------------------------------------
SIZES = (40, 24, 56)  # batches of 16: 2.5, 1.5 and 3.5 a round


def _clients(sizes=SIZES):
    g = torch.Generator().manual_seed(0)
    out = []
    for cid, n in enumerate(sizes):
        x, y = torch.randn(n, *SHAPE, generator=g), torch.randint(0, CLASSES, (n,), generator=g)
        xv, yv = torch.randn(8, *SHAPE, generator=g), torch.randint(0, CLASSES, (8,), generator=g)
        out.append(ClientData(cid, x, y, x[:8], y[:8], CLASSES, xv, yv))
    xt, yt = torch.randn(30, *SHAPE, generator=g), torch.randint(0, CLASSES, (30,), generator=g)
    return out, (xt, yt)


SYSTEM = SystemSettings(
    (DeviceProfile("slow", 2e7, 20.0, 10.0), DeviceProfile("fast", 2e8, 50.0, 50.0)),
    assignment=("slow", "fast", "fast"),
    server_rate=5e8,
)


def _simulation(path, rounds, *, system=SYSTEM, train=TRAIN, sizes=SIZES, **options):
    pricer = SplitPricer(FAMILY, SHAPE, system.server_rate)
    strategy, recipe = DTFL.build(FAMILY, options, clients_per_round=3, train=train, costs=pricer)
    clients, test = _clients(sizes)
    settings = RoundSettings(rounds=rounds, seed=0, system=system, local_eval="all")
    return Simulation(strategy, Programs(FAMILY, recipe, seed=0), clients, test, settings, path)


def test_eq_5_a_split_client_takes_the_time_the_scheduler_estimates(tmp_path, monkeypatch):
    sent: dict[int, list[int]] = {}
    original = CopySession.batch

    def spy(self, z, y):
        sent.setdefault(self.cid, []).append(int(z.shape[0]))
        return original(self, z, y)

    monkeypatch.setattr(CopySession, "batch", spy)
    sim = _simulation(tmp_path, 2, observed="compute", tiers=[1, 2, 4, 7])
    sim.run()
    # activations went to the server batch by batch, never as one payload
    assert sent == {0: [16, 16, 8] * 2, 1: [16, 8] * 2, 2: [16, 16, 16, 8] * 2}
    rows = [json.loads(line) for line in (tmp_path / "clients.jsonl").read_text().splitlines()]
    first = {r["cid"]: r for r in rows if r["round"] == 1 and r["sampled"]}
    second = {r["cid"]: r for r in rows if r["round"] == 2 and r["sampled"]}
    assert {r["fields"]["tier"] for r in first.values()} == {2}  # no history: the default
    scheduler = sim.strategy.assignment
    for cid, n in enumerate(SIZES):
        times, tier = sim.infos[cid].history, second[cid]["fields"]["tier"]
        assert scheduler.batches(sim.infos[cid]) == n / 16  # a short last batch counts as such
        # Eq. (5): comm + max(client, server), the two sides in parallel
        assert times.total_s == pytest.approx(
            times.down_s + times.up_s + max(times.compute_s, times.server_s), rel=1e-12
        )
        # what the scheduler estimated for the tier it chose, from round 1 in tier 2, is
        # what the clock then gave: the profiles are the cost model's own prices
        guess = estimate(
            scheduler.costs,
            SYSTEM.server_rate,
            2,
            first[cid]["sim"]["compute_s"],
            n / 16,
            times.down_mbps,
            times.up_mbps,
        )
        assert guess[tier] == pytest.approx(times.total_s, rel=1e-9)
    assert len({r["fields"]["tier"] for r in second.values()}) > 1  # the slow client moved


def test_resume_equals_an_uninterrupted_run(tmp_path):
    # profiles switch every round, the plateau cuts (no round gains 100 %), the scheduler
    # moves clients between two tiers: all of it checkpointed
    system = SystemSettings(
        SYSTEM.profiles,
        assignment=SYSTEM.assignment,
        server_rate=5e8,
        switch_every=1,
        switch_fraction=0.5,
    )
    plateau = PlateauSettings(monitor="val_acc", patience=0, factor=0.5, threshold=1.0)
    train = replace(TRAIN, lr_plateau=plateau)

    def run(path, rounds, resume=False):
        sim = _simulation(
            path, rounds, system=system, train=train, sizes=(32, 16, 48), tiers=[2, 6]
        )
        sim.run(resume=resume)
        return sim

    whole = run(tmp_path / "whole", 3)
    run(tmp_path / "part", 2)
    resumed = run(tmp_path / "part", 3, resume=True)
    for k, v in whole.state.items():
        assert torch.equal(v, resumed.state[k]), k
    kept = whole.strategy.extra_state()
    assert kept == resumed.strategy.extra_state()
    assert kept["lr_plateau"]["factor"] == 0.25  # cut after rounds 2 and 3
    assert whole.history == resumed.history
    for name in ("metrics.jsonl", "clients.jsonl"):
        rows = [json.loads(line) for line in (tmp_path / "whole" / name).read_text().splitlines()]
        again = [json.loads(line) for line in (tmp_path / "part" / name).read_text().splitlines()]
        for r in rows + again:
            r.pop("wall_time_s", None)
        assert rows == again, name
    tiers = [
        r["fields"]["tier"]
        for r in map(json.loads, (tmp_path / "part" / "clients.jsonl").read_text().splitlines())
        if r["sampled"]
    ]
    assert set(tiers) == {2, 6}


# -- local-loss training ----------------------------------------------------------------------
class _Sink:
    def __init__(self):
        self.sent = []

    def send(self, z, y):
        self.sent.append(z.detach().clone())


def test_local_loss_trains_on_its_head_alone_and_adds_dcor_by_hand():
    spec = FAMILY.side_spec("client", 3, aux=True)
    model = FAMILY.build(spec)
    x = torch.randn(6, *SHAPE, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 1, 2, 3, 0, 1])
    task = ClientTask(0, spec, {}, [], TRAIN)
    ctx = TrainContext(task, {}, torch.Generator().manual_seed(0), TRAIN, batch=(x, y))
    sink = _Sink()
    ctx.channel = sink  # type: ignore[assignment]
    part = LocalLoss(alpha=0.25)
    logits, per_sample = part(model, x, y, ctx)
    z, want_logits = model(x, activations=True)
    ce = torch.nn.functional.cross_entropy(want_logits, y, reduction="none")
    assert torch.allclose(logits, want_logits) and torch.allclose(per_sample, 0.75 * ce)
    assert torch.allclose(sink.sent[0], z)  # what the server gets: md1..md3's output
    term = part.dcor(logits, y, per_sample, ctx)
    assert torch.allclose(term, 0.25 * distance_correlation(x, z))
    assert LocalLoss().dcor(logits, y, per_sample, ctx) is None
    shuffled = LocalLoss(patch=4)
    shuffled(model, x, y, ctx)
    assert not torch.equal(sink.sent[-1], z) and torch.equal(
        sink.sent[-1].flatten(2).sort(-1).values, z.detach().flatten(2).sort(-1).values
    )  # the same activations in another order


@pytest.mark.parametrize(("fresh", "steps"), [("round", 2.0), ("batch", 1.0)])
def test_the_server_copy_starts_from_the_global_model_and_its_optimiser_as_asked(fresh, steps):
    state = {k: v.clone() for k, v in FAMILY.build(FAMILY.side_spec("whole")).state_dict().items()}
    task = ClientTask(0, FAMILY.side_spec("client", 6, aux=True), {}, [], TRAIN)
    side = CopiesSide(
        FAMILY, FAMILY.server_spec, answers=False, parallel=True, fresh_optimiser=fresh
    )
    session = side.program(1, state, [task]).open(task, {})
    assert torch.equal(session.copy.params["md8.weight"], state["md8.weight"])
    z = torch.randn(5, 256, 2, 2, generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        assert session.batch(z, torch.tensor([0, 1, 2, 3, 0])) is None  # no answer
    # Adam's step count: two steps of one optimiser, or one of the optimiser made afresh
    assert float(session.copy.state["adam.step/md8.weight"]) == steps
    served = session.close()
    assert served.input_shape == (256, 2, 2) and [p.count for p in served.passes] == [2]
    assert not torch.equal(served.tensors["md8.weight"], state["md8.weight"])


def test_the_recipe_and_the_server_program_travel_to_worker_processes():
    """The process executor pickles the programs (the recipe) and each round's server
    program; both must come back working."""
    strategy, recipe = _build()
    state = strategy.setup([], torch.Generator().manual_seed(0))
    program = strategy.server_program(1, state, [])
    again = pickle.loads(pickle.dumps((recipe, program)))
    assert again[0].forward == recipe.forward and again[0].loss_terms[0].__func__ is LocalLoss.dcor
    assert again[1].parallel and again[1].side.fresh_optimiser == "round"


# -- bad settings -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"tiers": [0, 2]}, "tiers must be distinct tiers of 1..7"),
        ({"tiers": [2, 8]}, "tiers must be distinct tiers of 1..7"),
        ({"tiers": [3, 4]}, "default_tier 2 is not one of tiers"),
        ({"dcor_alpha": 1.0}, "dcor_alpha"),
    ],
)
def test_bad_options_name_the_field(options, message):
    with pytest.raises(ValueError, match=message):
        DTFL.options(**options)


def test_a_cut_beyond_the_model_is_refused():
    with pytest.raises(SpecError, match="beyond the model"):
        FAMILY.side_spec("client", 8, aux=True)


def test_dtfl_needs_profiles_a_split_model_and_the_simulator():
    with pytest.raises(ValueError, match=r"add a system: section"):
        validate({"algorithm": "dtfl", "model": {"name": "resnet-cifar"}})
    with pytest.raises(ValueError, match="needs a split model"):
        validate({"algorithm": "dtfl", "system": {"preset": "dtfl"}})
    with pytest.raises(ValueError, match="add a system: section"):
        DTFL.build(FAMILY, {}, clients_per_round=1, train=TRAIN)
    strategy, _ = _build()
    with pytest.raises(SimulatorOnlyError, match="runs in the simulator only"):
        refuse_simulator_only("dtfl", DTFL.simulator_only)
    assert strategy.capabilities.needs_server_program
    assert math.isfinite(SYSTEM.server_rate)
