"""The simulator and the FedAvg family against hand computations and invariants."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from hetfl.algorithms import ALGORITHMS
from hetfl.algorithms.fedavg import FedAvg
from hetfl.algorithms.fedprox import ProximalHooks
from hetfl.core.client import ClientHooks, ClientProgram
from hetfl.core.rng import torch_generator
from hetfl.core.spec import MapEntry, Spec, full_map
from hetfl.core.state import state_bytes
from hetfl.core.types import ClientData, ClientOutput, ClientTask, PassRecord
from hetfl.engine.outputs import ROW_KEYS
from hetfl.engine.rounds import RoundSettings
from hetfl.models import ScalableFamily
from hetfl.sim import Simulation

TRAIN = {"lr": 0.1, "epochs": 1, "batch_size": 16}


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
    strat, hooks = ALGORITHMS.get(algo).build(
        family, opts, clients_per_round=cpr, train=settings.pop("train", TRAIN)
    )
    program = program or ClientProgram(family, hooks, seed=0)
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
    def build(self, spec: Spec) -> nn.Module:
        return nn.Linear(3, 2)

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
        {"lr": lr, "steps": 2, "batch_size": 6},
    )
    out = ClientProgram(_LinearFamily(), ProximalHooks(mu)).fit(
        task, data, {}, torch_generator(0, 1, 0, "train"), info=data.info()
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
    plain = ClientProgram(_LinearFamily()).fit(
        task, data, {}, torch_generator(0, 1, 0, "train"), info=data.info()
    )
    assert not torch.allclose(plain.result.tensors["weight"], w2["weight"], atol=1e-5)


# -- one round ------------------------------------------------------------------------------
def test_round_is_sample_weighted_average_and_counts_bytes(synthetic_federation, tmp_path):
    family, clients, test = synthetic_federation
    sim = _sim(family, clients, test, tmp_path, rounds=1, cpr=3)
    sim.setup()
    before = copy.deepcopy(sim.strategy.global_state)
    tasks = sim.strategy.plan(1, [c.info() for c in clients], torch_generator(0, 1, -1, "sample"))
    outs = [
        sim.program.fit(
            t, sim.clients[t.cid], {}, torch_generator(0, 1, t.cid, "train"), info=sim.infos[t.cid]
        )
        for t in tasks
    ]
    sim.strategy.global_state = before
    sim.run()
    n = sum(o.result.num_examples for o in outs)
    for name, value in sim.strategy.global_state.items():
        ref = sum(o.result.num_examples * o.result.tensors[name].double() for o in outs) / n
        assert torch.equal(value, ref.to(value.dtype)), name
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert set(row) == set(ROW_KEYS)
    assert row["bytes_down"] == row["bytes_up"] == 3 * state_bytes(before)
    assert row["macs"] > 0 and row["clients"] == 3 and row["failed"] == 0


def test_permuting_client_execution_order_is_bit_identical(synthetic_federation, tmp_path):
    family, clients, test = synthetic_federation
    sim = _sim(family, clients, test, tmp_path, cpr=5)
    sim.setup()
    tasks = sim.strategy.plan(1, [c.info() for c in clients], torch_generator(0, 1, -1, "sample"))

    def run(order):
        program = ClientProgram(family, ClientHooks(), seed=0)
        results = {}
        for t in order:
            generator = torch_generator(0, 1, t.cid, "train")
            out = program.fit(t, sim.clients[t.cid], {}, generator, info=sim.infos[t.cid])
            results[t.cid] = out.result
        return sim.strategy.aggregate(1, [results[c] for c in sorted(results)], [])

    a, b = run(tasks), run(list(reversed(tasks)))
    assert all(torch.equal(a[k], b[k]) for k in a)


# -- failures --------------------------------------------------------------------------------
class _FaultyProgram(ClientProgram):
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
    program = _FaultyProgram(family, ClientHooks(), seed=0)
    sim = _sim(family, clients, test, tmp_path, rounds=2, cpr=8, program=program)
    sim.run()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["failed"] for r in rows] == [3, 3]
    assert [r["clients"] for r in rows] == [5, 5]
    assert all(bool(torch.isfinite(v).all()) for v in sim.strategy.global_state.values())
    assert 1 not in sim.store and 2 not in sim.store and 0 in sim.store


# -- private layers --------------------------------------------------------------------------
class _PrivateHead(FedAvg):
    """A test strategy that keeps the classifier head on the client."""

    def index_map_for(self, spec):
        return [e for e in super().index_map_for(spec) if not e.local.startswith("head.")]


class _RecordStart(ClientHooks):
    def __init__(self):
        self.start = {}

    def pre_step(self, grads, params, ctx):
        if ctx.step == 0:
            self.start[ctx.task.cid] = params["head.weight"].detach().clone()


def test_private_layer_never_sent_and_persists(synthetic_federation, tmp_path):
    family, clients, test = synthetic_federation
    hooks = _RecordStart()
    strategy = _PrivateHead(family, clients_per_round=8, train=TRAIN)
    program = ClientProgram(family, hooks, seed=0)
    sim = _sim(
        family,
        clients,
        test,
        tmp_path,
        rounds=1,
        cpr=8,
        program=program,
        strategy=strategy,
        local_eval="all",
    )
    sim.run()
    assert not any(k.startswith("head.") for k in sim.strategy.global_state)
    shared = state_bytes(sim.strategy.global_state)
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert row["bytes_up"] == row["bytes_down"] == 8 * shared
    assert row["global_acc"] is None and row["local_acc"] is not None
    after_round1 = {c: sim.store.get(c)["head.weight"].clone() for c in sim.store}
    assert not torch.equal(after_round1[0], after_round1[1])  # each client its own head
    sim.settings = RoundSettings(rounds=2, seed=0, local_eval="all")
    sim.run(resume=True)
    for cid, head in after_round1.items():
        assert torch.equal(hooks.start[cid], head)  # round 2 started from the stored head
        assert not torch.equal(sim.store.get(cid)["head.weight"], head)


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
    tasks = sim.strategy.plan(1, sim.available(1), torch_generator(0, 1, -1, "sample"))
    assert {t.cid for t in tasks} == available


@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_every_algorithm_runs_and_resumes(name, synthetic_federation, tmp_path):
    """Every registered method trains, checkpoints its strategy state and resumes exactly."""
    family, clients, test = synthetic_federation
    if ALGORITHMS.get(name).needs_scalable:
        family = ScalableFamily(
            {"family": "stage-cnn", "input_shape": (1, 8, 8), "num_classes": 10, "stages": 2}
        )
    whole = _sim(family, clients, test, tmp_path / "whole", algo=name, rounds=3)
    summary = whole.run()
    assert summary["final"]["clients"] == 4 and summary["final"]["failed"] == 0
    part = _sim(family, clients, test, tmp_path / "part", algo=name, rounds=2)
    part.run()
    resumed = _sim(family, clients, test, tmp_path / "part", algo=name, rounds=3)
    resumed.run(resume=True)
    for k, v in whole.strategy.global_state.items():
        assert torch.equal(v, resumed.strategy.global_state[k]), k
    for cid in whole.store:
        for k, v in whole.store.get(cid).items():
            assert torch.equal(v, resumed.store.get(cid)[k]), (cid, k)


def test_kept_momentum_resumes_exactly(synthetic_federation, tmp_path):
    """Momentum buffers kept between rounds are client state: checkpointed with the store,
    so a resumed run equals an uninterrupted one (and the buffers really are kept)."""
    family, clients, test = synthetic_federation
    train = {**TRAIN, "momentum": 0.9, "keep_momentum": True}
    whole = _sim(family, clients, test, tmp_path / "whole", rounds=3, train=train)
    whole.run()
    _sim(family, clients, test, tmp_path / "part", rounds=2, train=train).run()
    resumed = _sim(family, clients, test, tmp_path / "part", rounds=3, train=train)
    resumed.run(resume=True)
    for k, v in whole.strategy.global_state.items():
        assert torch.equal(v, resumed.strategy.global_state[k]), k
    kept = [c for c in whole.store if any(k.startswith("momentum/") for k in whole.store.get(c))]
    assert kept
    for cid in kept:
        for k, v in whole.store.get(cid).items():
            assert torch.equal(v, resumed.store.get(cid)[k]), (cid, k)


# -- contract extensions: per-client maps, recorded passes, attributes, feedback ----------------
class _MaskedHead(FedAvg):
    """A label-split head: client c uploads only row c of the head (a per-client mask)."""

    def index_map_in_round(self, round, info, spec):
        imap = []
        for e in super().index_map_in_round(round, info, spec):
            if e.local == "head.bias":
                mask = torch.zeros(10)
                mask[info.cid] = 1.0
                e = MapEntry(e.local, e.global_name, e.index, mask)
            imap.append(e)
        return imap


def test_aggregation_uses_the_map_each_client_was_planned_with(synthetic_federation, tmp_path):
    family, clients, test = synthetic_federation
    strategy = _MaskedHead(family, clients_per_round=8, train=TRAIN)
    sim = _sim(family, clients, test, tmp_path, rounds=1, cpr=8, strategy=strategy)
    sim.setup()
    before = sim.strategy.global_state["head.bias"].clone()
    tasks = strategy.plan(1, list(sim.infos.values()), torch_generator(0, 1, -1, "sample"))
    outcome = sim.train(1, tasks)
    after = strategy.aggregate(1, outcome.results, [])["head.bias"]
    # rows 0..7 each come from exactly one client (its own row); rows 8, 9 nobody uploads
    by_cid = {r.cid: r.tensors["head.bias"] for r in outcome.results}
    for c in range(8):
        assert after[c] == by_cid[c][c]
    assert torch.equal(after[8:], before[8:])


class _TwoPasses(ClientHooks):
    """Runs an extra forward pass per batch and records both, as FjORD's KD would."""

    def forward(self, model, x, y, ctx):
        with torch.no_grad():
            model(x)
        ctx.passes.append(PassRecord(ctx.task.spec, "forward", int(y.shape[0]), 1))
        ctx.passes.append(PassRecord(ctx.task.spec, "train", int(y.shape[0]), 1))
        return super().forward(model, x, y, ctx)


