"""Strategies for tests: FedAvg's server built from its parts, with any part replaced; the
hand-off an engine gives `aggregate`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from typing import Any

import torch

from hetfl.core.server.assign import UniformSampling, one_spec
from hetfl.core.server.strategy import Aggregation, Evaluation, Extras, Strategy
from hetfl.core.server.update import Averaged
from hetfl.core.server.weighting import by_samples
from hetfl.core.training import LocalTraining
from hetfl.core.types import (
    ClientResult,
    ClientTask,
    ModelFamily,
    ServerResult,
    Trained,
    TrainedRound,
)


def fedavg(
    family: ModelFamily, *, clients_per_round: int, train: LocalTraining, **parts: Any
) -> Strategy:
    """Uniform sampling, the family's one spec, the sample-weighted average; `parts`
    replace any of them or add others (`transforms=`, `server_side=`, ...), each into the
    record (`Aggregation`, `Evaluation`, `Extras`) that has a field of its name."""
    chosen: dict[str, Any] = {
        "sampler": UniformSampling(clients_per_round),
        "assignment": one_spec(family.global_spec([])),
        "weighting": by_samples,
        "server_update": Averaged(),
        **parts,
    }
    records = {}
    for record in (Aggregation, Evaluation, Extras):
        mine = {f.name: chosen.pop(f.name) for f in fields(record) if f.name in chosen}
        records[record.__name__.lower()] = record(**mine)
    return Strategy(family, train=train, **chosen, **records)


def trained(
    tasks: Sequence[ClientTask],
    results: Sequence[ClientResult],
    server_results: Sequence[ServerResult] | None = None,
) -> TrainedRound:
    """What an engine hands `Strategy.aggregate`: each result with its client's task (from
    `tasks`, the round's plan), in client-id order."""
    by_cid = {t.cid: t for t in tasks}
    pairs = tuple(Trained(by_cid[r.cid], r) for r in sorted(results, key=lambda r: r.cid))
    served = None if server_results is None else tuple(server_results)
    return TrainedRound(pairs, server_results=served)


def constant_results(tasks: Sequence[ClientTask]) -> list[ClientResult]:
    """Each task's client uploading its payload's every element as 1 + 2 * cid, from
    10 + 20 * cid samples: an aggregate a test can work out by hand."""
    return [
        ClientResult(
            t.cid,
            {k: torch.full_like(v, 1.0 + 2 * t.cid) for k, v in t.payload.items()},
            num_examples=10 + 20 * t.cid,
            num_steps=1,
            loss=0.0,
        )
        for t in tasks
    ]
