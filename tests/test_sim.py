"""The simulator and the FedAvg family against hand computations and invariants."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, replace

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from hetfl.algorithms import ALGORITHMS
from hetfl.core.client.program import Programs
from hetfl.core.client.recipe import CrossEntropy, LocalRecipe
from hetfl.core.client.terms import ProximalTerm
from hetfl.core.init import initialize
from hetfl.core.rng import torch_generator
from hetfl.core.spec import MapEntry, Spec, full_map
from hetfl.core.state import state_bytes
from hetfl.core.training import LocalTraining
from hetfl.core.types import (
    ClientData,
    ClientOutput,
    ClientTask,
    EvalModel,
    PassRecord,
    Problem,
)
from hetfl.engine.checkpoint import FORMAT as CHECKPOINT_FORMAT
from hetfl.engine.checkpoint import CheckpointFormatError, load_checkpoint, save_checkpoint
from hetfl.engine.outputs import ROW_KEYS
from hetfl.engine.round_settings import RoundSettings
from hetfl.engine.statistics import stats_shares
from hetfl.models import ComposedFamily, ScalableFamily, make_family
from hetfl.sim import ClientJob, SequentialExecutor, Simulation
from hetfl.systems.costs import MacCounter
from hetfl.systems.profiles import SystemSettings, dtfl_profiles
from hetfl.systems.split_pricing import SplitPricer
from strategies import fedavg, trained

TRAIN = LocalTraining(lr=0.1, epochs=1, batch_size=16)


def _sim(
    family,
    clients,
    test,
    tmp_path,
    *,
    algo="fedavg",
    opts=None,
    rounds=2,
    cpr=4,
    program=None,
    strategy=None,
    **settings,
):
    strat, recipe = ALGORITHMS.get(algo).build(
        family,
        opts,
        clients_per_round=cpr,
        train=settings.pop("train", TRAIN),
        costs=settings.pop("costs", None),
        macs=MacCounter(family),
    )
    program = program or Programs(strat.family, recipe, seed=0)  # LoRA wraps the family
    return Simulation(
        strategy or strat,
        program,
        clients,
        test,
        RoundSettings(rounds=rounds, seed=0, **settings),
        tmp_path,
    )


# -- FedProx ---------------------------------------------------------------------------------
class _LinearFamily:
    """A linear model; for `Spec(model="bn")` a lone BatchNorm layer (the stats pass tests)."""

    def build(self, spec: Spec) -> nn.Module:
        return nn.Sequential(nn.BatchNorm1d(3)) if spec == Spec(model="bn") else nn.Linear(3, 2)

    def index_map(self, spec: Spec):
        return full_map(["weight", "bias"])

    def global_spec(self, specs):
        return Spec(model="linear")


def test_fedprox_two_steps_match_hand_computation():
    torch.manual_seed(0)  # only for the test's own literals
    x = torch.randn(6, 3)
    y = torch.tensor([0, 1, 1, 0, 1, 0])
    data = ClientData(0, x, y, x[:0], y[:0], 2)
    w0 = {"weight": torch.randn(2, 3), "bias": torch.randn(2)}
    lr, mu = 0.3, 0.7
    task = ClientTask(
        0,
        Spec(model="linear"),
        copy.deepcopy(w0),
        full_map(["weight", "bias"]),
        LocalTraining(lr=lr, steps=2, batch_size=6),
    )
    prox = LocalRecipe(grad_transforms=(ProximalTerm(mu),))
    out = (
        Programs(_LinearFamily(), prox)
        .program_for(0)
        .fit(task, data, {}, torch_generator(0, 1, 0, "train"), info=data.info())
    )

    def grad(w):
        w = {k: v.clone().requires_grad_(True) for k, v in w.items()}
        loss = nn.functional.cross_entropy(x @ w["weight"].T + w["bias"], y)
        return dict(zip(w, torch.autograd.grad(loss, list(w.values())), strict=True))

    w1 = {k: w0[k] - lr * g for k, g in grad(w0).items()}  # anchor = w0: no term on step 1
    g1 = grad(w1)
    w2 = {k: w1[k] - lr * (g1[k] + mu * (w1[k] - w0[k])) for k in w0}
    for k in w0:
        torch.testing.assert_close(out.result.tensors[k], w2[k], rtol=1e-6, atol=1e-6)
    plain = (
        Programs(_LinearFamily())
        .program_for(0)
        .fit(task, data, {}, torch_generator(0, 1, 0, "train"), info=data.info())
    )
    assert not torch.allclose(plain.result.tensors["weight"], w2["weight"], atol=1e-5)


# -- one round ------------------------------------------------------------------------------
class _Wrapped:
    """A program wrapper's base: everything delegated to the honest program `inner`."""

    def __init__(self, inner):
        self.inner, self.cid, self.device = inner, inner.cid, inner.device

    def fit(self, task, data, private, generator, **kwargs):
        return self.inner.fit(task, data, private, generator, **kwargs)

    def evaluate(self, task, data, private, models):
        return self.inner.evaluate(task, data, private, models)


