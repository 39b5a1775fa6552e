"""One job: the vectorised executor, clients of a round with the same model trained together.

For a GPU, where one small client's step leaves the device mostly idle. Clients whose jobs
have the same spec, the same training settings and the same payload names form a group;
their tensors are stacked on a leading client dimension (K, ...), and every step runs the
one local step (`hetfl.core.client.loop.LocalStep`) on the stack (`hetfl.core.client.stacked`):
its loss's gradient under one `torch.func.vmap` (`torch.func.functional_call` on the shared
template), then its update, each part as it declares (`hetfl.core.client.recipe.Vectorises`):
a per-client part under `vmap`, an elementwise one (SGD, the proximal term) on the stack as
it is. On a CPU it is slower than the sequential executor: there the lever is processes.

What it vectorises is what the parts declare; no list of parts is kept here. A client
trains alone, in the sequential executor, when a part of its step declares why it cannot
(FjORD's per-batch width draw, FedALRC's gated Rademacher term, Adam), when its program is
wrapped (an attack, a fault), when its inputs are augmented or its model has dropout (draws
per client, batch by batch), when it has no step, or when no other client shares its group;
`alone` says why for each, and for a reason that holds for the whole run the start banner
says it (`describe`). A round with a server program (split learning exchanges with the
server every batch) runs entirely in the sequential executor.

Scheduling and memory. The round's groups are formed in one pass over its jobs (for
HeteroFL, one per width) and trained one after another on the device. A group's data is one
tensor there (a copy of its members' training sets, concatenated), and its whole step plan
(at each step, which clients step and on which batch: `_schedule`) is made on the host
before training and sent in one copy, so the step loop sends nothing to the device and waits
for nothing; a group waits once, at its end, when its losses come back in one copy. Between
steps a group holds its data and its stack (`VectorisedExecutor.resident`: parameters,
buffers, optimiser state, the received payload, the parts' constants; for HeteroFL with
momentum, three copies of its members' parameters); a step adds, for the clients that step,
their gradients, one batch's activations each and, when only some step, a copy of their
rows. A group's stack is freed before the next group is built, so a round's peak is its
largest group's, plus the trained tensors of the clients done so far (which the sequential
executor keeps too), plus what the run holds throughout (the global model, the clients'
data); not the sum over the groups. The activations grow with the stack (K clients' batches
at once where a sequential step holds one's), so a wide group's step dominates; with
`max_stack` a group is split into stacks of at most that many clients, trained one after
another, which bounds a step's gradients and activations at `max_stack` clients'. A group
too large for the device raises (out of memory) and is trained sequentially instead
(Failures, below).

What it reproduces. Each client draws its mini-batches from its own generator exactly as
`hetfl.core.client.loop.batch_order` does in its sequential training, in the same order, and
starts from the same tensors (`ClientProgram.own_tensors`); its answer is built by the same
`ClientProgram.output`. A part's per-client constants (`TrainContext.constant`: HeteroFL's
mask of a client's classes) are made on each client's own context by one forward of its
first batch before training, and stacked. A client whose batches run out before the group's
longest is not stepped: each step trains only the clients that have a batch at that step,
and among those one sub-stack per batch size (the last batch of an epoch may be short),
gathered from the stack and written back, so a finished client's parameters, momentum and
BatchNorm statistics are not touched at all (no zero-gradient step, which momentum and
weight decay would still move). The outputs agree with `SequentialExecutor`'s to about
1e-5, not bit for bit: a vmapped convolution (a grouped one) or matrix product sums in
another order than the unbatched one, and training amplifies the difference. In float64 the
two agree to 1e-13 or better, so what remains is float32 rounding (HeteroFL at 4 widths on
digits: 1.2e-7 after 1 step and 6.0e-7 after 10 in float32, 1.1e-16 and 6.7e-16 in
float64; tests/test_vectorised_executor.py); but it can grow past
1e-5 where a step is ill-conditioned: a BatchNorm layer fed a last batch of one sample
(6.5e-4 after two rounds on digits), or a max-pool CNN on Fashion-MNIST at momentum 0.9
(`benchmarks/bench_vectorised.py`: 4 of 20 clients 3e-5 to 4e-4 after 10 steps, the other
16 below 5e-6). Stored pixels are standardised per stacked batch.

Failures: a group whose vectorised training raises is run again in the sequential executor,
job by job, from untouched inputs (each job's generator is copied, never drawn from), with
a `RuntimeWarning` that says so; so a client that raises is reported as its own "raised"
outcome. A client whose result is invalid (non-finite tensors) is its own: vmapped clients
share no arithmetic, and the engine checks each result. A group's measured wall time is
shared equally by its clients (`TaskOutcome.wall_s`).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import torch
from torch import nn

from hetfl.core.client.dropout import SeededDropout
from hetfl.core.client.loop import LocalStep, Tally, batch_order
from hetfl.core.client.program import ClientProgram, Programs
from hetfl.core.client.recipe import TrainContext
from hetfl.core.client.stacked import on_stack, stacked_gradient
from hetfl.core.client.trainable import model_call, trainable_names
from hetfl.core.pixels import model_inputs
from hetfl.core.roles import tensor_roles
from hetfl.core.server_program import ServerProgram
from hetfl.core.spec import Spec
from hetfl.core.training import LocalTraining
from hetfl.core.types import ClientData, ClientOutput, State
from hetfl.sim.executor import SequentialExecutor
from hetfl.sim.tasks import ClientJob, TaskOutcome

T = TypeVar("T")
R = TypeVar("R")

AGREEMENT = "agrees with sequential to about 1e-5, not bit for bit"
WRAPPED = "its program is wrapped (an attack or a fault changes what the client does)"


def run_fallback(programs: Programs, settings: LocalTraining) -> str | None:
    """Why no client of a run with `programs` and `settings` can be trained stacked, known
    before it starts: wrapped programs, or a part of the step that cannot (None if none)."""
    if programs.wrappers:
        return WRAPPED
    return LocalStep(programs.recipe, settings).why_not_vectorised()


def _has_dropout(template: nn.Module) -> bool:
    """Dropout draws per client from its own generator, which a vmapped forward cannot."""
    return any(isinstance(m, SeededDropout) and m.p > 0 for m in template.modules())


@dataclass(frozen=True)
class _GroupKey:
    """What clients trained in one stack share: the model, the settings, which tensors were
    sent (the proximal anchor) and the shape of an input."""

    spec: Spec
    settings: LocalTraining
    payload: tuple[str, ...]
    input_shape: tuple[int, ...]


@dataclass(frozen=True)
class _Member:
    """One client of a group: its job, its (honest) program and its data."""

    job: ClientJob
    program: ClientProgram
    data: ClientData


class VectorisedExecutor:
    """Trains groups of same-spec clients together with `torch.func.vmap` (see the module
    docstring); everything it cannot vectorise goes to a `SequentialExecutor`. Results agree
    with the sequential executor's to about 1e-5, not bit for bit."""

    def __init__(self, max_stack: int | None = None) -> None:
        if max_stack is not None and max_stack < 1:
            raise ValueError(f"max_stack must be at least 1 client, got {max_stack}")
        #: The most clients one stack trains (None: a whole group). A group of more is
        #: split into stacks of near-equal sizes, in job order, trained one after another:
        #: a step's gradients and activations grow with the stack, so this bounds them.
        self.max_stack = max_stack
        self.sequential = SequentialExecutor()
        #: The client ids trained together in the last `run`, one tuple per stack (a group,
        #: or its part under `max_stack`; one that fell back to the sequential executor is
        #: not listed).
        self.grouped: list[tuple[int, ...]] = []
        #: The bytes each stack of `grouped` held on its device between steps (its data and
        #: its tensors); a round's peak is its largest stack's (see the module docstring).
        self.resident: list[int] = []
        #: The client ids trained alone in the last `run`, each with why.
        self.alone: dict[int, str] = {}

    def share(self, data: T) -> T:
        return data

    def map(
        self,
        programs: Programs,
        unit: Callable[[Any, T], R],
        items: Sequence[T],
        costs: Sequence[float] | None = None,
    ) -> list[R]:
        """Evaluation units run in the sequential executor (they are one forward each)."""
        return self.sequential.map(programs, unit, items)

    def close(self) -> None:
        self.sequential.close()

    def describe(self, fallback: str | None = None) -> str:
        """The banner's line; with `fallback` (`run_fallback`), that every client will be
        trained sequentially, and why."""
        if fallback is None:
            return f"vectorised ({AGREEMENT})"
        return f"vectorised, falling back to sequential for every client: {fallback}"

    def run(
        self,
        programs: Programs,
        jobs: Sequence[ClientJob],
        clients: Mapping[int, ClientData],
        server: ServerProgram | None,
    ) -> list[TaskOutcome]:
        self.grouped, self.resident = [], []
        if server is not None:
            self.alone = {job.task.cid: "the round has a server program" for job in jobs}
            return self.sequential.run(programs, jobs, clients, server)
        groups, self.alone = _groups(programs, jobs, clients)
        groups = [part for group in groups for part in _split(group, self.max_stack)]
        done: dict[int, TaskOutcome] = {
            i: self.sequential.run(programs, [job], clients, None)[0]
            for i, job in enumerate(jobs)
            if job.task.cid in self.alone
        }
        for group in groups:
            done.update(self._run_group(programs, group, clients))
        return [done[i] for i in range(len(jobs))]

    def _run_group(
        self, programs: Programs, group: dict[int, _Member], clients: Mapping[int, ClientData]
    ) -> dict[int, TaskOutcome]:
        """The group's outcomes by job position; if its vectorised training raises, its jobs
        one by one in the sequential executor instead (their inputs are untouched), once the
        exception, whose traceback holds the group's stack, is gone (out of memory)."""
        members = list(group.values())
        started = time.perf_counter()
        try:
            template = programs.models.model_for(members[0].job.task.spec)
            outputs, resident = train_together(template, members)
        except Exception as exc:
            cids = [m.job.task.cid for m in members]
            warnings.warn(
                f"vectorised training of clients {cids} raised {type(exc).__name__}: {exc}; "
                "training them one by one instead",
                RuntimeWarning,
                stacklevel=2,
            )
            for cid in cids:
                self.alone[cid] = f"its group's vectorised training raised {type(exc).__name__}"
            outputs = []
        if not outputs:
            return {
                i: self.sequential.run(programs, [m.job], clients, None)[0]
                for i, m in group.items()
            }
        wall_s = (time.perf_counter() - started) / len(members)
        self.grouped.append(tuple(m.job.task.cid for m in members))
        self.resident.append(resident)
        return {
            i: TaskOutcome(m.job.task, out, wall_s)
            for (i, m), out in zip(group.items(), outputs, strict=True)
        }


