"""The vectorised executor against the sequential one: the same clients' answers to 1e-5
after a round of at least 10 steps, for every kind of part that declares it vectorises
(generic and method parts, and parts written here, once, that the executor does not know);
padded steps that leave a finished client alone; the parts that declare they cannot, the
reasons the executor and the start banner give, and the fall-backs (bit for bit, since
they are the sequential executor)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import torch

from golden.harness import WIDTHS, configured
from hetfl.algorithms import ALGORITHMS
from hetfl.algorithms.fjord import OrderedDropout
from hetfl.config import validate
from hetfl.core.client.loop import LocalStep
from hetfl.core.client.program import Programs
from hetfl.core.client.recipe import LocalRecipe, TrainContext, Vectorises
from hetfl.core.client.regularisers import RademacherTerm
from hetfl.core.rng import torch_generator
from hetfl.core.training import LocalTraining
from hetfl.core.types import ClientOutput
from hetfl.engine.round_settings import RoundSettings
from hetfl.runner import build_simulation, start_banner
from hetfl.sim import ClientJob, SequentialExecutor, Simulation, TaskOutcome, vectorised
from hetfl.sim.vectorised import VectorisedExecutor, run_fallback

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
        # a projection (partial SVT, per client under vmap) and the step counter
        ("fedalrc", {"model.name": "linear", "options.fedalrc.theta": 3, "train.momentum": 0.9}, 1),
    ],
)
def test_agrees_with_the_sequential_executor(tmp_path, algorithm, dotted, groups):
    sim = _simulation(tmp_path, algorithm, dotted)
    alone, together, executor = _both(sim)
    steps = [_output(r).result.num_steps for r in alone]
    assert max(steps) >= 10 and min(steps) < max(steps)  # padded steps happened
    assert len(executor.grouped) == groups and executor.alone == {}
    assert sorted(c for group in executor.grouped for c in group) == [r.task.cid for r in alone]
    _assert_agree(alone, together)


def test_flanc_orthogonality_penalty_agrees_and_a_lone_capacity_says_why(tmp_path):
    """FLANC's loss term reads the client's bases from `ctx.params` (per client under vmap).
    Three clients, two capacities drawn until both appear: the two that share one are
    stacked, the third trains alone and the executor says why. (4 steps of 32 samples at
    the smallest capacities: the composed CNN is slow on a CPU. lambda 10 and lr 0.1: the
    banks start orthogonal, and with the penalty's weight and lr of the golden scenario it
    moves the weights by less than the tolerance; here by 4e-5.)"""
    dotted = {**WIDTHS, "model.name": "composed-cnn", "model.stages": None,
              "options.flanc": {"lambda_orth": 10.0, "levels": [0.25, 0.5]}, "train.lr": 0.1,
              "train.clients_per_round": 3, "train.batch_size": 32,
              "train.local_steps": 4}  # fmt: skip
    sim = _simulation(tmp_path, "flanc", dotted)
    alone, together, executor = _both(sim)
    assert executor.grouped == [(0, 1)]
    assert executor.alone == {5: "no other client shares its model, settings and payload"}
    _assert_agree(alone, together)


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


FJORD = "forward OrderedDropout: it draws a width per batch from the client's generator"


def test_fjord_falls_back_to_the_sequential_executor_bit_for_bit(tmp_path):
    sim = _fallback_case(tmp_path)
    assert isinstance(sim.programs.recipe.forward, OrderedDropout)
    alone, together, executor = _both(sim)
    assert executor.grouped == []
    assert sorted(executor.alone) == [0, 1, 2, 3, 4, 5]
    assert all(why.startswith(FJORD) for why in executor.alone.values())
    for a, b in zip(alone, together, strict=True):
        ra, rb = _output(a).result, _output(b).result
        assert all(torch.equal(ra.tensors[k], rb.tensors[k]) for k in ra.tensors)
        assert (ra.loss, ra.num_steps, ra.passes) == (rb.loss, rb.num_steps, rb.passes)


def test_a_group_that_raises_is_trained_sequentially_and_says_so(tmp_path, monkeypatch):
    """The vectorised step fails after the group drew its batches: the fall-back trains
    every client from untouched inputs, so the results are the sequential executor's."""
    sim = _simulation(tmp_path, "fedavg", {"train.momentum": 0.9})
    expected = SequentialExecutor().run(sim.programs, _jobs(sim), sim.clients, None)

    def failing(template, step):
        def step(*args):
            raise RuntimeError("CUDA out of memory")

        return step

    monkeypatch.setattr(vectorised, "stacked_gradient", failing)
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


