"""The local-training step and loop: mini-batches, the recipe's parts and the optimiser.

`LocalStep` is the one definition of a step, over plain dicts: the client's parameters
(leaf tensors whose `.grad` the backward fills), its buffers, and the optimiser's state.
`train_local` runs it for one client; the vectorised executor (`hetfl.sim.vectorised`) runs
the same step for clients stacked on a leading dimension (`hetfl.core.client.stacked`), each
part as it declares (`hetfl.core.client.recipe.Vectorises`). The model is a shared stateless
template called through `torch.func.functional_call`, so no client's tensors live in it;
BatchNorm updates its running statistics and `num_batches_tracked` in place on the buffer
tensors passed, i.e. in the client's dict. Per step the order is PyTorch's usual one (see
`hetfl.core.client.recipe` for where each part runs): forward, loss, zeroed gradients,
backward, gradient transforms, clipping, optimiser step, projections, trackers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn

from hetfl.core.client.optim import Optimiser, ParamGroup
from hetfl.core.client.recipe import (
    GradTransform,
    LocalRecipe,
    ModelCall,
    Projection,
    TrainContext,
    part_name,
    vectorisation,
)
from hetfl.core.client.trainable import OptimiserStep, gradients, model_call
from hetfl.core.rng import sibling_generator
from hetfl.core.training import LocalTraining
from hetfl.core.types import ClientData, State

#: The tensors of one step's update by role: "grads", "params" and "state" (the
#: optimiser's), each a dict by name.
StepTensors = dict[str, dict[str, torch.Tensor]]
#: A part of the update bound to its arguments: `call(tensors, ctx)`, in place.
PartCall = Callable[[StepTensors, TrainContext], None]
#: How a step runs a part of its update: `run(part, call, tensors, ctx)` runs `call` on
#: `tensors` as the part declares it may run (`Vectorises`). The per-client loop calls it
#: on the client's own tensors (`direct`); the vectorised executor on a stack.
PartRunner = Callable[[object, PartCall, StepTensors, TrainContext], None]


def direct(part: object, call: PartCall, tensors: StepTensors, ctx: TrainContext) -> None:
    """Run a part of the update on one client's tensors."""
    call(tensors, ctx)


@dataclass
class LocalStats:
    """`samples_seen` counts samples over all steps (epochs x data size), unlike
    `ClientResult.num_examples`, the client's data size, which aggregation weights use.
    `default_passes` maps a batch size to the number of steps no part recorded passes for;
    `optimiser_state` is the state to keep (empty without `keep_momentum`); `extras` the
    trackers' merged `finish`."""

    num_steps: int
    samples_seen: int
    loss: float
    default_passes: dict[int, int]
    optimiser_state: State = field(default_factory=dict)
    extras: dict[str, Any] = field(default_factory=dict)
    uploads: State = field(default_factory=dict)


@dataclass
class Tally:
    """A client's `LocalStats` summed step by step, as both loops sum them."""

    steps: int = 0
    loss_sum: float = 0.0
    seen: int = 0
    default_passes: dict[int, int] = field(default_factory=dict)

    def add(self, loss: float, batch: int, recorded: bool) -> None:
        """One step: its batch's mean loss, its size, whether a part recorded its passes."""
        self.steps += 1
        if not recorded:
            self.default_passes[batch] = self.default_passes.get(batch, 0) + 1
        self.loss_sum += loss * batch
        self.seen += batch

    def stats(self, state: State, extras: dict[str, Any]) -> LocalStats:
        mean = self.loss_sum / max(self.seen, 1)
        return LocalStats(self.steps, self.seen, mean, self.default_passes, state, extras)


def batch_order(n: int, settings: LocalTraining, generator: torch.Generator) -> list[torch.Tensor]:
    """Mini-batches of indices: a fresh permutation per epoch; the last batch may be short."""
    total = settings.num_steps(n)
    batches: list[torch.Tensor] = []
    while len(batches) < total:
        perm = torch.randperm(n, generator=generator)
        for start in range(0, n, settings.batch_size):
            batches.append(perm[start : start + settings.batch_size])
            if len(batches) == total:
                break
    return batches