class _SendsConstant(_Wrapped):
    """Trains for real, then sends every tensor filled with `value`."""

    def __init__(self, inner, value):
        super().__init__(inner)
        self.value = value

    def fit(self, task, data, private, generator, **kwargs):
        out = super().fit(task, data, private, generator, **kwargs)
        out.result.tensors = {
            k: torch.full_like(v, self.value) for k, v in out.result.tensors.items()
        }
        return out


@dataclass(frozen=True)
class _SendConstants:
    """A wrapper (picklable, as every wrapper must be): client c sends `values[c]`."""

    values: dict

    def __call__(self, program):
        return _SendsConstant(program, self.values[program.cid])


def _sends_constants(family, values):
    """Programs whose client c sends `values[c]` everywhere."""
    return Programs(family, seed=0, wrappers=[_SendConstants(values)])


@pytest.mark.parametrize(("weighting", "expected"), [("samples", 3.1), ("uniform", 7 / 3)])
def test_round_is_a_weighted_average_by_hand_and_counts_bytes(
    weighting, expected, synthetic_federation, tmp_path
):
    """Clients of 10, 30 and 60 samples send 1, 2 and 4: FedAvg's average is
    (10 * 1 + 30 * 2 + 60 * 4) / 100 = 3.1 in every element; uniform weighting gives 7 / 3."""
    family, clients, test = synthetic_federation
    sized = [
        ClientData(c.cid, c.x_train[:n], c.y_train[:n], c.x_test, c.y_test, c.num_classes)
        for c, n in zip(clients, (10, 30, 60), strict=False)
    ]
    program = _sends_constants(family, {0: 1.0, 1: 2.0, 2: 4.0})
    sim = _sim(family, sized, test, tmp_path, rounds=1, cpr=3, program=program,
               opts={"weighting": weighting})  # fmt: skip
    sim.setup()
    before = copy.deepcopy(sim.state)
    sim.run()
    for name, value in sim.state.items():
        assert torch.allclose(value, torch.full_like(value, expected), rtol=0, atol=1e-6), name
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert set(row) == set(ROW_KEYS)
    assert row["bytes_down"] == row["bytes_up"] == 3 * state_bytes(before)
    assert row["macs"] > 0 and row["clients"] == 3 and row["failed"] == 0


@pytest.mark.parametrize(
    ("algo", "opts", "expected"),
    [
        ("fedavg", {"weighting": "uniform"}, 23.0),  # (1 + 2 + 4 + 8 + 100) / 5
        ("fedavg", {"reducer": "median"}, 4.0),
        ("fedavg", {"reducer": {"kind": "median"}}, 4.0),
        # t = 1: (2 + 4 + 8) / 3
        ("fedavg", {"reducer": {"kind": "trimmed-mean", "trim": 0.2}}, 14 / 3),
        ("fedprox", {"reducer": "median", "mu": 0.1}, 4.0),
        (
            "fedadam",
            {"reducer": "median", "server_lr": 1.0, "beta1": 0.0, "beta2": 0.0, "v0": 0.0},
            None,
        ),
    ],
)
def test_the_configured_reducer_is_what_a_round_reduces_with(
    algo, opts, expected, synthetic_federation, tmp_path
):
    """Five clients send 1, 2, 4, 8 and 100 in every element: the uniform mean is 23, the
    median 4 and the 0.2-trimmed mean (one value dropped at each end) 14 / 3, whatever the
    sample weights. FedAdam's pseudo-gradient is formed from the median too: its first step
    with beta1 = beta2 = 0 moves each parameter by server_lr * d / (|d| + tau), d = 4 - w;
    buffers take the median."""
    family, clients, test = synthetic_federation
    program = _sends_constants(family, dict(enumerate((1.0, 2.0, 4.0, 8.0, 100.0))))
    sim = _sim(family, clients[:5], test, tmp_path, algo=algo, opts=opts, rounds=1, cpr=5,
               program=program, local_eval="none")  # fmt: skip
    sim.setup()
    before = copy.deepcopy(sim.state)
    sim.run()
    params = set(sim.strategy._parameter_names())
    for name, value in sim.state.items():
        want = torch.full_like(value, expected) if expected is not None else None
        if want is None:
            d = 4.0 - before[name]
            want = (
                before[name] + d / (d.abs() + 1e-3)
                if name in params
                else torch.full_like(value, 4.0)
            )
        torch.testing.assert_close(value, want, rtol=0, atol=1e-5, msg=name)