def _halve(grads: dict[str, torch.Tensor], params: Any, ctx: TrainContext) -> None:
    """A gradient transform that declares nothing (a function has no `vectorises`)."""
    for g in grads.values():
        g.mul_(0.5)


@pytest.mark.parametrize(
    ("recipe", "settings", "reason"),
    [
        (LocalRecipe(), LocalTraining(), None),
        (LocalRecipe(), LocalTraining(optimizer="adam"),
         "optimizer Adam: torch's adam reads each tensor's step count as a Python number"),
        (LocalRecipe(forward=OrderedDropout((0.5, 1.0), distill=False)), LocalTraining(),
         FJORD),
        (LocalRecipe(loss_terms=(RademacherTerm(0.1),)), LocalTraining(),
         "loss term RademacherTerm: it opens its gate on the value of the batch's loss"),
        (LocalRecipe(grad_transforms=(_halve,)), LocalTraining(),
         "gradient transform _halve: declares no `vectorises`"),
    ],
)  # fmt: skip
def test_a_step_names_the_part_that_cannot_vectorise(recipe, settings, reason):
    got = LocalStep(recipe, settings).why_not_vectorised()
    assert got == reason if reason is None else got.startswith(reason)


def test_the_start_banner_says_why_every_client_falls_back(tmp_path):
    def banner(algorithm: str, dotted: dict[str, Any], run_dir: Path) -> str:
        cfg = validate(configured(algorithm, {**ROUND, **dotted, "executor": "vectorised"}))
        sim = build_simulation(cfg, run_dir, show_progress=False)
        sim.setup()
        return start_banner(cfg, sim, run_dir)

    fjord = {**WIDTHS, "options.fjord.levels": [0.5, 1.0]}
    falls_back = "  executor: vectorised, falling back to sequential for every client: " + FJORD
    assert falls_back in banner("fjord", fjord, tmp_path / "fjord")
    agrees = "  executor: vectorised (agrees with sequential to about 1e-5, not bit for bit), "
    assert agrees in banner("fedavg", {}, tmp_path / "fedavg")


def test_a_part_that_declares_nothing_trains_alone_and_says_why(tmp_path):
    sim = _simulation(tmp_path, "fedavg", {"train.momentum": 0.9})
    recipe = LocalRecipe(grad_transforms=(_halve,))
    programs = Programs(sim.programs.family, recipe, seed=0)
    why = run_fallback(programs, LocalTraining())
    assert why is not None and why.startswith("gradient transform _halve: declares no")
    executor = VectorisedExecutor()
    assert executor.describe(why).endswith(f"sequential for every client: {why}")
    expected = SequentialExecutor().run(programs, _jobs(sim), sim.clients, None)
    got = executor.run(programs, _jobs(sim), sim.clients, None)
    assert executor.grouped == [] and executor.alone == dict.fromkeys(range(6), why)
    for a, b in zip(expected, got, strict=True):
        ra, rb = _output(a).result, _output(b).result
        assert all(torch.equal(ra.tensors[k], rb.tensors[k]) for k in ra.tensors)


@dataclass(frozen=True)
class _PullBack:
    """A loss term written once, here: (mu / 2) s ||w - w_received||² over the received
    parameters, with s the share of the classes the client holds (a per-client constant),
    so that stacked clients must each get their own anchor, parameters and constant."""

    vectorises: ClassVar[Vectorises] = Vectorises.PER_CLIENT
    mu: float

    def __call__(
        self, outputs: torch.Tensor, y: torch.Tensor, per_sample: torch.Tensor, ctx: TrainContext
    ) -> torch.Tensor:
        assert ctx.info is None or ctx.info.labels  # the stacked step has no one's info
        share = ctx.constant(self, "share", lambda: _share(ctx, outputs))
        gaps = [(ctx.params[k] - w).pow(2).sum() for k, w in ctx.received.items()]
        return self.mu / 2 * share * torch.stack(gaps).sum()


def _share(ctx: TrainContext, outputs: torch.Tensor) -> torch.Tensor:
    assert ctx.info is not None
    return torch.tensor(len(ctx.info.labels) / outputs.shape[-1], device=outputs.device)


@dataclass(frozen=True)
class _Clamp:
    """A projection written once, here: every parameter clamped to [-limit, limit] after
    the step; elementwise, so it runs on the stack as it is."""

    vectorises: ClassVar[Vectorises] = Vectorises.ELEMENTWISE
    limit: float

    @torch.no_grad()
    def __call__(self, params: Mapping[str, torch.Tensor], ctx: TrainContext) -> None:
        for p in params.values():
            p.clamp_(-self.limit, self.limit)


