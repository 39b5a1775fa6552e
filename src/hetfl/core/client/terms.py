"""Generic parts of local training (`hetfl.core.client.recipe`) that several methods use."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from hetfl.core.client.recipe import ModelCall, TrainContext, Vectorises


@dataclass(frozen=True)
class ProximalTerm:
    """A gradient transform: adds mu (w - w_received) to the gradient of every parameter
    the client received, the gradient of FedProx's proximal term (mu/2) ||w - w^t||²
    (Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020, Algorithm
    2). Parameters the client did not receive (private ones) have no anchor and get none.
    Shapes: each gradient and its parameter and anchor alike; in place on the gradients.
    Elementwise, so it runs on a stack of clients as it is, the stacked payload as anchor."""

    vectorises: ClassVar[Vectorises] = Vectorises.ELEMENTWISE
    mu: float

    def __post_init__(self) -> None:
        if not self.mu >= 0:
            raise ValueError(f"mu must be >= 0, got {self.mu}")

    @torch.no_grad()
    def __call__(
        self, grads: dict[str, torch.Tensor], params: Mapping[str, torch.Tensor], ctx: TrainContext
    ) -> None:
        if self.mu == 0:
            return
        for name, grad in grads.items():
            anchor = ctx.received.get(name)
            if anchor is not None:
                grad.add_(params[name] - anchor, alpha=self.mu)


@dataclass(frozen=True)
class ClipGradNorm:
    """A gradient transform: scales all gradients together so that their joint L2 norm is
    at most `max_norm`, as `torch.nn.utils.clip_grad_norm_` does (coefficient
    max_norm / (norm + 1e-6), capped at 1). The loop appends it after the recipe's
    transforms when `LocalTraining.clip_grad_norm` is set. Per-tensor kernels, not the
    `foreach` ones, which `torch.func.vmap` cannot batch (on a CPU the `foreach` kernels
    loop over these same kernels: the bits are `clip_grad_norm_`'s)."""

    vectorises: ClassVar[Vectorises] = Vectorises.PER_CLIENT
    max_norm: float

    def __call__(
        self, grads: dict[str, torch.Tensor], params: Mapping[str, torch.Tensor], ctx: TrainContext
    ) -> None:
        clip_grads(grads, self.max_norm)


def clip_grads(grads: Mapping[str, torch.Tensor], max_norm: float) -> None:
    """Scale the gradients in place so that their joint L2 norm is at most `max_norm`
    (`ClipGradNorm`; a split-learning server copy clips its own side with it), with
    per-tensor kernels, which `torch.func.vmap` can batch."""
    tensors = list(grads.values())
    if not tensors:
        return
    total = torch.nn.utils.get_total_norm(tensors, foreach=False)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in tensors:
        grad.mul_(coef)


def mask_logits(outputs: torch.Tensor, labels: tuple[int, ...] | None) -> torch.Tensor:
    """Logits of the classes not in `labels` set to 0 (HeteroFL's and FedFA's masked
    cross-entropy: HeteroFL, ICLR 2021, §3, and its code `models/resnet.py`; FedFA,
    arXiv 2406.09877, §5.1; 0, not -inf, which would be a different loss)."""
    if labels is None:
        return outputs
    return outputs.masked_fill(~kept_classes(labels, outputs.shape[-1], outputs.device), 0.0)


def kept_classes(
    labels: tuple[int, ...], num_classes: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """(num_classes,) bool, True for the classes in `labels`: the logits `mask_logits`
    keeps."""
    keep = torch.zeros(num_classes, dtype=torch.bool, device=device)
    keep[list(labels)] = True
    return keep


@dataclass(frozen=True)
class MaskedCrossEntropy:
    """A forward: cross-entropy with the logits of the classes the client lacks
    (`ClientInfo.labels`) set to 0 (`mask_logits`). Outputs (B, C) masked, loss (B,). The
    mask of the lacking classes is the client's `constant`, so clients stacked with
    different classes each have their own."""

    vectorises: ClassVar[Vectorises] = Vectorises.PER_CLIENT

    def __call__(
        self, model: ModelCall, x: torch.Tensor, y: torch.Tensor, ctx: TrainContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        outputs = model(x)
        lacking = ctx.constant(self, "lacking", lambda: _lacking(ctx, outputs))
        outputs = outputs.masked_fill(lacking, 0.0)
        return outputs, F.cross_entropy(outputs, y, reduction="none")


def _lacking(ctx: TrainContext, outputs: torch.Tensor) -> torch.Tensor:
    """(C,) bool, True for the classes the client lacks (none without its `ClientInfo`)."""
    classes = outputs.shape[-1]
    if ctx.info is None:
        return torch.zeros(classes, dtype=torch.bool, device=outputs.device)
    return ~kept_classes(ctx.info.labels, classes, outputs.device)


@dataclass(frozen=True, eq=False)
class StepNormaliser:
    """A tracker of ‖a‖₁ step by step for SGD with momentum and a proximal term of weight
    `mu` (0 without one); `finish` gives the result's `a_norm` and `steps` extras (Wang et
    al., "Tackling the Objective Inconsistency Problem in Heterogeneous Federated
    Optimization", NeurIPS 2020, §4 and Appendix C: the normalised averaging of FedNova,
    which FedALRC also uses). It counts on each client's own context, under the vectorised
    executor too."""

    vectorises: ClassVar[Vectorises] = Vectorises.PER_CLIENT
    mu: float = 0.0

    @staticmethod
    def advance(
        a_norm: float, counter: float, momentum: float, lr_mu: float
    ) -> tuple[float, float]:
        """One local step of the ‖a‖₁ recursion: returns (‖a‖₁, momentum counter)."""
        if momentum != 0:
            counter = counter * momentum + 1
            a_norm += counter
        if lr_mu != 0:
            a_norm = a_norm * (1 - lr_mu) + 1
        if momentum == 0 and lr_mu == 0:
            a_norm += 1
        return a_norm, counter

    def after_step(self, ctx: TrainContext) -> None:
        own = ctx.scratch(self)
        a_norm, counter = own.get("a_norm", 0.0), own.get("counter", 0.0)
        lr_mu = ctx.settings.lr * self.mu
        own["a_norm"], own["counter"] = self.advance(a_norm, counter, ctx.settings.momentum, lr_mu)
        own["steps"] = own.get("steps", 0) + 1

    def finish(self, ctx: TrainContext) -> dict[str, Any]:
        own = ctx.scratch(self)
        return {"a_norm": own["a_norm"], "steps": own["steps"]}
