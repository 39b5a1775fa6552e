"""The parent's share of a round under the Ray executor (docs/ray.md): how much of each
round the simulation's own process spends working (sampling, encoding and putting the
exchange, aggregation, the clock, the stores, the checkpoint) rather than waiting for the
units.

Runs a workload's config (`bench_workloads`) with `executor: ray` on a local Ray of
`--units` one-thread units and counts the seconds the parent blocks in `ray.wait`; the rest
of a round (metrics row to metrics row) is the parent's. Its share bounds what more units
can give: with a share p of a round's time, no number of units makes a round faster than
p of it (Amdahl), and on a cluster the parent's share grows as the units' time shrinks.

Usage: python benchmarks/bench_parent_share.py [--workload A] [--rounds 2] [--units 2]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_hetfl import RowClock
from bench_side import SideClock
from bench_workloads import WORKLOADS, hetfl_config

from hetfl.config import validate
from hetfl.runner import build_simulation


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workload", default="A", choices=sorted(WORKLOADS))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--units", type=int, default=2)
    args = p.parse_args(argv)
    import ray

    blocked = [0.0]
    wait = ray.wait

    def timed_wait(*a: Any, **kw: Any) -> Any:
        started = time.perf_counter()
        try:
            return wait(*a, **kw)
        finally:
            blocked[0] += time.perf_counter() - started

    ray.wait = timed_wait
    w = WORKLOADS[args.workload]
    overrides = {"executor": "ray", "workers": args.units, "threads": 1}
    with tempfile.TemporaryDirectory(prefix="hetfl-parent-") as tmp:
        cfg = validate(hetfl_config(w, args.rounds, tmp, overrides))
        sim = build_simulation(cfg, Path(tmp) / "run", show_progress=False)
        clock = SideClock()
        marks: list[float] = []

        class Marks(RowClock):
            def round(self, round: int, row: dict[str, Any] | None) -> None:
                super().round(round, row)
                if row is not None:
                    marks.append(blocked[0])

        sim.progress = Marks(cfg.train.rounds, clock)
        try:
            sim.setup()
            clock.start_rounds()
            start_blocked = blocked[0]
            sim.run()
            clock.end()
        finally:
            sim.executor.close()
    rounds = clock.report()["round_s"]
    print(f"{w.describe(args.rounds)}; executor ray, {args.units} units x 1 thread")
    before = start_blocked
    for i, (total, mark) in enumerate(zip(rounds, marks, strict=True), 1):
        waiting, before = mark - before, mark
        parent = total - waiting
        print(
            f"round {i}: {total:.2f} s, parent {parent:.2f} s ({parent / total:.0%}), "
            f"units (the parent waiting) {waiting:.2f} s"
        )


if __name__ == "__main__":
    main()