@dataclass(frozen=True)
class LocalStep:
    """One local step of `recipe` under `settings`, over parameter dicts: `loss` (the
    forward and the loss terms), the backward, then `update` (the gradient transforms,
    clipping when the settings ask for it, the optimiser over its param `groups`, the
    projections), then `observe` (the trackers). The clipping and the optimiser are the
    trainable step every trainer shares (`hetfl.core.client.trainable.OptimiserStep`), each
    run here through the update's runner."""

    recipe: LocalRecipe
    settings: LocalTraining
    groups: tuple[ParamGroup, ...] = ()
    trains: OptimiserStep = field(init=False)
    transforms: tuple[GradTransform, ...] = field(init=False)

    def __post_init__(self) -> None:
        trains = OptimiserStep(self.settings, self.groups)
        object.__setattr__(self, "trains", trains)
        object.__setattr__(self, "transforms", (*self.recipe.grad_transforms, *trains.clip))

    @classmethod
    def of(
        cls, recipe: LocalRecipe, settings: LocalTraining, template: nn.Module, names: list[str]
    ) -> LocalStep:
        """The step for the trainable parameters `names` of `template`."""
        return cls(recipe, settings, OptimiserStep.of(settings, template, names).groups)

    @property
    def optimiser(self) -> Optimiser:
        return self.trains.optimiser

    def parts(self) -> tuple[tuple[str, object], ...]:
        """Every part the step runs, with its place in it, the optimiser included."""
        return (
            *self.recipe.parts(),
            *(("gradient clipping", c) for c in self.trains.clip),
            ("optimizer", self.optimiser),
        )

    def why_not_vectorised(self) -> str | None:
        """Why clients cannot be trained with this step stacked together: the first part
        that does not declare a `Vectorises` (None if every part does)."""
        for place, part in self.parts():
            declared = vectorisation(part)
            if isinstance(declared, str):
                return f"{place} {part_name(part)}: {declared}"
        return None

    def loss(
        self, model: ModelCall, x: torch.Tensor, y: torch.Tensor, ctx: TrainContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the total to back-propagate, the batch's mean loss) for x (B, ...), y (B,)."""
        recipe = self.recipe
        outputs, per_sample = recipe.forward(model, x, y, ctx)
        loss = per_sample.mean()
        total = loss
        for term in recipe.loss_terms:
            extra = term(outputs, y, per_sample, ctx)
            if extra is not None:
                total = total + extra
        return total, loss

    def update(self, tensors: StepTensors, ctx: TrainContext, run: PartRunner = direct) -> None:
        """The step from the gradients on, in place on `tensors`: the transforms, the
        optimiser and the projections, each through `run`."""
        for transform in self.transforms:
            run(transform, partial(_transform, transform), tensors, ctx)
        run(self.optimiser, partial(_optimise, self.trains), tensors, ctx)
        for project in self.recipe.projections:
            run(project, partial(_project, project), tensors, ctx)

    def observe(self, ctx: TrainContext) -> None:
        """The trackers, after the step."""
        for tracker in self.recipe.trackers:
            tracker.after_step(ctx)

    def finish(self, ctx: TrainContext) -> dict[str, Any]:
        """The trackers' extras, merged."""
        extras: dict[str, Any] = {}
        for tracker in self.recipe.trackers:
            extras.update(tracker.finish(ctx))
        return extras


def _transform(transform: GradTransform, tensors: StepTensors, ctx: TrainContext) -> None:
    transform(tensors["grads"], tensors["params"], ctx)


def _optimise(trains: OptimiserStep, tensors: StepTensors, ctx: TrainContext) -> None:
    trains(tensors["params"], tensors["grads"], tensors["state"], clipped=True)


def _project(project: Projection, tensors: StepTensors, ctx: TrainContext) -> None:
    project(tensors["params"], ctx)


def train_local(
    template: nn.Module,
    data: ClientData,
    recipe: LocalRecipe,
    ctx: TrainContext,
    kept: State | None = None,
) -> LocalStats:
    """Local training of `ctx.params` / `ctx.buffers` on the client's training data.

    With `keep_momentum`, `kept` holds the optimiser state the client kept from its previous
    round; what no longer fits its parameter is dropped (`Optimiser.restore`)."""
    settings = ctx.settings
    template.train()
    params = ctx.params
    step = LocalStep.of(recipe, settings, template, list(params))
    state = step.optimiser.restore(kept or {}, params) if settings.keep_momentum else {}
    model = model_call(template, params, ctx.buffers)
    device = next(iter(params.values())).device
    tally = Tally()
    batches = batch_order(data.n_train, settings, ctx.generator)
    augment = sibling_generator(ctx.generator, "augment", data.x_train.device)
    for index, idx in enumerate(batches):
        ctx.step = index
        idx = idx.to(device)
        x, y = data.train_batch(idx, augment)
        ctx.batch, ctx.indices = (x, y), idx
        recorded = len(ctx.passes)
        total, loss = step.loss(model, x, y, ctx)
        grads = gradients(params, partial(recipe.backward, total, ctx))
        step.update({"grads": grads, "params": params, "state": state}, ctx)
        step.observe(ctx)
        tally.add(float(loss.detach()), int(y.shape[0]), len(ctx.passes) > recorded)
    ctx.batch, ctx.indices = None, None
    keep = {k: v.detach().clone() for k, v in state.items()} if settings.keep_momentum else {}
    stats = tally.stats(keep, step.finish(ctx))
    if recipe.upload is not None:
        template.eval()
        with torch.no_grad():
            stats.uploads = recipe.upload(model, data, ctx)
        template.train()
    return stats