def test_a_bad_reducer_setting_names_the_field():
    for opts, match in [
        ({"reducer": {"kind": "trimmed-mean"}}, "reducer 'trimmed-mean': trim is required"),
        ({"reducer": "trimmed-mean"}, "reducer 'trimmed-mean': trim is required"),
        (
            {"reducer": {"kind": "median", "trim": 0.1}},
            r"reducer 'median': trim is not one of its options \(options: none\)",
        ),
        (
            {"reducer": {"kind": "trimmed-mean", "trim": 0.7}},
            "reducer 'trimmed-mean': trim = 0.7: Input should be less than or equal to 0.5",
        ),
        (
            {"reducer": "mode"},
            r"unknown reducer 'mode'.*\(allowed: coverage-krum, coverage-median, "
            r"coverage-multi-krum, coverage-trimmed-mean, krum, mean, median, multi-krum, "
            r"norm-clip, trained-norm-clip",
        ),
        (
            {"reducer": "trimmed-mean", "trim": 0.1},
            r"write reducer: \{kind: trimmed-mean, trim: 0.1\}",
        ),
    ]:
        with pytest.raises(ValidationError, match=match):
            ALGORITHMS.get("fedavg").options(**opts)


def test_permuting_client_execution_order_is_bit_identical(synthetic_federation, tmp_path):
    family, clients, test = synthetic_federation
    sim = _sim(family, clients, test, tmp_path, cpr=5)
    sim.setup()
    tasks = sim.strategy.plan(
        1, sim.state, [c.info() for c in clients], torch_generator(0, 1, -1, "sample")
    )

    def run(order):
        programs = Programs(family, seed=0)
        results = {}
        for t in order:
            generator = torch_generator(0, 1, t.cid, "train")
            out = programs.program_for(t.cid).fit(
                t, sim.clients[t.cid], {}, generator, info=sim.infos[t.cid]
            )
            results[t.cid] = out.result
        return sim.strategy.aggregate(1, sim.state, trained(tasks, list(results.values()))).state

    a, b = run(tasks), run(list(reversed(tasks)))
    assert all(torch.equal(a[k], b[k]) for k in a)


# -- failures --------------------------------------------------------------------------------
class _Faulty(_Wrapped):
    """Client 1 raises, client 2 returns NaN, client 3 returns a wrong shape."""

    def fit(self, task, data, private, generator, **kwargs) -> ClientOutput:
        if task.cid == 1:
            raise RuntimeError("device lost")
        out = super().fit(task, data, private, generator, **kwargs)
        name = next(iter(out.result.tensors))
        if task.cid == 2:
            out.result.tensors[name] = torch.full_like(out.result.tensors[name], float("nan"))
        if task.cid == 3:
            out.result.tensors[name] = out.result.tensors[name][:1]
        return out


def test_failing_clients_are_excluded_and_counted(synthetic_federation, tmp_path):
    family, clients, test = synthetic_federation
    program = Programs(family, seed=0, wrappers=[_Faulty])
    sim = _sim(family, clients, test, tmp_path, rounds=2, cpr=8, program=program)
    sim.run()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["failed"] for r in rows] == [3, 3]
    assert [r["clients"] for r in rows] == [5, 5]
    assert all(bool(torch.isfinite(v).all()) for v in sim.state.values())
    assert 1 not in sim.store and 2 not in sim.store and 0 in sim.store


