"""The arithmetic of `bench_phases.py`: a run's set-up against its round 1, and each phase's
share of the machine's cores, from `summary.json`'s `phases` (docs/contracts.md §1.7).

`phases` holds, per phase, `wall_s` and `cpu_s`, the CPU seconds of the run's process and
every live process below it (the process executor's workers), and `cores`, the machine's.
So `cpu_s / (wall_s x cores)` is the share of the machine the run kept busy in a phase, what
issue 48 item 2 asks to be >= 0.85 ("every phase on every core"). The set-up is `data` plus
`setup`: the strategy's `setup` phase holds its `setup_query` (FedFA's ZiCo scores), so the
query is not added a second time. CPU-second ratios are printed beside the wall ones: on a
machine other work keeps busy, wall times stretch with the load, and CPU seconds much less.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bench_summary import floor_verdict, verdict

#: Issue 48 item 2: the set-up within twice one round, every phase on >= 85 % of the cores.
SETUP_TARGET = 2.0
BUSY_TARGET = 0.85
#: Phases shorter than this are printed without a verdict: a share of a few ticks says nothing.
SHORT_S = 0.5
ROUND_PHASES = ("train", "server_phase", "eval")


@dataclass(frozen=True)
class Span:
    """Wall and CPU seconds of one phase, or of several added up."""

    wall_s: float
    cpu_s: float

    def __add__(self, other: Span) -> Span:
        return Span(self.wall_s + other.wall_s, self.cpu_s + other.cpu_s)

    def busy(self, cores: int) -> float:
        """The share of `cores` kept busy: cpu / (wall x cores)."""
        if self.wall_s <= 0 or cores < 1:
            raise ValueError(f"need wall > 0 and cores >= 1, got {self.wall_s} s, {cores}")
        return self.cpu_s / (self.wall_s * cores)


NOTHING = Span(0.0, 0.0)


def span(phases: Mapping[str, Any], name: str) -> Span:
    """The phase `name` of a `{name: {wall_s, cpu_s}}` record (nothing where absent)."""
    rec = phases.get(name)
    return NOTHING if rec is None else Span(float(rec["wall_s"]), float(rec["cpu_s"]))


def setup_span(phases: Mapping[str, Any]) -> Span:
    """Loading the data plus the strategy's set-up (whose query it already holds)."""
    return span(phases["setup"], "data") + span(phases["setup"], "setup")


def round_span(phases: Mapping[str, Any], rnd: int, names: Sequence[str] = ROUND_PHASES) -> Span:
    """Round `rnd`'s phases `names` added up."""
    rounds = phases["rounds"]
    if str(rnd) not in rounds:
        raise ValueError(f"the run timed no round {rnd}; it timed {sorted(rounds)}")
    total = NOTHING
    for name in names:
        total = total + span(rounds[str(rnd)], name)
    return total


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("inf")


def setup_lines(label: str, phases: Mapping[str, Any]) -> list[str]:
    """Set-up against round 1 (all its phases, and its training alone), wall and CPU."""
    setup, first = setup_span(phases), round_span(phases, 1)
    train = round_span(phases, 1, ["train"])
    wall = ratio(setup.wall_s, first.wall_s)
    return [
        f"{label} set-up {setup.wall_s:.1f} s (cpu {setup.cpu_s:.1f} s), round 1 "
        f"{first.wall_s:.1f} s (cpu {first.cpu_s:.1f} s), round 1's train {train.wall_s:.1f} s "
        f"(cpu {train.cpu_s:.1f} s)",
        f"{label} setup/round-1 ratio: {wall:.2f}  {verdict(wall, SETUP_TARGET)}",
        f"{label} setup/round-1 cpu ratio: {ratio(setup.cpu_s, first.cpu_s):.2f}  (CPU seconds)",
        f"{label} setup/round-1-train ratio: {ratio(setup.wall_s, train.wall_s):.2f}  "
        f"(cpu {ratio(setup.cpu_s, train.cpu_s):.2f})",
    ]


def busy_lines(label: str, phases: Mapping[str, Any], judged: bool) -> list[str]:
    """`<label> busy <phase>: share` for every set-up phase and every round's phase, with
    the >= 0.85 verdict where `judged` and the phase is long enough to say anything."""
    cores = int(phases["cores"])
    named = [(name, span(phases["setup"], name)) for name in phases["setup"]]
    for rnd, rec in phases["rounds"].items():
        named += [(f"r{rnd} {name}", span(rec, name)) for name in rec]
    lines = []
    for name, s in named:
        if s.wall_s <= 0:
            continue
        share = s.busy(cores)
        why = f"  ({s.wall_s:.1f} s wall, {s.cpu_s:.1f} s cpu, {cores} cores)"
        if not judged:
            tail = ""
        elif s.wall_s < SHORT_S:
            tail = "  (too short to judge)"
        else:
            tail = "  " + floor_verdict(share, BUSY_TARGET)
        lines.append(f"{label} busy {name}: {share:.2f}{tail}{why}")
    return lines


def first_row_s(phases: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> float:
    """When the first metrics row was written, counted from the run's set-up: set-up wall
    plus the row's `wall_time_s` (the rounds' wall time up to it; the process's start and
    imports are not in it, the driver's stopwatch has them)."""
    if not rows:
        raise ValueError("the run wrote no metrics row")
    return setup_span(phases).wall_s + float(rows[0]["wall_time_s"])


def free_share(others_cores: float, cores: int) -> float:
    """The share of `cores` that processes keeping `others_cores` busy left to a run: the
    most a busy share can reach on a loaded machine."""
    return max(cores - others_cores, 0.0) / cores