def _why_alone(
    programs: Programs, program: ClientProgram, job: ClientJob, data: ClientData
) -> str | None:
    """Why `job`'s client, with its honest `program`, cannot be trained in a stack (None if
    it can)."""
    settings = job.task.config
    reason = LocalStep(program.recipe, settings).why_not_vectorised()
    if reason is not None:
        return reason
    if settings.num_steps(data.n_train) < 1:
        return "it has no training step"
    if data.augment is not None and data.augment.active:
        return "its inputs are augmented (draws per client, batch by batch)"
    if _has_dropout(programs.models.model_for(job.task.spec)):
        return "its model has dropout (masks drawn per client, batch by batch)"
    return None


def _groups(
    programs: Programs, jobs: Sequence[ClientJob], clients: Mapping[int, ClientData]
) -> tuple[list[dict[int, _Member]], dict[int, str]]:
    """Groups (by job position, in job order) of two or more clients with the same key, and
    the clients to train alone in the sequential executor, with why."""
    by_key: dict[_GroupKey, dict[int, _Member]] = {}
    alone: dict[int, str] = {}
    for i, job in enumerate(jobs):
        task, data = job.task, clients[job.task.cid]
        program = programs.program_for(task.cid)
        if type(program) is not ClientProgram:
            alone[task.cid] = WRAPPED
            continue
        reason = _why_alone(programs, program, job, data)
        if reason is not None:
            alone[task.cid] = reason
            continue
        key = _GroupKey(task.spec, task.config, tuple(task.payload), tuple(data.x_train.shape[1:]))
        by_key.setdefault(key, {})[i] = _Member(job, program, data)
    groups = [group for group in by_key.values() if len(group) > 1]
    for group in by_key.values():
        if len(group) == 1:
            [member] = group.values()
            alone[member.job.task.cid] = "no other client shares its model, settings and payload"
    return groups, alone