@dataclass(frozen=True, eq=False)
class _Sizes:
    """A tracker written once, here: the number of parameter numbers its client had at
    each step (its own, not the stack's)."""

    vectorises: ClassVar[Vectorises] = Vectorises.PER_CLIENT

    def after_step(self, ctx: TrainContext) -> None:
        sizes = ctx.scratch(self).setdefault("sizes", [])
        sizes.append(sum(p.numel() for p in ctx.params.values()))

    def finish(self, ctx: TrainContext) -> dict[str, Any]:
        return {"sizes": ctx.scratch(self)["sizes"]}


def test_parts_written_once_run_in_both_executors(tmp_path):
    """Parts the executor has never heard of, declared per client (a loss term reading the
    parameters, the payload and a per-client constant; a tracker reading the parameters)
    and elementwise (a projection): stacked, and in agreement with their sequential
    training."""
    sim = _simulation(tmp_path, "fedavg", {"train.momentum": 0.9})
    recipe = LocalRecipe(
        loss_terms=(_PullBack(5.0),), projections=(_Clamp(0.2),), trackers=(_Sizes(),)
    )
    sim.programs = Programs(sim.programs.family, recipe, seed=0)
    shares = {len(sim.clients[c].labels) for c in sim.clients}
    assert len(shares) > 1  # the constant differs between the stacked clients
    alone, together, executor = _both(sim)
    assert executor.grouped == [(0, 1, 2, 3, 4, 5)]
    _assert_agree(alone, together)
    assert len(set(_output(alone[0]).result.extras["sizes"])) == 1  # extras agree (above)
    plain = SequentialExecutor().run(
        Programs(sim.programs.family, seed=0), _jobs(sim)[:1], sim.clients, None
    )
    assert _max_diff(_output(plain[0]).result.tensors, _output(alone[0]).result.tensors) > 1e-3


@dataclass(frozen=True)
class _LateConstant:
    """A loss term that makes its constant only from the second step on, after the
    executor's probe of each client's first forward."""

    vectorises: ClassVar[Vectorises] = Vectorises.PER_CLIENT

    def __call__(
        self, outputs: torch.Tensor, y: torch.Tensor, per_sample: torch.Tensor, ctx: TrainContext
    ) -> torch.Tensor | None:
        if ctx.step == 0:
            return None
        return ctx.constant(self, "late", lambda: torch.tensor(0.01)) * outputs.sum()


def test_a_constant_made_in_a_stacked_step_sends_the_group_back(synthetic_federation, tmp_path):
    """Its stacked step would have no client's context to make it from: the group is
    trained sequentially instead, and the warning names the part."""
    family, clients, test = _sizes_federation(synthetic_federation, [30, 30])
    programs = Programs(family, LocalRecipe(loss_terms=(_LateConstant(),)), seed=0)
    strategy, _ = ALGORITHMS.get("fedavg").build(
        family, None, clients_per_round=2, train=LocalTraining(lr=0.1, batch_size=10)
    )
    sim = Simulation(strategy, programs, clients, test, RoundSettings(rounds=1, seed=0), tmp_path)
    sim.setup()
    executor = VectorisedExecutor()
    with pytest.warns(RuntimeWarning, match="_LateConstant made its constant 'late' in a stack"):
        executor.run(programs, _jobs(sim), sim.clients, None)
    assert executor.grouped == []
    assert executor.alone == dict.fromkeys(
        [0, 1], "its group's vectorised training raised RuntimeError"
    )


#: HeteroFL at 4 widths, 8 clients all in the round, 2 at each width (fixed assignment).
FOUR_WIDTHS = {
    **WIDTHS,
    "options.heterofl": {"levels": [1.0, 0.5, 0.25, 0.125], "assignment": "fixed"},
    "data.num_clients": 8,
    "train.clients_per_round": 8,
    "train.batch_size": 16,
}


def _in_dtype(sim: Simulation, jobs: list[ClientJob], dtype: torch.dtype):
    """The round's jobs and clients with every floating-point tensor sent and trained in
    `dtype`: the received payload and the clients' inputs."""

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() else t

    cast_jobs = [
        replace(j, task=replace(j.task, payload={k: cast(v) for k, v in j.task.payload.items()}))
        for j in jobs
    ]
    clients = {c: replace(d, x_train=cast(d.x_train)) for c, d in sim.clients.items()}
    return cast_jobs, clients


