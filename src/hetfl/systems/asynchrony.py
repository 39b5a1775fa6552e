"""One job: the settings of asynchronous aggregation on the simulated clock, and the
staleness weights its two rules apply.

Two rules, both switched on by `system.asynchronous` (synchronous rounds otherwise):

- **FedAsync** (Xie, Koyejo and Gupta, "Asynchronous Federated Optimization", 2019,
  Algorithm 1): the server mixes each arriving model into the global one at once,
  x <- (1 - a_t) x + a_t x_new with a_t = a * s(t - tau), where t - tau is the update's
  staleness (server steps since its client downloaded) and s one of the paper's staleness
  functions: constant s = 1; polynomial s(d) = (d + 1)^-p; hinge s(d) = 1 for d <= b,
  else 1 / (p (d - b) + 1) (`staleness_exponent` is the paper's a of those two functions,
  renamed so as not to clash with the mixing weight a; `staleness_hinge` its b).
- **FedBuff** (Nguyen et al., "Federated Learning with Buffered Asynchronous Aggregation",
  AISTATS 2022, Algorithm 1): the server buffers arriving updates (deltas from the model
  each client downloaded), each weighted by 1 / sqrt(1 + staleness) (the staleness scaling
  of the paper's experiments), and after `buffer_size` (K) of them takes one step of size
  `server_lr` (eta_g) along their mean.

`concurrency` clients are in flight at a time (both papers' fixed concurrency); the
engine (`hetfl.sim.asynchronous`) orders their completions on the simulated clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

AsyncMode = Literal["fedasync", "fedbuff"]
StalenessKind = Literal["constant", "polynomial", "hinge"]
STALENESS_KINDS: tuple[StalenessKind, ...] = ("constant", "polynomial", "hinge")
ASYNC_MODES: tuple[AsyncMode, ...] = ("fedasync", "fedbuff")


@dataclass(frozen=True)
class AsyncSettings:
    """Asynchronous aggregation, validated on construction (see the module docstring).
    `mixing`, `staleness`, `staleness_exponent` and `staleness_hinge` are FedAsync's;
    `buffer_size` and `server_lr` FedBuff's."""

    mode: AsyncMode
    concurrency: int
    buffer_size: int = 10
    server_lr: float = 1.0
    mixing: float = 0.6
    staleness: StalenessKind = "polynomial"
    staleness_exponent: float = 0.5
    staleness_hinge: int = 4

    def __post_init__(self) -> None:
        if self.mode not in ASYNC_MODES:
            raise ValueError(
                f"system.asynchronous.mode must be one of {ASYNC_MODES}, got {self.mode!r}"
            )
        if self.concurrency < 1:
            raise ValueError(
                f"system.asynchronous.concurrency must be >= 1, got {self.concurrency}"
            )
        if self.buffer_size < 1:
            raise ValueError(
                f"system.asynchronous.buffer_size must be >= 1, got {self.buffer_size}"
            )
        if self.mode == "fedbuff" and self.buffer_size > self.concurrency:
            raise ValueError(
                f"system.asynchronous.buffer_size ({self.buffer_size}) must be at most "
                f"concurrency ({self.concurrency}): a buffer never fills from fewer clients "
                "in flight than it holds"
            )
        if not (math.isfinite(self.server_lr) and self.server_lr > 0):
            raise ValueError(f"system.asynchronous.server_lr must be > 0, got {self.server_lr}")
        if not (math.isfinite(self.mixing) and 0 < self.mixing <= 1):
            raise ValueError(f"system.asynchronous.mixing must be in (0, 1], got {self.mixing}")
        if self.staleness not in STALENESS_KINDS:
            raise ValueError(
                f"system.asynchronous.staleness must be one of {STALENESS_KINDS}, got "
                f"{self.staleness!r}"
            )
        if not (math.isfinite(self.staleness_exponent) and self.staleness_exponent >= 0):
            raise ValueError(
                "system.asynchronous.staleness_exponent must be >= 0, got "
                f"{self.staleness_exponent}"
            )
        if self.staleness_hinge < 0:
            raise ValueError(
                f"system.asynchronous.staleness_hinge must be >= 0, got {self.staleness_hinge}"
            )

    def weight(self, staleness: int) -> float:
        """The factor an update of `staleness` server steps enters with: FedAsync's
        a * s(staleness), FedBuff's 1 / sqrt(1 + staleness)."""
        if staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {staleness}")
        if self.mode == "fedbuff":
            return 1.0 / math.sqrt(1.0 + staleness)
        return self.mixing * self._fedasync_s(staleness)

    def _fedasync_s(self, d: int) -> float:
        if self.staleness == "constant":
            return 1.0
        if self.staleness == "polynomial":
            return float((d + 1) ** -self.staleness_exponent)
        if d <= self.staleness_hinge:
            return 1.0
        return 1.0 / (self.staleness_exponent * (d - self.staleness_hinge) + 1.0)

    def steps_after(self, arrived: int) -> bool:
        """Whether the server steps once `arrived` valid updates wait: FedAsync at every
        one, FedBuff when its buffer is full."""
        return arrived >= (1 if self.mode == "fedasync" else self.buffer_size)

    def describe(self) -> str:
        """One phrase for the start-of-run banner."""
        if self.mode == "fedbuff":
            rule = f"FedBuff (buffer {self.buffer_size}, server lr {self.server_lr:g})"
        else:
            rule = f"FedAsync (mixing {self.mixing:g}, {self.staleness} staleness)"
        return f"asynchronous {rule}, {self.concurrency} in flight"


class AsyncConfig(BaseModel):
    """`system.asynchronous`: aggregate as updates arrive on the simulated clock (off:
    synchronous rounds)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: AsyncMode = Field(description="fedasync (mix each update) or fedbuff (buffer K)")
    concurrency: int = Field(ge=1, description="clients training at a time")
    buffer_size: int = Field(10, ge=1, description="FedBuff: updates per server step (K)")
    server_lr: float = Field(
        1.0, gt=0, allow_inf_nan=False, description="FedBuff: the server's step size (eta_g)"
    )
    mixing: float = Field(
        0.6, gt=0, le=1, allow_inf_nan=False, description="FedAsync: the mixing weight a"
    )
    staleness: StalenessKind = Field(
        "polynomial", description="FedAsync: the staleness function s (constant, polynomial, hinge)"
    )
    staleness_exponent: float = Field(
        0.5, ge=0, allow_inf_nan=False, description="FedAsync: s's exponent or slope (a)"
    )
    staleness_hinge: int = Field(4, ge=0, description="FedAsync: the hinge's free staleness (b)")

    @model_validator(mode="after")
    def _cross_checked(self) -> AsyncConfig:
        self.settings()
        return self

    def settings(self) -> AsyncSettings:
        return AsyncSettings(**self.model_dump())
