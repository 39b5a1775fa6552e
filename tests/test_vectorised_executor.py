"""The vectorised executor against the sequential one: the same clients' answers to 1e-5
after a round of at least 10 steps, padded steps that leave a finished client alone, the
parts it refuses and the fall-backs (bit for bit, since they are the sequential executor)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from golden.harness import WIDTHS, configured
from hetfl.algorithms import ALGORITHMS
from hetfl.algorithms.fjord import OrderedDropout
from hetfl.config import validate
from hetfl.core.client import Programs
from hetfl.core.local.parts import LocalRecipe
from hetfl.core.local.regularisers import PartialSVT, RademacherTerm
from hetfl.core.rng import torch_generator
from hetfl.core.training import LocalTraining
from hetfl.core.types import ClientOutput
from hetfl.engine.rounds import RoundSettings
from hetfl.runner import build_simulation
from hetfl.sim import ClientJob, SequentialExecutor, Simulation, TaskOutcome, vectorised
from hetfl.sim.vectorised import VectorisedExecutor, unsupported

TOL = 1e-5
#: Digits over 6 clients of unequal sizes (Dirichlet 0.5), all in the round, batches of 16:
#: 12 to 19 steps per client, so the shorter clients get padded steps.
ROUND = {"train.clients_per_round": 6, "train.batch_size": 16}


def _simulation(run_dir: Path, algorithm: str, dotted: dict[str, Any]) -> Simulation:
    cfg = configured(algorithm, {**ROUND, **dotted})
    sim = build_simulation(validate(cfg), run_dir, show_progress=False)
    sim.setup()
    return sim


def _jobs(sim: Simulation, rnd: int = 1) -> list[ClientJob]:
    """The round's jobs as the engine builds them, with fresh generators (each executor
    draws from its own)."""
    sample = torch_generator(sim.settings.seed, rnd, -1, "sample")
    tasks = sorted(
        sim.strategy.plan(rnd, sim.state, sim.known_clients(), sample), key=lambda t: t.cid
    )
    return [
        ClientJob(
            t, sim.infos[t.cid], sim.store.get(t.cid), torch_generator(0, rnd, t.cid, "train"), {}
        )
        for t in tasks
    ]


def _both(sim: Simulation) -> tuple[list[TaskOutcome], list[TaskOutcome], VectorisedExecutor]:
    executor = VectorisedExecutor()
    alone = SequentialExecutor().run(sim.programs, _jobs(sim), sim.clients, None)
    together = executor.run(sim.programs, _jobs(sim), sim.clients, None)
    return alone, together, executor


def _output(ran: TaskOutcome) -> ClientOutput:
    assert isinstance(ran.output, ClientOutput), ran.output
    return ran.output


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """max |a - b| over every tensor of the two dicts (same names, shapes and dtypes)."""
    assert list(a) == list(b)
    for k in a:
        assert (a[k].shape, a[k].dtype) == (b[k].shape, b[k].dtype), k
    return max((float((a[k].double() - b[k].double()).abs().max()) for k in a), default=0.0)


def _assert_agree(alone: list[TaskOutcome], together: list[TaskOutcome]) -> None:
    """Same clients, same structure, equal counts and extras; tensors and loss to 1e-5."""
    assert [r.task.cid for r in together] == [r.task.cid for r in alone]
    for a, b in zip(alone, together, strict=True):
        ra, rb = _output(a).result, _output(b).result
        assert _max_diff(ra.tensors, rb.tensors) <= TOL, ra.cid
        assert _max_diff(_output(a).private, _output(b).private) <= TOL, ra.cid
        assert (ra.num_examples, ra.num_steps, ra.passes) == (
            rb.num_examples,
            rb.num_steps,
            rb.passes,
        )
        assert ra.extras == rb.extras
        assert rb.loss == pytest.approx(ra.loss, abs=TOL)


@pytest.mark.parametrize(
    ("algorithm", "dotted", "groups"),
    [
        ("fedavg", {"train.momentum": 0.9, "train.weight_decay": 5e-4}, 1),
        ("fedprox", {"options.fedprox.mu": 0.1, "train.momentum": 0.9}, 1),
        ("fednova", {"train.momentum": 0.9, "options.fednova.mu": 0.1}, 1),
        # two width levels, each a spec of its own: two stacks (static BN, masked loss, clipping)
        ("heterofl", {**WIDTHS, "options.heterofl": {"levels": [1.0, 0.5]}}, 2),
    ],
)
def test_agrees_with_the_sequential_executor(tmp_path, algorithm, dotted, groups):
    sim = _simulation(tmp_path, algorithm, dotted)
    alone, together, executor = _both(sim)
    steps = [_output(r).result.num_steps for r in alone]
    assert max(steps) >= 10 and min(steps) < max(steps)  # padded steps happened
    assert len(executor.grouped) == groups
    assert sorted(c for group in executor.grouped for c in group) == [r.task.cid for r in alone]
    _assert_agree(alone, together)


def test_kept_momentum_and_batchnorm_agree_over_rounds(tmp_path):
    """FedBN on the stage CNN (BatchNorm statistics kept privately) with kept momentum: two
    rounds, so round 2 starts from the private state round 1 stored. Batches of 32: no
    client's last batch is a single sample, whose BatchNorm statistics would amplify
    rounding (see the module docstring of hetfl.sim.vectorised)."""
    dotted = {"model.name": "stage-cnn", "model.stages": 2, "train.rounds": 2,
              "train.batch_size": 32, "train.lr": 0.1, "train.momentum": 0.9,
              "train.keep_momentum": True}  # fmt: skip
    sequential = _simulation(tmp_path / "s", "fedbn", dotted)
    sequential.run()
    together = _simulation(tmp_path / "v", "fedbn", dotted)
    together.executor = VectorisedExecutor()
    together.run()
    assert _max_diff(sequential.state, together.state) <= TOL
    assert list(sequential.store) == list(together.store)
    for cid in sequential.store:
        kept = sequential.store.get(cid)
        assert any(k.startswith("momentum/") for k in kept)
        assert any(k.endswith("running_mean") for k in kept)
        assert _max_diff(kept, together.store.get(cid)) <= TOL


def _sizes_federation(synthetic_federation, sizes: list[int]):
    """The synthetic federation's first clients cut to `sizes` training samples."""
    family, clients, test = synthetic_federation
    cut = [
        replace(c, x_train=c.x_train[:n], y_train=c.y_train[:n])
        for c, n in zip(clients, sizes, strict=False)
    ]
    return family, cut, test


