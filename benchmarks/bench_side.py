"""What every side of the benchmark shares: its clock, its report and the optional profile.

A side's clock starts before it loads the data (`SideClock()`), marks the start of round 1
(`start_rounds`), each metrics row (`row`) and the end of its run (`end`, after the last
checkpoint). Round k's time runs from row k-1 (round 1: from `start_rounds`) to row k, so
it holds everything between two rows: sampling, extraction, dispatch, training,
aggregation, every evaluation and the previous round's checkpoint. The total runs from
before the data is loaded to the end, so it holds pool start-up and data sharing too.
"""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path
from typing import Any

import torch


class SideClock:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.rounds_start: float | None = None
        self.rows: list[float] = []
        self.finish: float | None = None

    def start_rounds(self) -> None:
        self.rounds_start = time.perf_counter()

    def row(self) -> None:
        self.rows.append(time.perf_counter())

    def end(self) -> None:
        self.finish = time.perf_counter()

    def report(self) -> dict[str, Any]:
        if self.rounds_start is None or self.finish is None:
            raise RuntimeError("the side's clock was not started and ended")
        marks = [self.rounds_start, *self.rows]
        return {
            "total_s": self.finish - self.t0,
            "setup_s": self.rounds_start - self.t0,
            "round_s": [b - a for a, b in itertools.pairwise(marks)],
        }


def save_atomically(state: dict[str, torch.Tensor], path: Path) -> None:
    """A floor's checkpoint, written as HetFL writes its own (`hetfl.engine.checkpoint`):
    to a temporary name, flushed, fsynced and renamed."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as fh:
        torch.save(state, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


class Profile:
    """cProfile of the timed part when `path` is set (with `--side`), else nothing."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.profiler: Any = None

    def __enter__(self) -> Profile:
        if self.path:
            import cProfile

            self.profiler = cProfile.Profile()
            self.profiler.enable()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.profiler is not None:
            self.profiler.disable()
            self.profiler.dump_stats(self.path)
