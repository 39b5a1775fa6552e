"""Option records several methods share, so that a method's options compose the records
of the parts it uses instead of inheriting another method's options: FedBN's and FedPer's
private layers (any method that averages one model can keep layers on its clients), a
proximal term (FedProx, FedNova-Prox), a server optimiser (FedOpt's Adagrad, Adam and Yogi,
Ada-FedALRC) and its moments, and the BatchNorm kind of FedFA's baselines (each with
the shared aggregation options, `AggregationOptions`: reducer, weighting, sampling); and
DTFL's tier scheduler."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from hetfl.algorithms.parts.method_registry import AggregationOptions, Options
from hetfl.algorithms.parts.tier_scheduler import NoHistory, Observed, OnSwitch
from hetfl.models.resnet_cifar import TIERS

PrivateNorm = Annotated[
    bool, Field(description="FedBN: every normalisation tensor stays on its client, never sent")
]
PrivateHead = Annotated[
    bool, Field(description="FedPer: the classifier head stays on its client, never sent")
]


class PrivateLayerOptions(AggregationOptions):
    """Which layers stay on the client (Li et al., FedBN, ICLR 2021, §3: every
    normalisation tensor; Arivazhagan et al., FedPer, 2019, §3: the classifier head)."""

    private_norm: PrivateNorm = False
    private_head: PrivateHead = False


class BatchNormKindOptions(AggregationOptions):
    """FlexiFed's and NeFL's BatchNorm: `batch`, running statistics averaged with their
    layer (each method's own); `static`, batch statistics in training and a statistics pass
    before every evaluation, as FedFA's paper runs every method it compares (Park and
    Joe-Wong, "Federated Learning with Flexible Architectures", ECML-PKDD 2024, §5.1 and
    App. G: static BN for all), for comparisons on one normalisation."""

    bn: Literal["batch", "static"] = Field(
        "batch",
        description="batch: running statistics averaged with their layer; static: batch "
        "statistics in training and a statistics pass before every evaluation (FedFA's)",
    )


class ProximalOptions(AggregationOptions):
    """The proximal term's weight μ (Li et al., FedProx, MLSys 2020, Eq. 2)."""

    mu: float = Field(0.01, ge=0, description="proximal weight")


class ServerOptimiserOptions(AggregationOptions):
    """An adaptive server optimiser's step size, adaptivity and initial second moment
    (Reddi et al., "Adaptive Federated Optimization", ICLR 2021, Algorithm 2)."""

    server_lr: float = Field(0.1, gt=0, description="η, the server optimiser's step size")
    tau: float = Field(1e-3, gt=0, description="τ, the adaptivity added to √v in the step")
    v0: float | None = Field(None, ge=0, description="initial second moment v (default τ²)")


class MomentOptions(ServerOptimiserOptions):
    """A server optimiser with moment decays (Reddi et al., Algorithm 2: Adam, Yogi)."""

    beta1: float = Field(0.9, ge=0, lt=1, description="decay of the first moment (momentum)")
    beta2: float = Field(0.99, ge=0, lt=1, description="decay of the second moment")


class TierSchedulerOptions(Options):
    """DTFL's tier scheduler: the tiers it may assign, where a client without a history
    goes, what it observes of a client's compute and what a device change does to its
    estimates ("Speed up Federated Learning in Heterogeneous Environment: A Dynamic Tiering
    Approach", §3.3, Eq. (5); `hetfl.algorithms.parts.tier_scheduler`)."""

    tiers: tuple[int, ...] = Field(TIERS, description="the tiers the scheduler may assign")
    default_tier: int = Field(
        2, description="the tier of a client without a history under no_history: default-tier"
    )
    no_history: NoHistory = Field(
        "default-tier",
        description="a client without a history (every client in round 1): default_tier, or "
        "the tier the scheduler's rule gives from its device profile (the paper's tier "
        "profiling before training)",
    )
    observed: Observed = Field(
        "elapsed-minus-comm",
        description="a client's observed compute: its side's elapsed time (compute and "
        "transfers, never waiting for the server) minus the estimated communication, or "
        "its exact simulated compute",
    )
    on_profile_change: OnSwitch = Field(
        "keep", description="keep (the paper's EMA) or reset a client's estimates on a new device"
    )

    @field_validator("tiers")
    @classmethod
    def _tiers_of_the_model(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        wrong = [m for m in v if m not in TIERS]
        if not v or wrong or len(set(v)) != len(v):
            raise ValueError(
                f"tiers must be distinct tiers of 1..7 (tier m: the client trains md1..md_m), "
                f"got {list(v)}"
            )
        return tuple(sorted(v))

    @model_validator(mode="after")
    def _default_is_a_tier(self) -> TierSchedulerOptions:
        if self.default_tier not in self.tiers:
            raise ValueError(
                f"default_tier {self.default_tier} is not one of tiers {list(self.tiers)}; "
                "choose one of them"
            )
        return self
