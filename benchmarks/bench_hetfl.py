"""The HetFL side: a workload through the library's public path, a validated config ->
`hetfl.runner.build_simulation` -> `Simulation.run` (progress display off)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from bench_side import Profile, SideClock
from bench_workloads import Workload, hetfl_config

from hetfl.config import validate
from hetfl.engine.progress import Progress
from hetfl.runner import build_simulation


class RowClock(Progress):
    """A silent progress display that marks each metrics row on the side's clock (the
    engine calls `round` right after it appends the row)."""

    def __init__(self, total: int, clock: SideClock) -> None:
        super().__init__(total, enabled=False)
        self.clock = clock

    def round(self, round: int, row: dict[str, Any] | None) -> None:
        if row is not None:
            self.clock.row()


def run_hetfl(
    w: Workload,
    rounds: int,
    workdir: Path,
    weights: Path,
    executor: dict[str, Any],
    profile: str | None,
) -> dict[str, Any]:
    clock = SideClock()
    cfg = validate(hetfl_config(w, rounds, str(workdir), executor))
    run_dir = workdir / "hetfl-run"
    sim = build_simulation(cfg, run_dir, show_progress=False)  # loads and partitions the data
    sim.progress = RowClock(cfg.train.rounds, clock)
    sim.setup()  # the initial global state, as `run_one` does before the run starts
    try:
        with Profile(profile):
            clock.start_rounds()
            sim.run()
            clock.end()
    finally:
        sim.executor.close()  # worker processes, or the local Ray of the Ray side
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    torch.save(dict(sim.state), weights)
    return {
        **clock.report(),
        "n_params": sum(v.numel() for v in sim.state.values()),
        "acc": [r["global_acc"] for r in rows],
        "widths": {k: v["acc"] for k, v in rows[-1].get("groups", {}).items()},
    }
