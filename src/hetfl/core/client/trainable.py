"""The one trainable step: model tensors in plain dicts trained with the functional optimiser.

Three places train a view of model tensors with HetFL's functional optimiser
(`hetfl.core.client.optim`): a client's local loop (`hetfl.core.client.loop.LocalStep`),
split learning's per-client server copies (`hetfl.algorithms.parts.server_copies`) and
FedGKT's server model (`hetfl.algorithms.parts.gkt_server`). A step is the same in all
three, so it is written here once: the trainable parameters' gradients, accumulated into
zeros (`gradients`), clipped to `LocalTraining.clip_grad_norm` when set, then the
optimiser's step over its param groups (`OptimiserStep`). `Trainable` is such a view with
its optimiser and state, as the server-side trainers hold it; the client's loop runs the
same parts between its recipe's (`LocalStep.update`), so that a client side and its server
copy stepped apart equal the joined model stepped whole.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from hetfl.core.client.optim import Optimiser, ParamGroup, optimiser_for, param_groups
from hetfl.core.client.recipe import ModelCall
from hetfl.core.client.terms import ClipGradNorm, clip_grads
from hetfl.core.init import build_model
from hetfl.core.spec import Spec
from hetfl.core.training import LocalTraining
from hetfl.core.types import ModelFamily, State


def trainable_names(template: nn.Module) -> set[str]:
    """The names of `template`'s parameters that training updates (those requiring a
    gradient); its other state-dict tensors are buffers to the optimiser."""
    return {k for k, p in template.named_parameters() if p.requires_grad}


def split_trainable(
    template: nn.Module, own: Mapping[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """`own`, the view's own tensors of `template`'s state dict, as (parameters, buffers):
    the trainable parameters made leaves that require a gradient (in place, so `own` must
    not be shared), the rest untouched."""
    trainable = trainable_names(template)
    params = {k: v.requires_grad_(True) for k, v in own.items() if k in trainable}
    buffers = {k: v for k, v in own.items() if k not in trainable}
    return params, buffers


def model_call(
    template: nn.Module, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]
) -> ModelCall:
    """`template` evaluated on `params` and `buffers` (in-place buffer updates land in
    `buffers`); keyword arguments pass through to its forward."""

    def call(x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        out: torch.Tensor = functional_call(template, (params, buffers), (x,), kwargs)
        return out

    return call


def gradients(
    params: Mapping[str, torch.Tensor], backward: Callable[[], None]
) -> dict[str, torch.Tensor]:
    """The gradients `backward` leaves on `params`, by name, for those that get one. The
    last step's gradients are zeroed in place first, as `Optimizer.zero_grad(set_to_none=False)`
    does, so that a backward accumulates into zeros exactly as `torch.optim` training does."""
    last = [p.grad for p in params.values() if p.grad is not None]
    if last:
        torch._foreach_zero_(last)
    backward()
    return {k: p.grad for k, p in params.items() if p.grad is not None}


@dataclass(frozen=True)
class OptimiserStep:
    """The end of a step under `settings`: the gradients clipped to `clip_grad_norm` when
    it is set (`clip`, last of the gradient transforms, so that it bounds the gradient the
    optimiser sees), then the optimiser `settings` names over the param `groups`."""

    settings: LocalTraining
    groups: tuple[ParamGroup, ...] = ()
    optimiser: Optimiser = field(init=False)
    clip: tuple[ClipGradNorm, ...] = field(init=False)

    def __post_init__(self) -> None:
        limit = self.settings.clip_grad_norm
        object.__setattr__(self, "optimiser", optimiser_for(self.settings))
        object.__setattr__(self, "clip", () if limit is None else (ClipGradNorm(limit),))

    @classmethod
    def of(cls, settings: LocalTraining, template: nn.Module, names: list[str]) -> OptimiserStep:
        """The step for the trainable parameters `names` of `template`."""
        return cls(settings, tuple(param_groups(template, names, settings)))

    def __call__(
        self,
        params: Mapping[str, torch.Tensor],
        grads: dict[str, torch.Tensor],
        state: dict[str, torch.Tensor],
        *,
        clipped: bool = False,
    ) -> None:
        """Clipping, then the optimiser's step, in place on `grads`, `params` and `state`;
        with `clipped`, the optimiser's step alone (the client's loop runs `clip` itself,
        among its gradient transforms)."""
        if not clipped:
            for clip in self.clip:
                clip_grads(grads, clip.max_norm)
        with torch.no_grad():
            self.optimiser.step(list(self.groups), params, grads, state)


@dataclass
class Trainable:
    """A model's own tensors trained in place: `params` (leaves), `buffers` (BatchNorm's
    running statistics update in place), called through `model`, stepped by `step` with
    the optimiser `state`."""

    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    model: ModelCall
    step: OptimiserStep
    state: dict[str, torch.Tensor]

    @classmethod
    def of(
        cls,
        family: ModelFamily,
        spec: Spec,
        tensors: Mapping[str, torch.Tensor],
        settings: LocalTraining,
        kept: State,
    ) -> Trainable:
        """`spec`'s model in train mode over copies of `tensors` (its state-dict tensors),
        stepped under `settings` from what of the optimiser state `kept` still fits
        (`Optimiser.restore`; nothing kept: a fresh state)."""
        template = build_model(family, spec)
        template.train()
        params, buffers = split_trainable(template, {k: v.clone() for k, v in tensors.items()})
        step = OptimiserStep.of(settings, template, list(params))
        model = model_call(template, params, buffers)
        return cls(params, buffers, model, step, step.optimiser.restore(kept, params))

    def train(self, loss: torch.Tensor) -> None:
        """One step on `loss`: its gradients, clipped, and the optimiser's step."""
        self.step(self.params, gradients(self.params, loss.backward), self.state)

    def tensors(self) -> State:
        """Copies of the trained tensors, parameters and buffers, by local name."""
        return {k: v.detach().clone() for k, v in {**self.params, **self.buffers}.items()}

    def kept(self) -> State:
        """A copy of the optimiser state, to keep for a later round."""
        return {k: v.detach().clone() for k, v in self.state.items()}