def test_passes_recorded_by_hooks_are_what_is_priced(synthetic_federation, tmp_path):
    family, clients, test = synthetic_federation
    plain = _sim(family, clients, test, tmp_path / "a", rounds=1, cpr=8)
    two = _sim(family, clients, test, tmp_path / "b", rounds=1, cpr=8,
               program=ClientProgram(family, _TwoPasses(), seed=0))  # fmt: skip
    macs_plain = plain.run()["final"]["macs"]
    macs_two = two.run()["final"]["macs"]
    spec = plain.strategy.global_spec
    per_sample = plain.macs.pass_macs(PassRecord(spec, "forward", 1, 1), (1, 8, 8))
    assert per_sample > 0
    # the recorded train passes replace the default ones; the forward passes come on top
    assert macs_two - macs_plain == per_sample * sum(c.n_train for c in clients)


class _Observer(FedAvg):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.seen = []

    def observe(self, round, row):
        self.seen.append((round, row["global_acc"]))


def test_strategy_sees_rounds_attrs_and_metrics(synthetic_federation, tmp_path):
    family, clients, test = synthetic_federation
    strategy = _Observer(family, clients_per_round=2, train=TRAIN)
    program = ClientProgram(family, ClientHooks(), seed=0)
    attrs = {0: {"capacity": 0.25}}
    settings = RoundSettings(rounds=2, seed=0, eval_every=2)
    sim = Simulation(strategy, program, clients, test, settings, tmp_path, attrs=attrs)
    sim.run()
    assert strategy.rounds == 2
    assert sim.infos[0].attrs == {"capacity": 0.25} and sim.infos[1].attrs == {}
    assert [r for r, _ in strategy.seen] == [2] and strategy.seen[0][1] is not None
    with pytest.raises(ValueError, match="unknown clients"):
        Simulation(strategy, program, clients, test, RoundSettings(rounds=1, seed=0),
                   tmp_path, attrs={99: {}})  # fmt: skip
