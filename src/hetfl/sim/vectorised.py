"""One job: the vectorised executor, clients of a round with the same model trained together.

For a GPU, where one small client's step leaves the device mostly idle. Clients whose jobs
have the same spec, the same training settings and the same payload names form a group;
their tensors are stacked on a leading client dimension, and every step runs one
`torch.func.vmap` of the gradient of the loss (`torch.func.functional_call` on the shared
template) over the stack, then one optimiser update of the whole stack (PyTorch's
functional SGD is elementwise, so `hetfl.core.local.optim.SGD` runs on stacked tensors as
it is). On a CPU it is slower than the sequential executor: there the lever is processes.

What it reproduces. Each client draws its mini-batches from its own generator exactly as
`hetfl.core.local.loop.batch_order` does in its sequential training, in the same order, and
starts from the same tensors (`ClientProgram.own_tensors`); its answer is built by the same
`ClientProgram.output`. A client whose batches run out before the group's longest is not
stepped: each step trains only the clients that have a batch at that step, and among those
one sub-stack per batch size (the last batch of an epoch may be short), gathered from the
stack and written back, so a finished client's parameters, momentum and BatchNorm statistics
are not touched at all (no zero-gradient step, which momentum and weight decay would still
move). The outputs agree with `SequentialExecutor`'s to about 1e-5, not bit for bit: a
vmapped convolution (a grouped one) or matrix product sums in another order than the
unbatched one, and training amplifies the difference. In float64 the two agree to 1e-13 or
better, so what remains is float32 rounding; but it can grow past 1e-5 where a step is
ill-conditioned: a BatchNorm layer fed a last batch of one sample (6.5e-4 after two rounds on
digits), or a max-pool CNN on Fashion-MNIST at momentum 0.9 (`benchmarks/bench_vectorised.py`:
4 of 20 clients 3e-5 to 4e-4 after 10 steps, the other 16 below 5e-6).

What it vectorises, decided from the recipe's parts against explicit lists (anything else
runs in the sequential executor, job by job): the forwards `CrossEntropy` and
`MaskedCrossEntropy` (the client's absent classes masked per client), no loss terms, the
gradient transform `ProximalTerm` (elementwise, run on the stacked tensors with the stacked
payload as its anchor) and the settings' gradient clipping (one norm per client), no
projections, the tracker `StepNormaliser` (run per client: it counts steps), the `Autograd`
backward, and the SGD optimiser (momentum, weight decay, kept momentum). So FedAvg,
FedProx, FedNova and HeteroFL (per width level: a level is a spec) are vectorised; FjORD's
ordered dropout, FedALRC's Rademacher term and thresholding, Adam, models with dropout,
wrapped programs (attacks, faults), clients with augmentation (their draws are per
client, batch by batch), clients without a step and groups of one are not. Stored pixels
are standardised per stacked batch.
Server programs (split learning) exchange with the server every batch: a round with one
runs entirely in the sequential executor.

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
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from hetfl.core.client import ClientProgram, Programs, trainable_names
from hetfl.core.dropout import SeededDropout
from hetfl.core.local.loop import LocalStats, batch_order, grad_transforms
from hetfl.core.local.optim import MOMENTUM, optimiser_for, param_groups
from hetfl.core.local.parts import Autograd, CrossEntropy, LocalRecipe, TrainContext
from hetfl.core.local.terms import (
    ClipGradNorm,
    MaskedCrossEntropy,
    ProximalTerm,
    StepNormaliser,
    kept_classes,
)
from hetfl.core.pixels import model_inputs
from hetfl.core.server_program import ServerProgram
from hetfl.core.spec import Spec
from hetfl.core.training import LocalTraining
from hetfl.core.types import ClientData, ClientOutput, State
from hetfl.sim.executor import SequentialExecutor
from hetfl.sim.tasks import ClientJob, TaskOutcome

T = TypeVar("T")
R = TypeVar("R")

#: The parts the vectorised step runs; a recipe with any other part is trained sequentially.
FORWARDS = (CrossEntropy, MaskedCrossEntropy)
GRAD_TRANSFORMS = (ProximalTerm,)
TRACKERS = (StepNormaliser,)
BACKWARDS = (Autograd,)


def unsupported(recipe: LocalRecipe, settings: LocalTraining) -> str | None:
    """Why clients trained with `recipe` and `settings` cannot be vectorised, or None."""
    if not isinstance(recipe.forward, FORWARDS):
        return f"forward {type(recipe.forward).__name__}"
    if recipe.loss_terms:
        return f"loss terms {[type(t).__name__ for t in recipe.loss_terms]}"
    odd = [t for t in recipe.grad_transforms if not isinstance(t, GRAD_TRANSFORMS)]
    if odd:
        return f"gradient transforms {[type(t).__name__ for t in odd]}"
    if recipe.projections:
        return f"projections {[type(p).__name__ for p in recipe.projections]}"
    unknown = [t for t in recipe.trackers if not isinstance(t, TRACKERS)]
    if unknown:
        return f"trackers {[type(t).__name__ for t in unknown]}"
    if not isinstance(recipe.backward, BACKWARDS):
        return f"backward {type(recipe.backward).__name__}"
    if settings.optimizer != "sgd":
        return f"optimizer {settings.optimizer!r}"
    return None


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

    def __init__(self) -> None:
        self.sequential = SequentialExecutor()
        #: The client ids trained together in the last `run`, one tuple per group (a group
        #: that fell back to the sequential executor is not listed).
        self.grouped: list[tuple[int, ...]] = []

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

    def describe(self) -> str:
        return "vectorised (agrees with sequential to about 1e-5, not bit for bit)"

    def run(
        self,
        programs: Programs,
        jobs: Sequence[ClientJob],
        clients: Mapping[int, ClientData],
        server: ServerProgram | None,
    ) -> list[TaskOutcome]:
        if server is not None:
            return self.sequential.run(programs, jobs, clients, server)
        groups, alone = _groups(programs, jobs, clients)
        self.grouped = []
        done: dict[int, TaskOutcome] = {}
        for group in groups:
            done.update(self._run_group(programs, group, clients))
        for i in alone:
            [done[i]] = self.sequential.run(programs, [jobs[i]], clients, None)
        return [done[i] for i in range(len(jobs))]

    def _run_group(
        self, programs: Programs, group: dict[int, _Member], clients: Mapping[int, ClientData]
    ) -> dict[int, TaskOutcome]:
        """The group's outcomes by job position; if its vectorised training raises, its jobs
        one by one in the sequential executor instead (their inputs are untouched)."""
        members = list(group.values())
        started = time.perf_counter()
        try:
            outputs = train_together(programs.models.model_for(members[0].job.task.spec), members)
        except Exception as exc:
            cids = [m.job.task.cid for m in members]
            warnings.warn(
                f"vectorised training of clients {cids} raised {type(exc).__name__}: {exc}; "
                "training them one by one instead",
                RuntimeWarning,
                stacklevel=2,
            )
            return {
                i: self.sequential.run(programs, [m.job], clients, None)[0]
                for i, m in group.items()
            }
        wall_s = (time.perf_counter() - started) / len(members)
        self.grouped.append(tuple(m.job.task.cid for m in members))
        return {
            i: TaskOutcome(m.job.task, out, wall_s)
            for (i, m), out in zip(group.items(), outputs, strict=True)
        }


def _groups(
    programs: Programs, jobs: Sequence[ClientJob], clients: Mapping[int, ClientData]
) -> tuple[list[dict[int, _Member]], list[int]]:
    """Groups (by job position, in job order) of two or more vectorisable clients with the
    same key, and the positions of the jobs to run alone in the sequential executor."""
    by_key: dict[_GroupKey, dict[int, _Member]] = {}
    alone: list[int] = []
    for i, job in enumerate(jobs):
        task, data = job.task, clients[job.task.cid]
        program = programs.program_for(task.cid)
        if (
            type(program) is not ClientProgram  # a wrapper changes what the client does
            or unsupported(program.recipe, task.config) is not None
            or task.config.num_steps(data.n_train) < 1
            or (data.augment is not None and data.augment.active)
            or _has_dropout(programs.models.model_for(task.spec))
        ):
            alone.append(i)
            continue
        key = _GroupKey(task.spec, task.config, tuple(task.payload), tuple(data.x_train.shape[1:]))
        by_key.setdefault(key, {})[i] = _Member(job, program, data)
    groups = [group for group in by_key.values() if len(group) > 1]
    alone += [i for group in by_key.values() if len(group) == 1 for i in group]
    return groups, sorted(alone)


@dataclass
class _Stack:
    """The group's tensors stacked on a leading client dimension (K, ...): trainable
    `params`, `buffers` (BatchNorm statistics, frozen tensors), the optimiser's `state`
    (momentum buffers, by their `hetfl.core.local.optim` names) and the `received` payload
    (the proximal anchor; read only)."""

    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    state: dict[str, torch.Tensor]
    received: dict[str, torch.Tensor]

    def rows(self, idx: torch.Tensor) -> _Stack:
        """Copies of the rows `idx` (a sub-stack of some clients)."""
        return _Stack(*({k: v[idx] for k, v in part.items()} for part in self._parts()))

    def put(self, idx: torch.Tensor, rows: _Stack) -> None:
        """Write a trained sub-stack back into rows `idx`; no other row changes."""
        for mine, theirs in zip(self._parts()[:3], rows._parts()[:3], strict=True):
            for k, v in mine.items():
                v.index_copy_(0, idx, theirs[k])

    def _parts(self) -> tuple[dict[str, torch.Tensor], ...]:
        return self.params, self.buffers, self.state, self.received


def _used_parameters(
    template: nn.Module, own: Mapping[str, torch.Tensor], names: Sequence[str], x: torch.Tensor
) -> tuple[set[str], int]:
    """(names of the parameters the forward uses, number of outputs), from one unbatched
    pass of one client's batch `x` on copies of its tensors `own` (trainable: `names`).
    Sequential training steps only parameters that get a gradient; a vmapped gradient gives
    the others zeros, which weight decay and momentum would still move."""
    probe = {k: own[k].detach().clone().requires_grad_(True) for k in names}
    rest = {k: v.clone() for k, v in own.items() if k not in probe}
    out = functional_call(template, (probe, rest), (x,))
    grads = torch.autograd.grad(out.sum(), list(probe.values()), allow_unused=True)
    return {k for k, g in zip(probe, grads, strict=True) if g is not None}, int(out.shape[-1])


def _vmapped_step(template: nn.Module, masked: bool) -> Callable[..., Any]:
    """`(params, buffers, x, y, keep) -> (grads, (losses, buffers))` over stacks: each
    client's gradient of its batch's mean cross-entropy (`CrossEntropy`, or with `masked`
    the logits of its absent classes zeroed first, `MaskedCrossEntropy`), its loss and its
    buffers after the forward (BatchNorm updates them; on copies, as vmap needs)."""

    def loss(
        params: State, buffers: State, x: torch.Tensor, y: torch.Tensor, keep: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, State]]:
        own = {k: v.clone() for k, v in buffers.items()}
        outputs = functional_call(template, (params, own), (x,))  # (B, C)
        if masked:
            outputs = outputs.masked_fill(~keep, 0.0)
        mean = F.cross_entropy(outputs, y, reduction="none").mean()
        return mean, (mean.detach(), own)

    return vmap(grad(loss, has_aux=True), in_dims=(0, 0, 0, 0, 0 if masked else None))


def _clip_rows(grads: dict[str, torch.Tensor], max_norm: float) -> None:
    """`ClipGradNorm` per client: each row's gradients scaled together so that their joint
    L2 norm is at most `max_norm` (coefficient max_norm / (norm + 1e-6), capped at 1)."""
    tensors = list(grads.values())
    norms = torch.stack([torch.linalg.vector_norm(g.flatten(1), dim=1) for g in tensors])
    coef = torch.clamp(max_norm / (torch.linalg.vector_norm(norms, dim=0) + 1e-6), max=1.0)
    for g in tensors:
        g.mul_(coef.view(-1, *([1] * (g.dim() - 1))))


def _copy_generator(generator: torch.Generator) -> torch.Generator:
    """A generator in `generator`'s state, so that drawing from it leaves the job's own
    untouched (a fall-back to the sequential executor must draw the same batches)."""
    copy = torch.Generator(device=generator.device)
    copy.set_state(generator.get_state())
    return copy


def _by_batch_size(batches: Sequence[Sequence[torch.Tensor]], step: int) -> dict[int, list[int]]:
    """The clients (rows) that have a batch at `step`, by that batch's size."""
    rows: dict[int, list[int]] = {}
    for k, own in enumerate(batches):
        if step < len(own):
            rows.setdefault(int(own[step].shape[0]), []).append(k)
    return rows