# -- the executor seam -----------------------------------------------------------------------
class _Recording(SequentialExecutor):
    """Runs jobs as the default executor does, and keeps every round's jobs and outcomes."""

    def __init__(self):
        super().__init__()
        self.jobs, self.outcomes = [], []

    def run(self, program, jobs, clients, server):
        self.jobs.append(list(jobs))
        self.outcomes.append(super().run(program, jobs, clients, server))
        return self.outcomes[-1]


class _ClientTwoRaises(SequentialExecutor):
    """Client 2's training raises; the outcome says so, as a worker's would."""

    def run(self, program, jobs, clients, server):
        done = super().run(program, jobs, clients, server)
        return [replace(d, output=Problem("raised", "raised RuntimeError: device lost"))
                if d.task.cid == 2 else d for d in done]  # fmt: skip


def test_executor_gets_each_round_in_client_id_order_and_the_engine_charges_once(
    synthetic_federation, tmp_path
):
    """Bytes are charged by the engine once per task, to its client: down the payload, up
    the result."""
    family, clients, test = synthetic_federation
    sim = _sim(family, clients, test, tmp_path, rounds=2, cpr=4)
    sim.executor = recording = _Recording()
    sim.setup()
    charges = {}
    for rnd in (1, 2):
        available = sim.available(rnd)
        tasks = sim.strategy.plan(rnd, sim.state, available, torch_generator(0, rnd, -1, "sample"))
        charges[rnd] = sim.train(rnd, tasks).charges
    for rnd, jobs in enumerate(recording.jobs, start=1):
        cids = [job.task.cid for job in jobs]
        assert len(cids) == 4 and cids == sorted(cids)
        for job in jobs:
            seed = torch_generator(0, rnd, job.task.cid, "train").initial_seed()
            assert job.generator.initial_seed() == seed
            assert job.info == sim.infos[job.task.cid] and job.server_private == {}
    for rnd, outcomes in enumerate(recording.outcomes, start=1):
        assert sorted(charges[rnd]) == [o.task.cid for o in outcomes]
        for o in outcomes:
            charged = charges[rnd][o.task.cid]
            assert charged.bytes_down == state_bytes(o.task.payload)
            assert charged.bytes_up == state_bytes(o.output.result.tensors)
            assert o.served is None and o.channel is None and o.wall_s > 0


def test_a_raised_outcome_becomes_a_failure_charged_only_its_payload(
    synthetic_federation, tmp_path
):
    family, clients, test = synthetic_federation
    sim = _sim(family, clients[:3], test, tmp_path, rounds=1, cpr=3)
    sim.executor = _ClientTwoRaises()
    sim.setup()
    tasks = sim.strategy.plan(
        1, sim.state, sim.known_clients(), torch_generator(0, 1, -1, "sample")
    )
    outcome = sim.train(1, tasks)
    assert [(f.cid, f.kind) for f in outcome.failures] == [(2, "raised")]
    assert [r.cid for r in outcome.results] == [0, 1]
    model = state_bytes(tasks[0].payload)
    charged = {cid: (c.bytes_down, c.bytes_up) for cid, c in outcome.charges.items()}
    assert charged == {0: (model, model), 1: (model, model), 2: (model, 0)}
    sim.counters.count_round(outcome)
    assert (sim.counters.bytes_down, sim.counters.bytes_up) == (3 * model, 2 * model)
    assert 2 not in sim.store and 0 in sim.store


def test_sequential_executor_turns_a_raising_training_into_a_problem(synthetic_federation):
    family, clients, _ = synthetic_federation
    program = Programs(family, seed=0, wrappers=[_Faulty])
    task = ClientTask(1, Spec(), {}, [], TRAIN)
    job = ClientJob(task, clients[1].info(), {}, torch_generator(0, 1, 1, "train"), {})
    [ran] = SequentialExecutor().run(program, [job], {1: clients[1]}, None)
    assert ran.output == Problem("raised", "raised RuntimeError: device lost")
    assert (ran.wall_s, ran.served, ran.channel) == (0.0, None, None)


class _Reversed(SequentialExecutor):
    def run(self, program, jobs, clients, server):
        return super().run(program, jobs, clients, server)[::-1]


def test_an_executor_answering_out_of_order_is_refused(synthetic_federation, tmp_path):
    family, clients, test = synthetic_federation
    sim = _sim(family, clients[:2], test, tmp_path, rounds=1, cpr=2)
    sim.executor = _Reversed()
    with pytest.raises(RuntimeError, match=r"outcomes for clients \[1, 0\], but was asked "
                       r"for clients \[0, 1\]"):  # fmt: skip
        sim.run()