@pytest.mark.parametrize("steps", [1, 10])
def test_four_widths_agree_to_rounding_that_float64_removes(tmp_path, steps):
    """HeteroFL, 4 widths stacked one after another (a group each): after 1 and after 10
    steps the results agree to 1e-5 in float32 (seen: 1.2e-7 and 6.0e-7), and the same run in
    float64 agrees to 1e-12 (seen: 1.1e-16 and 6.7e-16), so what differs is float32
    rounding: a vmapped convolution or matrix product sums in another order than the
    unbatched one. The groups' resident bytes are their data and their stacks: parameters
    (parameters, buffers, momentum, the received payload, the parts' constants)."""
    sim = _simulation(tmp_path, "heterofl", {**FOUR_WIDTHS, "train.local_steps": steps})
    gaps = {}
    default = torch.get_default_dtype()
    for dtype in (torch.float32, torch.float64):
        clients = _in_dtype(sim, [], dtype)[1]
        torch.set_default_dtype(dtype)  # what the parts make (masks, constants) follows
        try:  # each executor its own jobs: it draws from their generators
            alone = SequentialExecutor().run(
                sim.programs, _in_dtype(sim, _jobs(sim), dtype)[0], clients, None
            )
            executor = VectorisedExecutor()
            together = executor.run(
                sim.programs, _in_dtype(sim, _jobs(sim), dtype)[0], clients, None
            )
        finally:
            torch.set_default_dtype(default)
        assert executor.grouped == [(0, 1), (2, 3), (4, 5), (6, 7)] and executor.alone == {}
        assert {t.dtype for r in together for t in _output(r).result.tensors.values()} == {dtype}
        assert [_output(r).result.num_steps for r in together] == [steps] * 8
        gaps[dtype] = max(
            _max_diff(_output(a).result.tensors, _output(b).result.tensors)
            for a, b in zip(alone, together, strict=True)
        )
        if dtype is torch.float32:
            _assert_agree(alone, together)
            resident, float32 = executor.resident, together
    assert 0 < gaps[torch.float32] <= TOL
    assert gaps[torch.float64] <= 1e-12
    for group, held in zip(executor.grouped, resident, strict=True):
        data = sum(sim.clients[c].x_train.nbytes + sim.clients[c].y_train.nbytes for c in group)
        sent = sum(t.nbytes for c in group for t in _output(float32[c]).result.tensors.values())
        # parameters, momentum, received payload: 3 copies of what is sent (static BatchNorm
        # keeps no statistics); HeteroFL's masks of the clients' classes, 10 bools each
        assert held == data + 3 * sent + 2 * 10


def test_the_gpu_benchmark_runs_its_packed_round_at_smoke_scale(tmp_path, capsys, monkeypatch):
    """`benchmarks/bench_gpu.py --smoke`'s MNIST-sized round on the CPU: three sides, 4
    groups of 2 clients (2 steps each), the executors' results within the tolerance, every
    ratio printed (the figures themselves mean nothing on a CPU at this scale)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_gpu

    args = SimpleNamespace(reps=1, device="cpu", deterministic=True, max_stack=None)
    bench_gpu.packed_round(bench_gpu.SMOKE["mnist"], args, tmp_path)
    out = capsys.readouterr().out
    assert "vectorised groups: [2, 2, 2, 2] clients; alone: {}" in out
    assert "80 samples in the round" in out  # 8 clients x 1 epoch x 10 samples
    diff = float(out.split("max |diff| sequential against vectorised: ")[1].split()[0])
    assert diff <= TOL
    for side in ("sequential", "vectorised", "plain"):
        assert f"{side}: round " in out
    assert "ratio vectorised/sequential samples/s: " in out
    assert "ratio vectorised/plain samples/s: " in out


def test_max_stack_splits_a_group_into_stacks_that_still_agree(tmp_path):
    """One group of 6 clients, at most 4 a stack: two stacks of 3 (near-equal sizes, job
    order) trained one after another, which between them hold what the whole group's stack
    holds, and whose results agree with the sequential executor's as the whole group's do."""
    sim = _simulation(tmp_path, "fedavg", {"train.momentum": 0.9})
    whole = VectorisedExecutor()
    whole.run(sim.programs, _jobs(sim), sim.clients, None)
    split = VectorisedExecutor(max_stack=4)
    together = split.run(sim.programs, _jobs(sim), sim.clients, None)
    assert whole.grouped == [(0, 1, 2, 3, 4, 5)]
    assert split.grouped == [(0, 1, 2), (3, 4, 5)] and split.alone == {}
    assert sum(split.resident) == whole.resident[0]
    _assert_agree(SequentialExecutor().run(sim.programs, _jobs(sim), sim.clients, None), together)
    with pytest.raises(ValueError, match="max_stack must be at least 1 client, got 0"):
        VectorisedExecutor(max_stack=0)
