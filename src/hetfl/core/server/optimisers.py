"""Server optimisers: how the server moves the global state along an aggregated direction.

Reddi et al., "Adaptive Federated Optimization" (ICLR 2021), Algorithm 2, with Flower's
FedAdagrad/FedYogi strategies (`flwr/server/strategy/fedadagrad.py`, `fedyogi.py`) for what
the paper leaves open (defaults, no bias correction). The strategy computes a *direction* per
tensor — FedOpt's pseudo-gradient `Δ = average(w_k) - w`, FedNova's `-τ_eff Σ p_k g_k /
‖a_k‖₁`, FedALRC's normalised update — and the optimiser applies

    m ← β1 m + (1 - β1) Δ
    v ← v + Δ²                                   (adagrad)
    v ← β2 v + (1 - β2) Δ²                       (adam)
    v ← v - (1 - β2) Δ² sign(v - Δ²)             (yogi)
    w ← w + η m / (sqrt(v) + τ)

with no bias correction; `sgd` is `w ← w + η m` (with β1 = 0 and η = 1 it adds the
direction as it is). One implementation serves FedAdagrad/FedAdam/FedYogi, FedNova and
Ada-FedALRC, so their defaults cannot drift apart.

Choices where the paper is silent: moments are created lazily, per tensor, at the first
step, with `v` filled with `v0` (the paper asks for v ≥ τ²; Flower starts from 0; pass the
value you want, the default is τ²); moments live in float32 like the weights; a tensor
missing from the direction (a BatchNorm buffer, an integer counter) is left to the strategy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from hetfl.core.state import State

ServerOptKind = Literal["sgd", "adagrad", "adam", "yogi"]
KINDS: tuple[str, ...] = ("sgd", "adagrad", "adam", "yogi")


@dataclass(frozen=True)
class ServerOptSettings:
    kind: ServerOptKind = "sgd"
    lr: float = 1.0
    beta1: float = 0.0
    beta2: float = 0.99
    tau: float = 1e-3
    v0: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"server optimiser must be one of {KINDS}, got {self.kind!r}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"server lr must be a positive finite number, got {self.lr}")
        if not 0 <= self.beta1 < 1:
            raise ValueError(f"beta1 must be in [0, 1), got {self.beta1}")
        if not 0 <= self.beta2 < 1:
            raise ValueError(f"beta2 must be in [0, 1), got {self.beta2}")
        if self.kind != "sgd" and not self.tau > 0:
            raise ValueError(f"tau must be > 0 for {self.kind}, got {self.tau}")
        if self.v0 is not None and self.v0 < 0:
            raise ValueError(f"v0 must be >= 0, got {self.v0}")

    @property
    def initial_v(self) -> float:
        return self.tau**2 if self.v0 is None else self.v0


class ServerOptimizer:
    """Applies `ServerOptSettings` to a named-tensor state; its moments are checkpointed."""

    def __init__(self, settings: ServerOptSettings) -> None:
        self.settings = settings
        self.m: State = {}
        self.v: State = {}

    @torch.no_grad()
    def step(
        self, state: Mapping[str, torch.Tensor], direction: Mapping[str, torch.Tensor]
    ) -> State:
        """The new state: tensors named in `direction` moved along it, the rest copied."""
        s = self.settings
        out = {k: v.detach().clone() for k, v in state.items()}
        for name, delta in direction.items():
            w = out[name]
            if not w.is_floating_point():
                raise TypeError(f"cannot apply a server optimiser to integer tensor {name!r}")
            d = delta.to(w.dtype)
            if s.beta1 == 0:
                m = d
            else:
                previous = self.m.get(name)
                m = (
                    (1 - s.beta1) * d
                    if previous is None
                    else s.beta1 * previous + (1 - s.beta1) * d
                )
                self.m[name] = m
            if s.kind == "sgd":
                out[name] = w + s.lr * m
                continue
            v = self.v.get(name)
            if v is None:
                v = torch.full_like(w, s.initial_v)
            d2 = d * d
            if s.kind == "adagrad":
                v = v + d2
            elif s.kind == "adam":
                v = s.beta2 * v + (1 - s.beta2) * d2
            else:  # yogi
                v = v - (1 - s.beta2) * d2 * torch.sign(v - d2)
            self.v[name] = v
            out[name] = w + s.lr * m / (torch.sqrt(v) + s.tau)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"m": dict(self.m), "v": dict(self.v)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.m = dict(state.get("m", {}))
        self.v = dict(state.get("v", {}))