# -- private layers --------------------------------------------------------------------------
NORM = {f"stages.0.norm.{k}" for k in ("weight", "bias", "running_mean", "running_var")}
NORM.add("stages.0.norm.num_batches_tracked")
HEAD = {"head.weight", "head.bias"}


class _RecordStart:
    """A forward part: each fit's private tensors as loaded, before the first step, by
    client (in itself: a test's recorder), then plain cross-entropy."""

    def __init__(self, private):
        self.private, self.start = private, {}

    def __call__(self, model, x, y, ctx):
        if ctx.step == 0:
            own = {**ctx.params, **ctx.buffers}
            loaded = {k: v.detach().clone() for k, v in own.items() if k in self.private}
            self.start.setdefault(ctx.task.cid, []).append(loaded)
        return CrossEntropy()(model, x, y, ctx)


class _StoreEachRound(Simulation):
    """The client store after each round's training, in `kept` (a list the test sets)."""

    def after_training(self, outcome):
        super().after_training(outcome)
        self.kept.append({c: dict(self.store.get(c)) for c in self.store})


@pytest.mark.parametrize(
    ("algo", "opts", "private"),
    [
        ("fedbn", None, NORM),
        ("fedper", None, HEAD),
        ("fedavg", {"private_norm": True}, NORM),
        ("fedavg", {"private_head": True}, HEAD),
    ],
)
def test_private_layers_stay_on_their_client_over_rounds(
    algo, opts, private, synthetic_federation, tmp_path
):
    """Over 3 rounds: the private tensors never enter the global state nor the bytes sent;
    each client starts round 1 from its own seeded initialisation and every later round
    from what the store kept, and local training changes them."""
    _, clients, test = synthetic_federation
    family = ScalableFamily(
        {"family": "stage-cnn", "input_shape": (1, 8, 8), "num_classes": 10, "stages": 1}
    )
    strategy, _ = ALGORITHMS.get(algo).build(
        family, opts, clients_per_round=4, train=TRAIN, macs=MacCounter(family)
    )
    hooks = _RecordStart(private)
    settings = RoundSettings(rounds=3, seed=0, local_eval="all")
    program = Programs(family, LocalRecipe(forward=hooks), seed=0)
    sim = _StoreEachRound(strategy, program, clients[:4], test, settings, tmp_path)
    sim.kept = []
    sim.run()

    spec = family.global_spec([])
    full = family.build(spec).state_dict()
    assert set(sim.state) == set(full) - private
    shared_bytes = sum(v.numel() * v.element_size() for k, v in full.items() if k not in private)
    for rnd, row in enumerate(sim.metrics.read(), start=1):  # bytes add up over the rounds
        assert row["bytes_down"] == row["bytes_up"] == rnd * 4 * shared_bytes
        assert row["global_acc"] is None and row["local_acc"] is not None
    for cid in range(4):
        own = initialize(family.build(spec), torch_generator(0, 0, cid, "private-init"))
        starts = hooks.start[cid]
        assert all(torch.equal(starts[0][k], own.state_dict()[k]) for k in private)
        for rnd in range(3):
            kept = sim.kept[rnd][cid]
            assert set(kept) == private
            if rnd > 0:  # reloaded from the store
                assert all(torch.equal(starts[rnd][k], sim.kept[rnd - 1][cid][k]) for k in private)
            assert all(not torch.equal(kept[k], starts[rnd][k]) for k in private)  # trained
    name = min(private)  # a float tensor: each client has its own
    assert not torch.equal(sim.kept[-1][0][name], sim.kept[-1][1][name])


def test_training_improves_accuracy_on_synthetic(synthetic_federation, tmp_path):
    family, clients, test = synthetic_federation
    sim = _sim(family, clients, test, tmp_path, rounds=4, cpr=8)
    summary = sim.run()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["global_acc"] > 0.5  # chance is 0.1
    assert summary["best"]["global_acc"] == max(r["global_acc"] for r in rows)


