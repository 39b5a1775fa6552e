"""Learning-rate schedules over the rounds of a run: the lr that each round's tasks carry.

The papers set the lr by round, not by local step: ScalableFL decays it along a cosine over
the rounds (Table VIII) or warms it up and then steps it down (detection, Table IX); FedALRC
multiplies it by 0.1 at 50 % and 0.01 at 75 % of the rounds; HeteroFL steps it at fixed
rounds. One schedule, held by `LocalTraining` and applied by `Strategy._task_config`, serves
every method, and the local optimiser stays fresh each round.

A schedule by fraction of the run reads the planned number of rounds R: a run resumed with
more rounds than it was started with therefore follows the new R from the resumed round on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

ScheduleKind = Literal["constant", "cosine", "step", "exponential"]


@dataclass(frozen=True)
class LrSchedule:
    """The factor on the base lr in round r (1-based) of a run of R rounds.

    - `constant`: 1.
    - `cosine`: (1 + cos(pi (r - 1) / R)) / 2, from 1 in round 1 towards 0.
    - `step`: gamma ** (number of milestones m with r > m), as PyTorch's `MultiStepLR` with
      rounds as epochs. Milestones are all rounds (whole numbers >= 1) or all fractions of
      the run (in (0, 1), m = f * R).
    - `exponential`: gamma ** (r - 1).

    `warmup`, a fraction of the run, multiplies the first W = ceil(warmup * R) rounds by
    r / W (a linear warm-up), on top of the schedule.
    """

    kind: ScheduleKind = "constant"
    milestones: tuple[float, ...] = ()
    gamma: float = 0.1
    warmup: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("constant", "cosine", "step", "exponential"):
            raise ValueError(f"unknown lr schedule {self.kind!r}")
        if not (self.gamma > 0 and math.isfinite(self.gamma)):
            raise ValueError(f"gamma must be a positive finite number, got {self.gamma}")
        if not 0 <= self.warmup < 1:
            raise ValueError(f"warmup is a fraction of the run in [0, 1), got {self.warmup}")
        m = self.milestones
        if self.kind == "step" and not m:
            raise ValueError("a step schedule needs milestones (rounds, or fractions of the run)")
        if self.kind != "step" and m:
            raise ValueError(f"milestones are for a step schedule, not {self.kind!r}")
        if list(m) != sorted(set(m)):
            raise ValueError(f"milestones must be increasing, got {list(m)}")
        fractions = all(0 < v < 1 for v in m)
        rounds = all(v >= 1 and float(v).is_integer() for v in m)
        if m and not (fractions or rounds):
            raise ValueError(
                "milestones are either all rounds (whole numbers >= 1) or all fractions of "
                f"the run (in (0, 1)), got {list(m)}"
            )

    def factor(self, round: int, rounds: int | None) -> float:
        """The multiplier of round `round`; `rounds` (R) is needed unless the schedule is
        constant or steps at rounds without warm-up."""
        needs_rounds = (
            self.kind == "cosine"
            or self.warmup > 0
            or (self.kind == "step" and self.milestones[0] < 1)
        )
        if needs_rounds and not rounds:
            raise ValueError(f"the {self.kind} lr schedule needs the planned number of rounds")
        total = rounds or 0
        if self.kind == "cosine":
            f = 0.5 * (1 + math.cos(math.pi * (round - 1) / total))
        elif self.kind == "step":
            at = [m * total if m < 1 else m for m in self.milestones]
            f = self.gamma ** sum(round > m for m in at)
        elif self.kind == "exponential":
            f = self.gamma ** (round - 1)
        else:
            f = 1.0
        if self.warmup > 0:
            width = math.ceil(self.warmup * total)
            f *= min(1.0, round / width)
        return f
