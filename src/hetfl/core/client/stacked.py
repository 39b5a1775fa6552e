"""The local step on clients stacked on a leading dimension (K, ...): the one `LocalStep`
(`hetfl.core.client.loop`) run as its parts declare (`hetfl.core.client.recipe.Vectorises`),
for the vectorised executor (`hetfl.sim.vectorised`).

`stacked_gradient` takes every client's gradient of its batch's total loss at once, a
`torch.func.vmap` of `torch.func.grad` of `LocalStep.loss`; `on_stack` runs a part of
`LocalStep.update` on the stack: an elementwise part as it is, a per-client part under
`vmap`. Under `vmap` a part sees one client's context: the stack's context (one client's in
what all share: task spec, settings, roles, step; no `info`) with that client's rows of the
parameters, the received payload and the constants (`TrainContext.constant`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.func import grad, vmap

from hetfl.core.client.loop import LocalStep, PartCall, StepTensors
from hetfl.core.client.recipe import TrainContext, Vectorises, vectorisation
from hetfl.core.client.trainable import model_call
from hetfl.core.types import State

#: `(params, buffers, x (K, B, ...), y (K, B), ctx) -> (grads, (losses (K,), buffers))`.
StackedGradient = Callable[
    [State, State, torch.Tensor, torch.Tensor, TrainContext],
    tuple[State, tuple[torch.Tensor, State]],
]


def _rows(ctx: TrainContext) -> dict[str, Any]:
    """The per-client tensors of a stack's context that parts read, for `vmap`."""
    return {"received": ctx.received, "constants": ctx.constants}


def _one_client(ctx: TrainContext, rows: dict[str, Any], params: State) -> TrainContext:
    """The stack's context `ctx` as one client's under `vmap`: its `params` and its `rows`
    of the received payload and the constants."""
    return replace(ctx, params=params, received=rows["received"], constants=rows["constants"])


def on_stack(part: object, call: PartCall, tensors: StepTensors, ctx: TrainContext) -> None:
    """Run a part of `LocalStep.update` on a stack (its `run`): an elementwise part on the
    stack as it is, a per-client part under `vmap`, one client per row. The step's parts
    all declare one or the other (`LocalStep.why_not_vectorised` is None)."""
    if vectorisation(part) is Vectorises.ELEMENTWISE:
        call(tensors, ctx)
        return

    def one(own: StepTensors, rows: dict[str, Any]) -> None:
        call(own, _one_client(ctx, rows, own["params"]))

    vmap(one, out_dims=None)(tensors, _rows(ctx))


def stacked_gradient(template: nn.Module, step: LocalStep) -> StackedGradient:
    """Each client's gradient of its batch's total loss (`LocalStep.loss`) by parameter,
    its mean loss and its buffers after the forward (BatchNorm updates them; on copies,
    as vmap needs), all (K, ...). This is what the backward `Autograd` leaves, which a
    backward that declares `PER_CLIENT` promises to be."""

    def total(
        params: State,
        buffers: State,
        x: torch.Tensor,
        y: torch.Tensor,
        rows: dict[str, Any],
        ctx: TrainContext,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, State]]:
        own = {k: v.clone() for k, v in buffers.items()}
        inner = replace(_one_client(ctx, rows, params), buffers=own, batch=(x, y))
        total, loss = step.loss(model_call(template, params, own), x, y, inner)
        return total, (loss.detach(), own)

    vmapped = vmap(grad(total, has_aux=True), in_dims=(0, 0, 0, 0, 0, None))

    def gradient(
        params: State, buffers: State, x: torch.Tensor, y: torch.Tensor, ctx: TrainContext
    ) -> tuple[State, tuple[torch.Tensor, State]]:
        out: tuple[State, tuple[torch.Tensor, State]] = vmapped(
            params, buffers, x, y, _rows(ctx), ctx
        )
        return out

    return gradient