def test_padded_steps_leave_a_finished_client_where_it_ended(synthetic_federation, tmp_path):
    """Client 0 has 1 batch, clients 1 and 2 have 5: after its step client 0 is not touched
    (momentum and weight decay would move it on a zero-gradient step), so it ends where it
    ends alone, and where it ends in a group of clients with one batch each."""
    train = LocalTraining(lr=0.1, batch_size=10, momentum=0.9, weight_decay=0.01)
    family, clients, test = _sizes_federation(synthetic_federation, [10, 50, 50])
    strategy, recipe = ALGORITHMS.get("fedavg").build(
        family, None, clients_per_round=3, train=train
    )
    programs = Programs(family, recipe, seed=0)
    sim = Simulation(strategy, programs, clients, test, RoundSettings(rounds=1, seed=0), tmp_path)
    sim.setup()
    alone, together, executor = _both(sim)
    assert executor.grouped == [(0, 1, 2)]
    assert [_output(r).result.num_steps for r in together] == [1, 5, 5]
    _assert_agree(alone, together)


def _fallback_case(tmp_path) -> Simulation:
    return _simulation(tmp_path, "fjord", {**WIDTHS, "options.fjord.levels": [0.5, 1.0]})


def test_fjord_falls_back_to_the_sequential_executor_bit_for_bit(tmp_path):
    sim = _fallback_case(tmp_path)
    assert isinstance(sim.programs.recipe.forward, OrderedDropout)
    alone, together, executor = _both(sim)
    assert executor.grouped == []
    for a, b in zip(alone, together, strict=True):
        ra, rb = _output(a).result, _output(b).result
        assert all(torch.equal(ra.tensors[k], rb.tensors[k]) for k in ra.tensors)
        assert (ra.loss, ra.num_steps, ra.passes) == (rb.loss, rb.num_steps, rb.passes)