def train_together(template: nn.Module, members: Sequence[_Member]) -> list[ClientOutput]:
    """Train the members (same spec, settings and payload names, a supported recipe) on one
    stack; each one's `ClientOutput`, as its `ClientProgram.fit` would return it."""
    group = _GroupTraining(template, members)
    for step in range(max(len(own) for own in group.batches)):
        group.step(step)
    return group.outputs()


class _GroupTraining:
    """One group's local training on one stack (rows: the members, in order)."""

    def __init__(self, template: nn.Module, members: Sequence[_Member]) -> None:
        first = members[0]
        self.members = members
        self.settings, self.recipe = first.job.task.config, first.program.recipe
        template.train()
        self.owns = [m.program.own_tensors(m.job.task, m.job.info, m.job.private) for m in members]
        trainable = trainable_names(template)
        self.names = [k for k in self.owns[0] if k in trainable]
        self.device = self.owns[0][self.names[0]].device
        self.generators = [_copy_generator(m.job.generator) for m in members]
        # All members' data in one tensor, so that a step gathers its batches at once;
        # row k's batches index it past the data of rows before k.
        self.x = torch.cat([m.data.x_train for m in members])
        self.y = torch.cat([m.data.y_train for m in members])
        starts = [0]
        for m in members[:-1]:
            starts.append(starts[-1] + m.data.n_train)
        self.batches = [
            [start + idx.to(self.device) for idx in batch_order(m.data.n_train, self.settings, g)]
            for m, g, start in zip(members, self.generators, starts, strict=True)
        ]
        self.pixels = first.data.pixels  # one dataset's: the same for every member
        first_x = model_inputs(self.x[self.batches[0][0]], self.pixels)
        self.used, classes = _used_parameters(template, self.owns[0], self.names, first_x)
        self.optimiser = optimiser_for(self.settings)
        self.groups = param_groups(template, self.names, self.settings)
        self.transforms = grad_transforms(self.recipe, self.settings)
        self.kept = [self._restored(m, own) for m, own in zip(members, self.owns, strict=True)]
        self.stack = self._stacked()
        masked = isinstance(self.recipe.forward, MaskedCrossEntropy)
        self.keep = None
        if masked:
            labels = [kept_classes(m.job.info.labels, classes, self.device) for m in members]
            self.keep = torch.stack(labels)  # (K, C)
        self.vmapped = _vmapped_step(template, masked)
        self.contexts = [
            TrainContext(m.job.task, m.job.task.payload, g, self.settings, m.job.info)
            for m, g in zip(members, self.generators, strict=True)
        ]
        self.losses: list[tuple[list[int], int, torch.Tensor]] = []

    def _restored(self, member: _Member, own: Mapping[str, torch.Tensor]) -> State:
        """The optimiser state the client kept that still fits (`Optimiser.restore`)."""
        if not self.settings.keep_momentum:
            return {}
        return self.optimiser.restore(member.job.private, {k: own[k] for k in self.names})

    def _stacked(self) -> _Stack:
        """The members' tensors stacked. A momentum buffer a client did not keep starts at
        zero, which gives its first step exactly the buffer SGD creates: 0 * momentum + the
        gradient."""
        owns, names = self.owns, self.names
        stacked = {k: torch.stack([own[k] for own in owns]) for k in owns[0]}
        state = {}
        if self.settings.momentum != 0:
            for k in (k for k in names if k in self.used):
                rows = [
                    kept.get(MOMENTUM + k, torch.zeros_like(own[k]))
                    for kept, own in zip(self.kept, owns, strict=True)
                ]
                state[MOMENTUM + k] = torch.stack([r.to(self.device) for r in rows])
        payload = self.members[0].job.task.payload
        received = {
            k: torch.stack([m.job.task.payload[k].to(self.device) for m in self.members])
            for k in names
            if k in payload
        }
        params = {k: stacked[k] for k in names}
        buffers = {k: v for k, v in stacked.items() if k not in params}
        return _Stack(params, buffers, state, received)

    def step(self, step: int) -> None:
        """Step `step` of every client that has a batch there, one sub-stack per size."""
        for rows in _by_batch_size(self.batches, step).values():
            self._step_rows(step, rows)

    def _step_rows(self, step: int, ks: list[int]) -> None:
        """One step of the rows `ks` (batches of one size): forward and gradient (vmapped),
        gradient transforms, the optimiser, the trackers; other rows are not touched."""
        members, settings = self.members, self.settings
        idx = torch.tensor(ks, device=self.device)
        whole = len(ks) == len(members)
        rows = self.stack if whole else self.stack.rows(idx)
        batch = torch.stack([self.batches[k][step] for k in ks])  # (K', B)
        x, y = model_inputs(self.x[batch], self.pixels), self.y[batch]  # (K', B, ...), (K', B)
        keep = None if self.keep is None else self.keep[idx]
        g, (loss, rows.buffers) = self.vmapped(rows.params, rows.buffers, x, y, keep)
        grads = {k: g[k] for k in self.names if k in self.used}
        ctx = TrainContext(members[0].job.task, rows.received, self.generators[0], settings)
        for transform in self.transforms:
            if isinstance(transform, ClipGradNorm):
                _clip_rows(grads, transform.max_norm)
            else:  # elementwise (ProximalTerm): the same on a stack as on one client
                transform(grads, rows.params, ctx)
        with torch.no_grad():
            self.optimiser.step(self.groups, rows.params, grads, rows.state)
        if not whole:
            self.stack.put(idx, rows)
        self.losses.append((ks, int(y.shape[1]), loss))
        for k in ks:
            self.contexts[k].step = step
            for tracker in self.recipe.trackers:
                tracker.after_step(self.contexts[k])

    def outputs(self) -> list[ClientOutput]:
        """Each member's answer, from its rows of the stack and its steps' losses."""
        steps: list[list[tuple[float, int]]] = [[] for _ in self.members]
        for ks, b, loss in self.losses:
            for k, value in zip(ks, loss.tolist(), strict=True):
                steps[k].append((value, b))
        out = []
        for k, m in enumerate(self.members):
            stacked = {**self.stack.params, **self.stack.buffers}
            own = {name: stacked[name][k].clone() for name in self.owns[k]}
            out.append(m.program.output(m.job.task, m.data, own, self._stats(k, steps[k])))
        return out

    def _stats(self, k: int, steps: list[tuple[float, int]]) -> LocalStats:
        """Row `k`'s `LocalStats`, summed as `train_local` sums them, step by step."""
        loss_sum, seen = 0.0, 0
        passes: dict[int, int] = {}
        for value, b in steps:
            passes[b] = passes.get(b, 0) + 1
            loss_sum += value * b
            seen += b
        extras: dict[str, Any] = {}
        for tracker in self.recipe.trackers:
            extras.update(tracker.finish(self.contexts[k]))
        state: State = {}
        if self.settings.keep_momentum:
            state = {n: v.detach().clone() for n, v in self.kept[k].items()}
            for group in self.groups:
                for name in group.names:
                    if MOMENTUM + name in self.stack.state:
                        state[MOMENTUM + name] = self.stack.state[MOMENTUM + name][k].clone()
        return LocalStats(len(steps), seen, loss_sum / max(seen, 1), passes, state, extras)
