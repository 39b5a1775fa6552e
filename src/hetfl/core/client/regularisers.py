"""Generic local regularisers. Two first used by FedALRC: Wei, Li, Liu and Wang, "Non-IID
Federated Learning With Sharper Risk Bound" (IEEE TNNLS 35(5), 2024), §IV, Algorithms 1-2;
one by FLANC: Mei et al., "Resource-Adaptive Federated Learning with All-In-One Neural
Composition" (NeurIPS 2022).

- `RademacherTerm`, a loss term (Algorithm 2): α ℜ with ℜ = (1/Q) Σ_q (1/(BC))
  Σ_{i,c} ε^q_ic f_c(x_i), fresh Rademacher signs ε^q ∈ {±1}^{B x C} per draw and batch,
  added only while the locality gate (1/B) Σ_i ℓ_i² ≤ r holds (on detached losses). Signs
  are drawn only on batches whose gate is open, from the client's training generator.
- `PartialSVT`, a projection (Algorithm 1): after every step, the singular values of a
  weight matrix after the first ϑ are soft-thresholded by α η_l, the proximal step of
  α Σ_{j>ϑ} σ_j.
- `OrthogonalityPenalty`, a loss term (FLANC's λ, supplementary Table 1; the authors' code,
  HarukiYqM/All-In-One-Neural-Composition `orth_loss`): λ Σ_banks mean((B Bᵀ - I)²) over the
  shared neural bases, each bank flattened to B of shape (R2, R1 k²), so that the R2 bases
  stay orthonormal while clients of every capacity train them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from hetfl.core.client.recipe import TrainContext, Vectorises

#: `(Q, B, C, ctx) -> signs` of shape (Q, B, C) in {-1, +1}; tests inject fixed signs.
SignSource = Callable[[int, int, int, TrainContext], torch.Tensor]


def rademacher_signs(q: int, b: int, c: int, ctx: TrainContext) -> torch.Tensor:
    """Q fresh B x C Rademacher matrices from the client's training generator."""
    return torch.randint(0, 2, (q, b, c), generator=ctx.generator).mul_(2).sub_(1)