def test_a_group_that_raises_is_trained_sequentially_and_says_so(tmp_path, monkeypatch):
    """The vectorised step fails after the group drew its batches: the fall-back trains
    every client from untouched inputs, so the results are the sequential executor's."""
    sim = _simulation(tmp_path, "fedavg", {"train.momentum": 0.9})
    expected = SequentialExecutor().run(sim.programs, _jobs(sim), sim.clients, None)

    def failing(template, masked):
        def step(*args):
            raise RuntimeError("CUDA out of memory")

        return step

    monkeypatch.setattr(vectorised, "_vmapped_step", failing)
    executor = VectorisedExecutor()
    message = (
        r"clients \[0, 1, 2, 3, 4, 5\] raised RuntimeError: CUDA out of memory; "
        "training them one by one instead"
    )
    with pytest.warns(RuntimeWarning, match=message):
        got = executor.run(sim.programs, _jobs(sim), sim.clients, None)
    assert executor.grouped == []
    for a, b in zip(expected, got, strict=True):
        ra, rb = _output(a).result, _output(b).result
        assert all(torch.equal(ra.tensors[k], rb.tensors[k]) for k in ra.tensors)
        assert (ra.loss, ra.num_steps) == (rb.loss, rb.num_steps)


def test_a_client_with_non_finite_data_fails_alone(tmp_path):
    """Client 2's inputs are NaN: its result is non-finite and the engine excludes it; the
    clients trained beside it in the same stack still agree with the sequential executor."""
    sim = _simulation(tmp_path, "fedavg", {"train.momentum": 0.9})
    sim.clients[2].x_train.fill_(float("nan"))
    alone, together, _ = _both(sim)
    bad = _output(together[2]).result
    assert not all(bool(t.isfinite().all()) for t in bad.tensors.values())
    _assert_agree(alone[:2] + alone[3:], together[:2] + together[3:])
    sim.executor = VectorisedExecutor()
    outcome = sim.train(1, [j.task for j in _jobs(sim)])
    assert [(f.cid, f.kind) for f in outcome.failures] == [(2, "non-finite")]
    assert [r.cid for r in outcome.results] == [0, 1, 3, 4, 5]


def test_a_round_with_a_server_program_is_the_sequential_executors(tmp_path):
    sim = _simulation(tmp_path, "fedavg", {})
    seen = []

    class _Recording(SequentialExecutor):
        def run(self, programs, jobs, clients, server):
            seen.append(([j.task.cid for j in jobs], server))
            return super().run(programs, jobs, clients, None)

    executor = VectorisedExecutor()
    executor.sequential = _Recording()
    server = object()
    executor.run(sim.programs, _jobs(sim), sim.clients, server)  # type: ignore[arg-type]
    assert seen == [([0, 1, 2, 3, 4, 5], server)] and executor.grouped == []


class _Same:
    """A wrapper that changes nothing (at module level: wrappers must pickle)."""

    def __init__(self, inner):
        self.inner, self.cid, self.device = inner, inner.cid, inner.device

    def fit(self, *args, **kwargs):
        return self.inner.fit(*args, **kwargs)


def test_wrapped_programs_are_trained_sequentially(tmp_path):
    sim = _simulation(tmp_path, "fedavg", {})

    programs = Programs(sim.programs.family, sim.programs.recipe, seed=0, wrappers=[_Same])
    executor = VectorisedExecutor()
    executor.run(programs, _jobs(sim), sim.clients, None)
    assert executor.grouped == []


@pytest.mark.parametrize(
    ("recipe", "settings", "reason"),
    [
        (LocalRecipe(), LocalTraining(), None),
        (LocalRecipe(), LocalTraining(optimizer="adam"), "optimizer 'adam'"),
        (LocalRecipe(forward=OrderedDropout((0.5, 1.0), distill=False)), LocalTraining(),
         "forward OrderedDropout"),
        (LocalRecipe(loss_terms=(RademacherTerm(0.1),)), LocalTraining(),
         "loss terms ['RademacherTerm']"),
        (LocalRecipe(projections=(PartialSVT("w", (4, 4), 0.1, 1),)), LocalTraining(),
         "projections ['PartialSVT']"),
    ],
)  # fmt: skip
def test_unsupported_names_the_part_it_cannot_vectorise(recipe, settings, reason):
    got = unsupported(recipe, settings)
    assert got == reason
