"""The local optimisers, functional: plain dicts of parameters, gradients and state in,
PyTorch's own functional optimisers (`torch.optim.sgd.sgd`, `torch.optim.adam.adam`, with
`foreach`) called per parameter group in the order `torch.optim.SGD` / `torch.optim.Adam`
call them, so that a step equals the stateful optimiser's bit for bit.

The settings choose the optimiser (`LocalTraining.optimizer`). Its state is a dict of
tensors by name, fresh each round or, with `LocalTraining.keep_momentum`, kept by the client
between its rounds as private state (`ClientOutput.private`) under these names:

- SGD: `momentum/<param>`, the momentum buffer (absent with momentum 0);
- Adam and AMSGrad: `adam.step/<param>` (a scalar count, on the CPU as PyTorch keeps it),
  `adam.exp_avg/<param>`, `adam.exp_avg_sq/<param>` and, for AMSGrad,
  `adam.max_exp_avg_sq/<param>`.

State-dict names are module paths and never contain "/", so these never collide with a
model tensor. A kept state whose shape no longer fits its parameter (the client got another
sub-model) is dropped for that parameter, which starts afresh.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch
from torch import nn
from torch.optim.adam import adam
from torch.optim.sgd import sgd

from hetfl.core.client.recipe import Vectorises
from hetfl.core.roles import norm_tensor_names
from hetfl.core.training import LocalTraining
from hetfl.core.types import State

#: The prefix of the names of kept SGD momentum buffers (`momentum/<param>`).
MOMENTUM = "momentum/"
#: The prefix of every Adam state name (`adam.<kind>/<param>`).
ADAM = "adam."


@dataclass(frozen=True)
class ParamGroup:
    """Parameter names that share a weight decay (`torch.optim`'s param groups)."""

    names: tuple[str, ...]
    weight_decay: float


def param_groups(model: nn.Module, names: list[str], settings: LocalTraining) -> list[ParamGroup]:
    """All parameters in one group, or (without `decay_norm_and_bias`) normalisation tensors
    and biases in a group of their own with no weight decay. Both are found from the model's
    structure: norm modules (`hetfl.core.roles`) and each module's own `bias`."""
    if settings.decay_norm_and_bias:
        return [ParamGroup(tuple(names), settings.weight_decay)]
    exempt = norm_tensor_names(model)
    for prefix, module in model.named_modules():
        if isinstance(getattr(module, "bias", None), nn.Parameter):
            exempt.add(f"{prefix}.bias" if prefix else "bias")
    groups = [
        ParamGroup(tuple(k for k in names if k not in exempt), settings.weight_decay),
        ParamGroup(tuple(k for k in names if k in exempt), 0.0),
    ]
    return [g for g in groups if g.names]


class Optimiser(Protocol):
    """`step`: one local step, in place on `params` (and on `state`, the optimiser's own
    tensors by the names of the module docstring); `restore`: what of a client's kept state
    fits its parameters; `full_state`: a state with every entry a step would create, so that
    the states of clients stacked on a leading dimension have the same entries. Like a part
    of the recipe, an optimiser declares `vectorises` (`hetfl.core.client.recipe`)."""

    def step(
        self,
        groups: list[ParamGroup],
        params: Mapping[str, torch.Tensor],
        grads: Mapping[str, torch.Tensor],
        state: dict[str, torch.Tensor],
    ) -> None: ...

    def restore(
        self, kept: State, params: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]: ...

    def full_state(
        self, state: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]: ...


def _fitting(
    kept: State, params: Mapping[str, torch.Tensor], kinds: tuple[str, ...], shaped: str
) -> dict[str, torch.Tensor]:
    """The kept entries `<kind><param>` of each parameter whose `<shaped><param>` entry fits
    its shape, cloned onto the parameter's device (the scalar Adam step stays where it is)."""
    out: dict[str, torch.Tensor] = {}
    for k, p in params.items():
        ref = kept.get(shaped + k)
        if ref is None or ref.shape != p.shape:
            continue
        for kind in kinds:
            v = kept.get(kind + k)
            if v is not None:
                out[kind + k] = v.clone() if v.dim() == 0 else v.to(p.device).clone()
    return out


@dataclass(frozen=True)
class SGD:
    """`torch.optim.SGD` (momentum without dampening or Nesterov; L2 weight decay added to
    the gradient), per group as `SGD.step` calls `sgd(..., foreach=True)`. Elementwise, so
    it steps a stack of clients as it is (`foreach` kernels, which vmap cannot batch)."""

    vectorises: ClassVar[Vectorises] = Vectorises.ELEMENTWISE
    lr: float
    momentum: float

    def step(
        self,
        groups: list[ParamGroup],
        params: Mapping[str, torch.Tensor],
        grads: Mapping[str, torch.Tensor],
        state: dict[str, torch.Tensor],
    ) -> None:
        for group in groups:
            names = [k for k in group.names if k in grads]
            buffers: list[torch.Tensor | None] = [state.get(MOMENTUM + k) for k in names]
            sgd(
                [params[k] for k in names],
                [grads[k] for k in names],
                buffers,
                weight_decay=group.weight_decay,
                momentum=self.momentum,
                lr=self.lr,
                dampening=0.0,
                nesterov=False,
                maximize=False,
                has_sparse_grad=False,
                foreach=True,
            )
            if self.momentum != 0:
                for k, buf in zip(names, buffers, strict=True):
                    if buf is not None:
                        state[MOMENTUM + k] = buf

    def restore(self, kept: State, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return _fitting(kept, params, (MOMENTUM,), MOMENTUM)

    def full_state(
        self, state: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """`state` and, with momentum, a zero buffer for each of `params` (in their order)
        without one: its first step makes it 0 * momentum + the gradient, exactly the
        buffer SGD creates."""
        if self.momentum == 0:
            return dict(state)
        zeros = {MOMENTUM + k: torch.zeros_like(p) for k, p in params.items()}
        return {**state, **{k: v for k, v in zeros.items() if k not in state}}


_STEP, _AVG, _SQ, _MAX = (
    f"{ADAM}{k}/" for k in ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")
)


@dataclass(frozen=True)
class Adam:
    """`torch.optim.Adam` (L2 weight decay added to the gradient, not AdamW's decoupled
    decay), with `amsgrad` its AMSGrad variant; per group as `Adam.step` calls
    `adam(..., foreach=True)`, state created lazily as `Adam._init_group` does."""

    vectorises: ClassVar[str] = (
        "torch's adam reads each tensor's step count as a Python number, which clients "
        "stacked together do not share"
    )
    lr: float
    betas: tuple[float, float]
    eps: float
    amsgrad: bool

    def step(
        self,
        groups: list[ParamGroup],
        params: Mapping[str, torch.Tensor],
        grads: Mapping[str, torch.Tensor],
        state: dict[str, torch.Tensor],
    ) -> None:
        for group in groups:
            names = [k for k in group.names if k in grads]
            for k in names:
                if _STEP + k not in state:
                    self._init(k, params[k], state)
            adam(
                [params[k] for k in names],
                [grads[k] for k in names],
                [state[_AVG + k] for k in names],
                [state[_SQ + k] for k in names],
                [state[_MAX + k] for k in names] if self.amsgrad else [],
                [state[_STEP + k] for k in names],
                foreach=True,
                amsgrad=self.amsgrad,
                beta1=self.betas[0],
                beta2=self.betas[1],
                lr=self.lr,
                weight_decay=group.weight_decay,
                eps=self.eps,
                maximize=False,
            )

    def _init(self, name: str, p: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        state[_STEP + name] = torch.tensor(0.0, dtype=torch.get_default_dtype())
        state[_AVG + name] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state[_SQ + name] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if self.amsgrad:
            state[_MAX + name] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def restore(self, kept: State, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        kinds = (_STEP, _AVG, _SQ, _MAX) if self.amsgrad else (_STEP, _AVG, _SQ)
        restored = _fitting(kept, params, kinds, _AVG)
        complete = {k for k in params if all(kind + k in restored for kind in kinds)}
        return {n: v for n, v in restored.items() if n.split("/", 1)[1] in complete}

    def full_state(
        self, state: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """`state` and a fresh state (`_init`) for each of `params` without one."""
        full = dict(state)
        for k, p in params.items():
            if _STEP + k not in full:
                self._init(k, p, full)
        return full


def optimiser_for(settings: LocalTraining) -> Optimiser:
    """The optimiser `settings.optimizer` names, with this round's lr."""
    if settings.optimizer == "sgd":
        return SGD(settings.lr, settings.momentum)
    return Adam(settings.lr, settings.betas, settings.eps, amsgrad=settings.optimizer == "amsgrad")
