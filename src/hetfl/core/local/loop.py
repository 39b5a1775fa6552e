"""The local-training loop: mini-batches, the recipe's parts and the optimiser's step.

It works on plain dicts: the client's parameters (leaf tensors whose `.grad` the backward
fills), its buffers, and the optimiser's state. The model is a shared stateless template
called through `torch.func.functional_call`, so no client's tensors live in it; BatchNorm
updates its running statistics and `num_batches_tracked` in place on the buffer tensors
passed, i.e. in the client's dict. Per step the order is PyTorch's usual one (see
`hetfl.core.local.parts` for where each part runs): forward, loss, zeroed gradients,
backward, gradient transforms, clipping, optimiser step, projections, trackers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from hetfl.core.local.optim import optimiser_for, param_groups
from hetfl.core.local.parts import GradTransform, LocalRecipe, ModelCall, TrainContext
from hetfl.core.local.terms import ClipGradNorm
from hetfl.core.rng import sibling_generator
from hetfl.core.training import LocalTraining
from hetfl.core.types import ClientData, State


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


def model_call(
    template: nn.Module, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]
) -> ModelCall:
    """`template` evaluated on `params` and `buffers` (in-place buffer updates land in
    `buffers`); keyword arguments pass through to its forward."""

    def call(x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        out: torch.Tensor = functional_call(template, (params, buffers), (x,), kwargs)
        return out

    return call


def grad_transforms(recipe: LocalRecipe, settings: LocalTraining) -> tuple[GradTransform, ...]:
    """The recipe's gradient transforms, then clipping when the settings ask for it (last,
    so that it bounds the gradient the optimiser sees)."""
    if settings.clip_grad_norm is None:
        return recipe.grad_transforms
    return (*recipe.grad_transforms, ClipGradNorm(settings.clip_grad_norm))


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
    optimiser = optimiser_for(settings)
    groups = param_groups(template, list(params), settings)
    state = optimiser.restore(kept or {}, params) if settings.keep_momentum else {}
    transforms = grad_transforms(recipe, settings)
    model = model_call(template, params, ctx.buffers)
    device = next(iter(params.values())).device
    loss_sum, seen = 0.0, 0
    default_passes: dict[int, int] = {}
    batches = batch_order(data.n_train, settings, ctx.generator)
    augment = sibling_generator(ctx.generator, "augment", data.x_train.device)
    for step, idx in enumerate(batches):
        ctx.step = step
        idx = idx.to(device)
        x, y = data.train_inputs(data.x_train[idx], augment), data.y_train[idx]
        ctx.batch = (x, y)
        recorded = len(ctx.passes)
        outputs, per_sample = recipe.forward(model, x, y, ctx)
        loss = per_sample.mean()
        total = loss
        for term in recipe.loss_terms:
            extra = term(outputs, y, per_sample, ctx)
            if extra is not None:
                total = total + extra
        _zero_grads(params)
        recipe.backward(total, ctx)
        grads = {k: p.grad for k, p in params.items() if p.grad is not None}
        for transform in transforms:
            transform(grads, params, ctx)
        with torch.no_grad():
            optimiser.step(groups, params, grads, state)
        for project in recipe.projections:
            project(params, ctx)
        for tracker in recipe.trackers:
            tracker.after_step(ctx)
        b = int(y.shape[0])
        if len(ctx.passes) == recorded:
            default_passes[b] = default_passes.get(b, 0) + 1
        loss_sum += float(loss.detach()) * b
        seen += b
    ctx.batch = None
    extras: dict[str, Any] = {}
    for tracker in recipe.trackers:
        extras.update(tracker.finish(ctx))
    keep = {k: v.detach().clone() for k, v in state.items()} if settings.keep_momentum else {}
    return LocalStats(len(batches), seen, loss_sum / max(seen, 1), default_passes, keep, extras)


def _zero_grads(params: dict[str, torch.Tensor]) -> None:
    """Zero the gradients in place, as `Optimizer.zero_grad(set_to_none=False)` does, so
    that a backward accumulates into zeros exactly as `torch.optim` training does."""
    grads = [p.grad for p in params.values() if p.grad is not None]
    if grads:
        torch._foreach_zero_(grads)