def test_unavailable_clients_are_never_planned(synthetic_federation, tmp_path):
    family, clients, test = synthetic_federation
    sim = _sim(family, clients, test, tmp_path, rounds=1, cpr=8, availability=0.5)
    sim.setup()
    available = {c.cid for c in sim.available(1)}
    assert 0 < len(available) < 8
    tasks = sim.strategy.plan(1, sim.state, sim.available(1), torch_generator(0, 1, -1, "sample"))
    assert {t.cid for t in tasks} == available


@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_every_algorithm_runs_and_resumes(name, synthetic_federation, tmp_path):
    """Every registered method trains, checkpoints its strategy state and resumes exactly."""
    family, clients, test = synthetic_federation
    if ALGORITHMS.get(name).needs == "scalable":
        family = ScalableFamily(
            {"family": "stage-cnn", "input_shape": (1, 8, 8), "num_classes": 10, "stages": 2}
        )
    if ALGORITHMS.get(name).needs == "composed":
        family = ComposedFamily(
            {"family": "composed-cnn", "input_shape": (1, 8, 8), "num_classes": 10}
        )
    cpr, opts = 4, None
    if name in ("fedfa", "flexifed", "nefl"):  # sections of blocks; small candidates, short
        family = ScalableFamily(
            {"family": "preresnet", "input_shape": (1, 8, 8), "num_classes": 10, "stages": 2}
        )
        opts = {"depths": [2, 3], "widths": [0.25, 0.5]}
        if name in ("flexifed", "nefl"):  # no grafting: depth 1 is theirs; ZiCo is FedFA's
            widths = [0.25] if name == "flexifed" else [0.25, 0.5]
            opts = {"depths": [1, 2, 3], "widths": widths, "choice": "random"}
    if ALGORITHMS.get(name).needs == "split":  # ten times the MLP's work: two clients a round
        family, cpr = make_family("resnet-cifar", (1, 8, 8), 10, blocks=1), 2
    if name == "fedgkt":  # FedML's 20 server epochs a round are a run's cost, not a resume's
        opts = {"server_epochs": 1}
    if name in ("hetlora", "flexlora", "flora"):  # LoRA adapters of two ranks on the MLP
        opts = {"ranks": [2, 4]}
    if name == "flora":  # every client merges every round's stack: every client every round
        cpr = len(clients)
    timed = {}
    if ALGORITHMS.get(name).needs_costs:  # DTFL plans from simulated times and cut costs
        system = SystemSettings(dtfl_profiles())
        timed = {"system": system, "costs": SplitPricer(family, (1, 8, 8), system.server_rate)}
    run = {"algo": name, "opts": opts, "cpr": cpr, **timed}
    whole = _sim(family, clients, test, tmp_path / "whole", rounds=3, **run)
    summary = whole.run()
    assert summary["final"]["clients"] == cpr and summary["final"]["failed"] == 0
    part = _sim(family, clients, test, tmp_path / "part", rounds=2, **run)
    part.run()
    resumed = _sim(family, clients, test, tmp_path / "part", rounds=3, **run)
    resumed.run(resume=True)
    for k, v in whole.state.items():
        assert torch.equal(v, resumed.state[k]), k
    for cid in whole.store:
        for k, v in whole.store.get(cid).items():
            assert torch.equal(v, resumed.store.get(cid)[k]), (cid, k)
    assert list(whole.downloads) == list(resumed.downloads)  # a server phase's answers
    for cid in whole.downloads:
        for k, v in whole.downloads.get(cid).items():
            assert torch.equal(v, resumed.downloads.get(cid)[k]), (cid, k)


def test_kept_momentum_resumes_exactly(synthetic_federation, tmp_path):
    """Momentum buffers kept between rounds are client state: checkpointed with the store,
    so a resumed run equals an uninterrupted one (and the buffers really are kept)."""
    family, clients, test = synthetic_federation
    train = replace(TRAIN, momentum=0.9, keep_momentum=True)
    whole = _sim(family, clients, test, tmp_path / "whole", rounds=3, train=train)
    whole.run()
    _sim(family, clients, test, tmp_path / "part", rounds=2, train=train).run()
    resumed = _sim(family, clients, test, tmp_path / "part", rounds=3, train=train)
    resumed.run(resume=True)
    for k, v in whole.state.items():
        assert torch.equal(v, resumed.state[k]), k
    kept = [c for c in whole.store if any(k.startswith("momentum/") for k in whole.store.get(c))]
    assert kept
    for cid in kept:
        for k, v in whole.store.get(cid).items():
            assert torch.equal(v, resumed.store.get(cid)[k]), (cid, k)


