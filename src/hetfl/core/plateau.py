"""The learning rate cut on a plateau of an evaluated accuracy, for any method.

DTFL ("Speed up Federated Learning in Heterogeneous Environment: A Dynamic Tiering
Approach", App. A.3) multiplies the lr of both sides by 0.9 "once the accuracy has reached
a plateau"; its authors' code (mahmoudsajjadi/DTFL `main.py`) does it with PyTorch's
`ReduceLROnPlateau(mode="max", factor=0.9, patience=10)` stepped on the test accuracy
after every round. `PlateauLr` is that rule as a part of a `Strategy`
(`hetfl.core.server.strategy`): it watches the metrics rows the engine hands to
`Strategy.observe` and keeps a factor that `Strategy._task_config` multiplies into each
task's lr, after the run's `lr_schedule`, so both apply. A server side that reads its lr
from the task (DTFL's) follows it too.

The rule, as PyTorch's (threshold mode "rel", cooldown 0): the monitored value improves
when it exceeds `best * (1 + threshold)`; otherwise the round is bad; after more than
`patience` bad evaluated rounds in a row the factor is multiplied by `factor` and the count
starts again. (PyTorch skips a cut smaller than 1e-8 in absolute lr; the factor here is cut
regardless.) Its state (best, bad rounds, factor) is the strategy's extra state, so a
resumed run cuts where an uninterrupted one does.

What it monitors is a metrics key: `val_acc` (a validation split held out of the clients'
training data), or `global_acc`, the test accuracy, as the paper does: the test set then
steers training, which is why a config must ask for it by name.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

#: The metrics keys a plateau may watch (`docs/contracts.md` §1.7).
Monitor = Literal["val_acc", "global_acc"]
MONITORS: tuple[Monitor, ...] = ("val_acc", "global_acc")


@dataclass(frozen=True)
class PlateauSettings:
    """Cut the lr by `factor` after more than `patience` evaluated rounds in which
    `monitor` did not beat its best by a relative `threshold`. Defaults: DTFL's."""

    monitor: Monitor = "val_acc"
    factor: float = 0.9
    patience: int = 10
    threshold: float = 1e-4

    def __post_init__(self) -> None:
        if self.monitor not in MONITORS:
            raise ValueError(
                f"lr_plateau.monitor must be one of {list(MONITORS)}, got {self.monitor!r}"
            )
        if not 0 < self.factor < 1:
            raise ValueError(f"lr_plateau.factor must be in (0, 1), got {self.factor!r}")
        if self.patience < 0:
            raise ValueError(f"lr_plateau.patience must be >= 0, got {self.patience!r}")
        if not (self.threshold >= 0 and math.isfinite(self.threshold)):
            raise ValueError(
                f"lr_plateau.threshold must be a finite number >= 0, got {self.threshold!r}"
            )

    def describe(self) -> str:
        """One line for the start banner; it says when the test set steers training."""
        line = (
            f"x{self.factor:g} after {self.patience} evaluated rounds without a "
            f"{self.threshold:g} relative gain in {self.monitor}"
        )
        if self.monitor == "global_acc":
            line += " (test accuracy, as the DTFL paper does: the test set steers training)"
        return line


class PlateauLr:
    """The plateau rule's state over a run: `factor` multiplies each task's lr."""

    def __init__(self, settings: PlateauSettings) -> None:
        self.settings = settings
        self.best = -math.inf
        self.bad_rounds = 0
        self.factor = 1.0

    def observe(self, round: int, row: Mapping[str, Any]) -> None:
        """Take one evaluated round's metrics row."""
        key = self.settings.monitor
        value = row.get(key)
        if value is None or not math.isfinite(value):
            raise ValueError(
                f"lr_plateau monitors {key}, but round {round}'s metrics row has {key} = "
                f"{value!r}; monitor a metric the run computes (val_acc needs "
                "data.validation; global_acc needs a global model)"
            )
        if value > self.best * (1 + self.settings.threshold):  # always above -inf
            self.best, self.bad_rounds = float(value), 0
            return
        self.bad_rounds += 1
        if self.bad_rounds > self.settings.patience:
            self.factor *= self.settings.factor
            self.bad_rounds = 0

    def extra_state(self) -> dict[str, Any]:
        return {
            "lr_plateau": {"best": self.best, "bad_rounds": self.bad_rounds, "factor": self.factor}
        }

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        kept = state["lr_plateau"]
        self.best = float(kept["best"])
        self.bad_rounds = int(kept["bad_rounds"])
        self.factor = float(kept["factor"])