def rademacher_term(outputs: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """ℜ = (1/Q) Σ_q (1/(BC)) Σ_{i,c} ε^q_ic f_c(x_i) for outputs (B, C), signs (Q, B, C).

    Averaging the signs first is the same sum with one product (the paper's in-place
    Q-average)."""
    return (signs.to(outputs).mean(dim=0) * outputs).mean()


def partial_svt(matrix: torch.Tensor, keep: int, threshold: float) -> torch.Tensor:
    """`matrix` with its singular values after the first `keep` soft-thresholded by
    `threshold` (never below zero): the proximal operator of threshold · Σ_{j>keep} σ_j."""
    u, s, vh = torch.linalg.svd(matrix, full_matrices=False)  # s descending
    shrunk = torch.cat([s[:keep], (s[keep:] - threshold).clamp_min(0)])
    return (u * shrunk) @ vh


@dataclass(frozen=True, eq=False)
class RademacherTerm:
    """A loss term, α ℜ on outputs (B, C) behind the locality gate (`gated`); also a
    tracker whose `finish` gives `regularised_steps`, the number of steps the term was
    added on, so that the gate can be observed. List it in both `loss_terms` and
    `trackers`."""

    vectorises: ClassVar[str] = (
        "it opens its gate on the value of the batch's loss and then draws Rademacher signs "
        "from the client's generator"
    )
    alpha: float
    q: int = 5
    radius: float = 1.0
    gated: bool = True
    signs: SignSource = rademacher_signs

    def __post_init__(self) -> None:
        if not (self.alpha >= 0 and math.isfinite(self.alpha)):
            raise ValueError(f"alpha must be a finite number >= 0, got {self.alpha}")
        if self.q < 1:
            raise ValueError(f"Q (Rademacher draws per batch) must be >= 1, got {self.q}")
        if not self.radius > 0:
            raise ValueError(f"r (the locality radius) must be > 0, got {self.radius}")

    def __call__(
        self, outputs: torch.Tensor, y: torch.Tensor, per_sample: torch.Tensor, ctx: TrainContext
    ) -> torch.Tensor | None:
        if self.alpha == 0:
            return None
        if self.gated and float((per_sample.detach() ** 2).mean()) > self.radius:
            return None
        if outputs.dim() != 2:
            raise ValueError(
                f"the Rademacher term needs (batch, classes) outputs, got shape "
                f"{tuple(outputs.shape)}"
            )
        b, c = outputs.shape
        signs = self.signs(self.q, b, c, ctx)
        scratch = ctx.scratch(self)
        scratch["regularised_steps"] = scratch.get("regularised_steps", 0) + 1
        return self.alpha * rademacher_term(outputs, signs)

    def after_step(self, ctx: TrainContext) -> None:
        return None

    def finish(self, ctx: TrainContext) -> dict[str, Any]:
        return {"regularised_steps": ctx.scratch(self).get("regularised_steps", 0)}


@dataclass(frozen=True)
class PartialSVT:
    """A projection: the weight `weight` (C x D) replaced after every step by its partial
    singular-value thresholding, keeping the first `theta` and shrinking the rest by
    α·η_l (this round's lr)."""

    vectorises: ClassVar[Vectorises] = Vectorises.PER_CLIENT
    weight: str
    shape: Sequence[int]
    alpha: float
    theta: int

    def __post_init__(self) -> None:
        if not (self.alpha >= 0 and math.isfinite(self.alpha)):
            raise ValueError(f"alpha must be a finite number >= 0, got {self.alpha}")
        if len(self.shape) != 2:
            raise ValueError(
                f"{self.weight!r} has shape {tuple(self.shape)}; thresholding needs a matrix"
            )
        rank = min(self.shape)
        if not 0 <= self.theta <= rank:
            raise ValueError(
                f"theta = {self.theta} is out of range for the {self.shape[0]}x{self.shape[1]} "
                f"weight {self.weight!r}: allowed 0..{rank} = min(D, C) (0 thresholds every "
                "singular value)"
            )

    @torch.no_grad()
    def __call__(self, params: Mapping[str, torch.Tensor], ctx: TrainContext) -> None:
        if self.alpha == 0:
            return
        w = params[self.weight]
        w.copy_(partial_svt(w, self.theta, self.alpha * ctx.settings.lr))


def orthogonality(bank: torch.Tensor) -> torch.Tensor:
    """mean((B Bᵀ - I)²) for a bank of shape (R2, ...) flattened to B (R2, rest): the mean
    over the R2² entries, as `nn.MSELoss(B Bᵀ, I)` computes it."""
    b = bank.reshape(bank.shape[0], -1)
    gram = b @ b.T
    eye = torch.eye(b.shape[0], dtype=b.dtype, device=b.device)
    return (gram - eye).pow(2).mean()


@dataclass(frozen=True)
class OrthogonalityPenalty:
    """A loss term: `lam` times the sum of `orthogonality` over the client's parameters
    that its model declares in `role` (`ctx.roles`: the composed layers' banks declare
    "basis", `hetfl.core.roles.tensor_roles`). Adds nothing when `lam` is 0; a model
    without such parameters is an error, since the term would silently do nothing."""

    vectorises: ClassVar[Vectorises] = Vectorises.PER_CLIENT
    lam: float
    role: str = "basis"

    def __post_init__(self) -> None:
        if not (self.lam >= 0 and math.isfinite(self.lam)):
            raise ValueError(f"lambda_orth must be a finite number >= 0, got {self.lam}")

    def __call__(
        self, outputs: torch.Tensor, y: torch.Tensor, per_sample: torch.Tensor, ctx: TrainContext
    ) -> torch.Tensor | None:
        if self.lam == 0:
            return None
        banks = [p for name, p in ctx.params.items() if ctx.roles.get(name) == self.role]
        if not banks:
            raise ValueError(
                f"the orthogonality penalty found no parameter of role {self.role!r} in the "
                "client's model: it needs a model of composed layers (composed-*)"
            )
        return self.lam * torch.stack([orthogonality(b) for b in banks]).sum()
