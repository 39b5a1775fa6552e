"""Strategies for tests: FedAvg's server built from its parts, with any part replaced."""

from __future__ import annotations

from typing import Any

from hetfl.core.assign import UniformSampling, one_spec
from hetfl.core.server_update import Averaged
from hetfl.core.strategy import Strategy
from hetfl.core.training import LocalTraining
from hetfl.core.types import ModelFamily
from hetfl.core.weighting import by_samples


def fedavg(
    family: ModelFamily, *, clients_per_round: int, train: LocalTraining, **parts: Any
) -> Strategy:
    """Uniform sampling, the family's one spec, the sample-weighted average; `parts`
    replace any of them or add others (`transforms=`, `server_side=`, ...)."""
    chosen: dict[str, Any] = {
        "sampler": UniformSampling(clients_per_round),
        "assignment": one_spec(family.global_spec([])),
        "weighting": by_samples,
        "server_update": Averaged(),
        **parts,
    }
    return Strategy(family, train=train, **chosen)