# -- contract extensions: per-client maps, recorded passes, attributes, feedback ----------------
class _MaskedHead:
    """A label-split head: client c uploads only row c of the head (a per-client mask)."""

    def shared(self, imap, spec):
        return imap

    def for_client(self, imap, spec, client, state):
        out = []
        for e in imap:
            if e.local == "head.bias":
                mask = torch.zeros(10)
                mask[client.cid] = 1.0
                e = MapEntry(e.local, e.global_name, e.index, mask)
            out.append(e)
        return out


def test_aggregation_uses_the_map_each_client_was_planned_with(synthetic_federation, tmp_path):
    family, clients, test = synthetic_federation
    strategy = fedavg(family, clients_per_round=8, train=TRAIN, transforms=[_MaskedHead()])
    sim = _sim(family, clients, test, tmp_path, rounds=1, cpr=8, strategy=strategy)
    sim.setup()
    before = sim.state["head.bias"].clone()
    tasks = strategy.plan(1, sim.state, list(sim.infos.values()), torch_generator(0, 1, -1, "s"))
    outcome = sim.train(1, tasks)
    after = strategy.aggregate(1, sim.state, outcome.trained_round(tasks)).state["head.bias"]
    # rows 0..7 each come from exactly one client (its own row); rows 8, 9 nobody uploads
    by_cid = {r.cid: r.tensors["head.bias"] for r in outcome.results}
    for c in range(8):
        assert after[c] == by_cid[c][c]
    assert torch.equal(after[8:], before[8:])


def _two_passes(model, x, y, ctx):
    """A forward part: an extra forward pass per batch, both recorded, as FjORD's KD would."""
    with torch.no_grad():
        model(x)
    ctx.passes.append(PassRecord(ctx.task.spec, "forward", int(y.shape[0]), 1))
    ctx.passes.append(PassRecord(ctx.task.spec, "train", int(y.shape[0]), 1))
    return CrossEntropy()(model, x, y, ctx)


def test_passes_recorded_by_parts_are_what_is_priced(synthetic_federation, tmp_path):
    family, clients, test = synthetic_federation
    plain = _sim(family, clients, test, tmp_path / "a", rounds=1, cpr=8)
    two = _sim(family, clients, test, tmp_path / "b", rounds=1, cpr=8,
               program=Programs(family, LocalRecipe(forward=_two_passes), seed=0))  # fmt: skip
    macs_plain = plain.run()["final"]["macs"]
    macs_two = two.run()["final"]["macs"]
    spec = plain.strategy.global_spec
    per_sample = plain.macs.pass_macs(PassRecord(spec, "forward", 1, 1), (1, 8, 8))
    assert per_sample > 0
    # the recorded train passes replace the default ones; the forward passes come on top
    assert macs_two - macs_plain == per_sample * sum(c.n_train for c in clients)


def test_strategy_sees_rounds_attrs_and_metrics(synthetic_federation, tmp_path):
    family, clients, test = synthetic_federation
    seen = []
    strategy = fedavg(
        family,
        clients_per_round=2,
        train=TRAIN,
        observer=lambda rnd, row: seen.append((rnd, row["global_acc"])),
    )
    program = Programs(family, seed=0)
    attrs = {0: {"capacity": 0.25}}
    settings = RoundSettings(rounds=2, seed=0, eval_every=2)
    sim = Simulation(strategy, program, clients, test, settings, tmp_path, attrs=attrs)
    sim.run()
    assert strategy.rounds == 2
    assert sim.infos[0].attrs == {"capacity": 0.25} and sim.infos[1].attrs == {}
    assert [r for r, _ in seen] == [2] and seen[0][1] is not None
    with pytest.raises(ValueError, match="unknown clients"):
        Simulation(strategy, program, clients, test, RoundSettings(rounds=1, seed=0),
                   tmp_path, attrs={99: {}})  # fmt: skip


