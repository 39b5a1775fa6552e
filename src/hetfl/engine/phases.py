"""How long each phase of a run took, in wall and CPU seconds, for `summary.json`'s `phases`.

A run spends time outside its rounds' training (loading and partitioning the data, the
strategy's set-up queries such as FedFA's ZiCo scores) and inside a round in parts that are
not training (the server phase, the evaluation and its statistics passes). Each is timed
here as a phase, so that a slow one is found by reading the summary, not by profiling.

CPU seconds are those of this process and every live process below it (`tree_cpu_s`): the
process executor's fork server and workers, a local Ray's processes. Only these, not the
machine's: on a machine shared with other work, `cpu_s / (wall_s x cores)` is the share of
the machine's cores this run kept busy during the phase.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Where Linux lists its processes; elsewhere only this process's CPU time is counted.
PROC = Path("/proc")


@dataclass(frozen=True)
class PhaseTime:
    """One phase's seconds: `wall_s` elapsed, `cpu_s` of the run's processes."""

    wall_s: float
    cpu_s: float

    def record(self) -> dict[str, float]:
        return {"wall_s": round(self.wall_s, 3), "cpu_s": round(self.cpu_s, 3)}


@dataclass
class PhaseLog:
    """The run's phases: set-up phases by name, round phases by round and name. A phase
    timed twice (a round evaluated in two steps) adds up."""

    setup: dict[str, PhaseTime] = field(default_factory=dict)
    rounds: dict[int, dict[str, PhaseTime]] = field(default_factory=dict)

    @contextmanager
    def timed(self, name: str, rnd: int | None = None) -> Iterator[None]:
        """Time the block as phase `name` (of round `rnd`, or of the set-up), whether it
        returns or raises."""
        wall, cpu = time.perf_counter(), tree_cpu_s()
        try:
            yield
        finally:
            spent = PhaseTime(time.perf_counter() - wall, tree_cpu_s() - cpu)
            phases = self.setup if rnd is None else self.rounds.setdefault(rnd, {})
            before = phases.get(name, PhaseTime(0.0, 0.0))
            phases[name] = PhaseTime(before.wall_s + spent.wall_s, before.cpu_s + spent.cpu_s)

    def record(self) -> dict[str, Any]:
        """`{"cores", "setup": {name: {wall_s, cpu_s}}, "rounds": {"<round>": {...}}}`."""
        return {
            "cores": os.cpu_count(),
            "setup": {name: t.record() for name, t in self.setup.items()},
            "rounds": {
                str(rnd): {name: t.record() for name, t in phases.items()}
                for rnd, phases in sorted(self.rounds.items())
            },
        }


def tree_cpu_s() -> float:
    """User and system CPU seconds of this process and its live descendants (Linux, read
    from /proc); elsewhere this process's alone."""
    own = time.process_time()
    if not PROC.is_dir():
        return own
    parents: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # it ended while we looked
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (name) "
        parents[int(entry.name)] = int(fields[1])
        ticks[int(entry.name)] = int(fields[11]) + int(fields[12])  # utime + stime
    below: set[int] = set()
    frontier = {os.getpid()}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - below
        below |= frontier
    return own + sum(ticks[pid] for pid in below) / os.sysconf("SC_CLK_TCK")
