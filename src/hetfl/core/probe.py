"""One job: what a probe is, a metric of the main global model on samples made from the
global test set, which a part outside the engines (an attack) registers with a run.

The engines score a probe as they score the test set, in the same exchange, and report
its accuracy under its `metric`, a `metrics.jsonl` key; they never know what the samples
mean. A backdoor's attack success is one (`hetfl.attacks.trigger.AttackSuccess`).
"""

from __future__ import annotations

from typing import Protocol

import torch


class Probe(Protocol):
    """`samples(x, y)` turns the global test set into the probe's (x, y) once, at the
    run's start; the share of them the main global model classifies as labelled is the
    round's `metric` (null for a method with no global model)."""

    @property
    def metric(self) -> str: ...

    def samples(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...