# -- the static-BN statistics pass ---------------------------------------------------------------
def _stats_sim(tmp_path, sizes: list[int], samples: int | None) -> Simulation:
    """Clients holding `sizes` rows of 3 features (one class): only their inputs matter."""
    g = torch.Generator().manual_seed(5)
    clients = [
        ClientData(
            cid,
            torch.randn(n, 3, generator=g) * (cid + 1) + cid,
            torch.zeros(n, dtype=torch.long),
            torch.zeros(0, 3),
            torch.zeros(0, dtype=torch.long),
            2,
        )
        for cid, n in enumerate(sizes)
    ]
    return _sim(
        _LinearFamily(),
        clients,
        (clients[0].x_train[:1], clients[0].y_train[:1]),
        tmp_path,
        stats_samples=samples,
    )


def _bn_after_stats_pass(sim: Simulation) -> nn.BatchNorm1d:
    spec = Spec(model="bn")
    model = sim.eval_models.model_for(spec)
    sim.stats_pass(1, model, EvalModel("bn", spec, {}, stats_pass=True))
    return model[0]


def _expected(batches: list[torch.Tensor], bn: nn.BatchNorm1d) -> None:
    """The cumulative average over `batches`: mean of the per-batch means and of the
    per-batch unbiased variances, computed in float64."""
    means = torch.stack([b.double().mean(dim=0) for b in batches])
    variances = torch.stack([b.double().var(dim=0, correction=1) for b in batches])
    torch.testing.assert_close(bn.running_mean.double(), means.mean(dim=0), atol=1e-5, rtol=0)
    torch.testing.assert_close(bn.running_var.double(), variances.mean(dim=0), atol=1e-5, rtol=0)
    assert int(bn.num_batches_tracked) == len(batches)


def test_stats_pass_averages_each_clients_consecutive_batches_of_500(tmp_path):
    """By default the pass covers every client's whole training set, per client in
    client-id order, in consecutive batches of 500: 600 rows give two batches (500, 100),
    300 rows one, so three batches in all (not batches of a pooled shuffled subsample)."""
    sim = _stats_sim(tmp_path, [600, 300], samples=None)
    x0, x1 = sim.clients[0].x_train, sim.clients[1].x_train
    _expected([x0[:500], x0[500:], x1], _bn_after_stats_pass(sim))


def test_stats_subsample_is_each_clients_share_drawn_by_its_own_generator(tmp_path):
    """`stats_samples: 300` over clients of 600, 299 and 1 rows: shares 200, 99.5 and 0.5
    round by largest remainder (ties to the lower id) to 200, 100 and 0; each client draws
    its share without replacement with its (seed, 0, cid, "stats-pass") generator."""
    assert stats_shares({0: 600, 1: 299, 2: 1}, 300) == {0: 200, 1: 100, 2: 0}
    assert stats_shares({0: 600, 1: 299}, None) == {0: 600, 1: 299}
    assert stats_shares({0: 600, 1: 299}, 5000) == {0: 600, 1: 299}  # at most everything
    sim = _stats_sim(tmp_path, [600, 299, 1], samples=300)
    batches = []
    for cid, share in ((0, 200), (1, 100)):
        drawn = torch.randperm(
            sim.clients[cid].n_train, generator=torch_generator(0, 0, cid, "stats-pass")
        )
        batches.append(sim.clients[cid].x_train[drawn[:share]])
    _expected(batches, _bn_after_stats_pass(sim))


# -- checkpoint format -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("written", "shown"),
    [
        ({}, "format none (written before checkpoints were versioned)"),
        ({"format": 0}, "format 0"),
        ({"format": 1}, "format 1"),  # the global state inside the strategy's entry
        ({"format": 2}, "format 2"),  # the client store pickled inside latest.pt
        ({"format": 3}, "format 3"),  # no digests
        ({"format": 4}, "format 4"),  # no config
    ],
)
def test_a_checkpoint_of_another_format_is_refused_with_the_fix(tmp_path, written, shown):
    """Every checkpoint records its format; one without it (or of another) is refused,
    naming the file, both versions and what to do, instead of being resumed wrongly."""
    save_checkpoint(tmp_path, {"round": 2, "seed": 0})
    assert load_checkpoint(tmp_path) == {"round": 2, "seed": 0, "format": CHECKPOINT_FORMAT}
    torch.save({"round": 2, "seed": 0, **written}, tmp_path / "latest.pt")
    with pytest.raises(CheckpointFormatError) as refused:
        load_checkpoint(tmp_path)
    message = str(refused.value)
    assert str(tmp_path / "latest.pt") in message and shown in message
    assert f"reads format {CHECKPOINT_FORMAT} only" in message and "re-run" in message