def _split(group: dict[int, _Member], most: int | None) -> list[dict[int, _Member]]:
    """`group` as stacks of at most `most` clients, of near-equal sizes, in job order."""
    items = list(group.items())
    parts = 1 if most is None else -(-len(items) // most)
    size, extra = divmod(len(items), parts)
    out, at = [], 0
    for part in range(parts):
        end = at + size + (part < extra)
        out.append(dict(items[at:end]))
        at = end
    return out


@dataclass
class _Stack:
    """The group's tensors stacked on a leading client dimension (K, ...): trainable
    `params`, `buffers` (BatchNorm statistics, frozen tensors), the optimiser's `state`
    (by its `hetfl.core.client.optim` names), the `received` payload (the proximal anchor)
    and the parts' `constants` (`TrainContext.constant`); the last two read only."""

    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    state: dict[str, torch.Tensor]
    received: dict[str, torch.Tensor]
    constants: dict[tuple[int, str], torch.Tensor]

    def rows(self, idx: torch.Tensor) -> _Stack:
        """Copies of the rows `idx` (a sub-stack of some clients)."""
        p, b, s, r = ({k: v[idx] for k, v in part.items()} for part in self._tensors())
        return _Stack(p, b, s, r, {k: v[idx] for k, v in self.constants.items()})

    def put(self, idx: torch.Tensor, rows: _Stack) -> None:
        """Write a trained sub-stack back into rows `idx`; no other row changes."""
        for mine, theirs in zip(self._tensors()[:3], rows._tensors()[:3], strict=True):
            for k, v in mine.items():
                v.index_copy_(0, idx, theirs[k])

    def _tensors(self) -> tuple[dict[str, torch.Tensor], ...]:
        return self.params, self.buffers, self.state, self.received


def _copy_generator(generator: torch.Generator) -> torch.Generator:
    """A generator in `generator`'s state, so that drawing from it leaves the job's own
    untouched (a fall-back to the sequential executor must draw the same batches)."""
    copy = torch.Generator(device=generator.device)
    copy.set_state(generator.get_state())
    return copy


@dataclass(frozen=True)
class _Pass:
    """One sub-stack's step: the `rows` (clients, in the group's order) that have a batch
    of one size at `step`, their row numbers on the device (None: every row) and their
    batches (K', B), indices into the group's data on the device."""

    step: int
    rows: list[int]
    index: torch.Tensor | None
    batch: torch.Tensor


def _schedule(
    batches: Sequence[Sequence[torch.Tensor]], starts: Sequence[int], device: torch.device
) -> list[_Pass]:
    """Every step of the group, in order: at each step, one pass per batch size among the
    clients that have a batch there (the last batch of an epoch may be short; a finished
    client has none). Client k's batch indices are offset by `starts[k]` into the group's
    data. Every index is made on the host and sent to the device in one copy, so that the
    step loop sends nothing and waits for nothing."""
    plan: list[tuple[int, list[int]]] = []
    pieces: list[torch.Tensor] = []
    for step in range(max(len(own) for own in batches)):
        by_size: dict[int, list[int]] = {}
        for k, own in enumerate(batches):
            if step < len(own):
                by_size.setdefault(int(own[step].shape[0]), []).append(k)
        for rows in by_size.values():
            plan.append((step, rows))
            pieces.append(torch.tensor(rows))
            pieces.extend(batches[k][step].cpu() + starts[k] for k in rows)
    flat = torch.cat(pieces).to(device)
    passes, at = [], 0
    for step, rows in plan:
        index, at = flat[at : at + len(rows)], at + len(rows)
        size = len(rows) * int(batches[rows[0]][step].shape[0])
        batch, at = flat[at : at + size].view(len(rows), -1), at + size
        whole = len(rows) == len(batches)
        passes.append(_Pass(step, rows, None if whole else index, batch))
    return passes


def _bytes_of(tensors: Sequence[Mapping[Any, torch.Tensor]]) -> int:
    """The bytes of the tensors of `tensors` (dicts of them)."""
    return sum(t.numel() * t.element_size() for part in tensors for t in part.values())


def train_together(
    template: nn.Module, members: Sequence[_Member]
) -> tuple[list[ClientOutput], int]:
    """Train the members (same spec, settings and payload names, a step whose parts all
    vectorise) on one stack; each one's `ClientOutput`, as its `ClientProgram.fit` would
    return it, and the bytes the group held on its device between steps."""
    group = _GroupTraining(template, members)
    for one in group.passes:
        group.step(one)
    return group.outputs(), group.resident_bytes()


class _GroupTraining:
    """One group's local training on one stack (rows: the members, in order)."""

    def __init__(self, template: nn.Module, members: Sequence[_Member]) -> None:
        first = members[0]
        self.members = members
        self.settings = first.job.task.config
        template.train()
        self.owns = [m.program.own_tensors(m.job.task, m.job.info, m.job.private) for m in members]
        trainable = trainable_names(template)
        self.names = [k for k in self.owns[0] if k in trainable]
        self.device = self.owns[0][self.names[0]].device
        generators = [_copy_generator(m.job.generator) for m in members]
        # All members' data in one tensor on the device, so that a step gathers its
        # batches there at once; row k's batches index it past the data of rows before k.
        self.x = torch.cat([m.data.x_train for m in members]).to(self.device)
        self.y = torch.cat([m.data.y_train for m in members]).to(self.device)
        starts = [0]
        for m in members[:-1]:
            starts.append(starts[-1] + m.data.n_train)
        orders = [
            batch_order(m.data.n_train, self.settings, g)
            for m, g in zip(members, generators, strict=True)
        ]
        self.passes = _schedule(orders, starts, self.device)
        self.pixels = first.data.pixels  # one dataset's: the same for every member
        self.step_def = LocalStep.of(first.program.recipe, self.settings, template, self.names)
        roles = tensor_roles(template)
        self.contexts = [
            TrainContext(m.job.task, m.job.task.payload, g, self.settings, m.job.info, roles=roles)
            for m, g in zip(members, generators, strict=True)
        ]
        self.used = self._probe(template)
        self.kept = [self._restored(m, own) for m, own in zip(members, self.owns, strict=True)]
        self.stack = self._stacked()
        # The stack's context: one client's in what all share (task spec, settings,
        # roles); its per-client tensors are the stack's rows; no constant is made in it.
        self.ctx = replace(
            self.contexts[0],
            info=None,
            received=self.stack.received,
            constants=self.stack.constants,
            constants_made=True,
        )
        self.gradient = stacked_gradient(template, self.step_def)
        for k, ctx in enumerate(self.contexts):  # views of its rows, for the trackers
            ctx.params = {n: v[k] for n, v in self.stack.params.items()}
        self.losses: list[tuple[list[int], int, torch.Tensor]] = []

    def _first_batch(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        first = next(p for p in self.passes if k in p.rows)  # step 0: every client has one
        idx = first.batch[first.rows.index(k)]
        return model_inputs(self.x[idx], self.pixels), self.y[idx]

    def _probe(self, template: nn.Module) -> set[str]:
        """One unbatched forward of each member's first batch on copies of its tensors, in
        its own context, so that its parts make their constants there; the first member's
        also back-propagated, for the names of the parameters the step uses. Sequential
        training steps only parameters that get a gradient; a vmapped gradient gives the
        others zeros, which weight decay and momentum would still move."""
        used: set[str] = set()
        for k, (own, ctx) in enumerate(zip(self.owns, self.contexts, strict=True)):
            if k > 0 and not self.contexts[0].constants:
                break  # the parts make no constants: nothing more to learn
            params = {n: own[n].detach().clone().requires_grad_(k == 0) for n in self.names}
            buffers = {n: v.clone() for n, v in own.items() if n not in params}
            x, y = self._first_batch(k)
            # `replace` keeps `ctx.constants` (the same dict): the constants land there.
            probe = replace(ctx, params=params, buffers=buffers, batch=(x, y))
            with torch.set_grad_enabled(k == 0):
                total, _ = self.step_def.loss(model_call(template, params, buffers), x, y, probe)
            if k == 0:
                grads = torch.autograd.grad(total, list(params.values()), allow_unused=True)
                used = {n for n, g in zip(params, grads, strict=True) if g is not None}
        return used

    def _restored(self, member: _Member, own: Mapping[str, torch.Tensor]) -> State:
        """The optimiser state the client kept that still fits (`Optimiser.restore`)."""
        if not self.settings.keep_momentum:
            return {}
        optimiser = self.step_def.optimiser
        return optimiser.restore(member.job.private, {k: own[k] for k in self.names})

    def _stacked(self) -> _Stack:
        """The members' tensors stacked. The optimiser state of the used parameters is
        completed per client (`Optimiser.full_state`: what a client did not keep starts
        where its first step gives what a fresh state gives), in the order the optimiser
        creates it."""
        owns, members = self.owns, self.members
        stacked = {k: torch.stack([own[k] for own in owns]) for k in owns[0]}
        order = [k for group in self.step_def.groups for k in group.names if k in self.used]
        full = [
            self.step_def.optimiser.full_state(kept, {k: own[k] for k in order})
            for kept, own in zip(self.kept, owns, strict=True)
        ]
        keys = list(self.step_def.optimiser.full_state({}, {k: owns[0][k] for k in order}))
        state = {k: torch.stack([f[k].to(self.device) for f in full]) for k in keys}
        payload = members[0].job.task.payload
        received = {
            k: torch.stack([m.job.task.payload[k].to(self.device) for m in members])
            for k in self.names
            if k in payload
        }
        constants = {
            key: torch.stack([ctx.constants[key] for ctx in self.contexts])
            for key in self.contexts[0].constants
        }
        params = {k: stacked[k] for k in self.names}
        buffers = {k: v for k, v in stacked.items() if k not in params}
        return _Stack(params, buffers, state, received, constants)

    def resident_bytes(self) -> int:
        """The bytes the group holds on its device between steps: its data and its stack."""
        return _bytes_of([{"x": self.x, "y": self.y}, *self.stack._tensors(), self.stack.constants])

    def step(self, one: _Pass) -> None:
        """One step of the rows `one.rows` (batches of one size): the loss's gradient
        (vmapped), the update, the trackers; other rows are not touched."""
        rows = self.stack if one.index is None else self.stack.rows(one.index)
        x, y = model_inputs(self.x[one.batch], self.pixels), self.y[one.batch]  # (K', B, ...)
        ctx = replace(
            self.ctx,
            received=rows.received,
            constants=rows.constants,
            params=rows.params,
            step=one.step,
        )
        g, (loss, rows.buffers) = self.gradient(rows.params, rows.buffers, x, y, ctx)
        grads = {k: g[k] for k in self.names if k in self.used}
        self.step_def.update(
            {"grads": grads, "params": rows.params, "state": rows.state}, ctx, on_stack
        )
        if one.index is not None:
            self.stack.put(one.index, rows)
        self.losses.append((one.rows, int(y.shape[1]), loss))
        for k in one.rows:
            self.contexts[k].step = one.step
            self.step_def.observe(self.contexts[k])

    def outputs(self) -> list[ClientOutput]:
        """Each member's answer, from its rows of the stack and its steps' losses (all
        brought to the host in one copy: the group's one wait for its device)."""
        tallies = [Tally() for _ in self.members]
        values = iter(torch.cat([loss for _, _, loss in self.losses]).tolist())
        for ks, size, _ in self.losses:
            for k in ks:
                tallies[k].add(next(values), size, recorded=False)
        stacked = {**self.stack.params, **self.stack.buffers}
        out = []
        for k, m in enumerate(self.members):
            own = {name: stacked[name][k].clone() for name in self.owns[k]}
            state: State = {}
            if self.settings.keep_momentum:
                state = {n: v.detach().clone() for n, v in self.kept[k].items()}
                state.update({n: v[k].clone() for n, v in self.stack.state.items()})
            stats = tallies[k].stats(state, self.step_def.finish(self.contexts[k]))
            out.append(m.program.output(m.job.task, m.data, own, stats))
        return out
