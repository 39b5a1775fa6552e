"""Start-up times of the `hetfl` command (issue 16, item 6), through `python -m hetfl.cli`
with the interpreter and `PYTHONPATH` the benchmark runs under (so the tree measured is the
one benchmarked):

- `hetfl --help` and `hetfl list`: wall time of the whole command, median of `RUNS`;
- `hetfl run <config>` on workload B's config with 1 round (and the benchmark's executor
  keys): from the command's start to the start banner, which `hetfl run` prints after the
  data is loaded and the initial global state is set up, just before round 1 starts; to
  the first metrics row (the progress line `round 1/1`, printed once the row is written,
  so round 1's work is included); and to the command's end (summary, plots).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from bench_workloads import WORKLOADS, hetfl_config

RUNS = 5
CLI = [sys.executable, "-m", "hetfl.cli"]


def command_s(args: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run([*CLI, *args], check=True, capture_output=True)
    return time.perf_counter() - started


def run_marks(config: Path) -> dict[str, float]:
    """Seconds from starting `hetfl run config` to its banner, first row and end."""
    started = time.perf_counter()
    proc = subprocess.Popen(
        [*CLI, "run", str(config), "--overwrite"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    marks: dict[str, float] = {}
    lines = []
    for line in proc.stderr:
        lines.append(line)
        now = time.perf_counter() - started
        if line.startswith("hetfl run ") and "banner" not in marks:
            marks["banner"] = now
        elif line.startswith("round 1/") and "first_row" not in marks:
            marks["first_row"] = now
    if proc.wait() != 0 or len(marks) != 2:
        sys.exit("benchmark FAILED: `hetfl run` (start-up) went wrong:\n" + "".join(lines))
    marks["end"] = time.perf_counter() - started
    return marks


def startup(workdir: Path, executor: dict[str, Any]) -> list[str]:
    """The start-up lines of the report."""
    help_s = statistics.median(command_s(["--help"]) for _ in range(RUNS))
    list_s = statistics.median(command_s(["list"]) for _ in range(RUNS))
    config = workdir / "startup.yaml"
    cfg = hetfl_config(WORKLOADS["B"], 1, str(workdir / "startup-runs"), executor)
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    marks = run_marks(config)
    return [
        f"start-up: `hetfl --help` {help_s:.2f} s, `hetfl list` {list_s:.2f} s (median of {RUNS})",
        f"start-up: `hetfl run` (workload B, 1 round): start banner (data loaded, state set "
        f"up, round 1 about to start) at {marks['banner']:.2f} s, first metrics row at "
        f"{marks['first_row']:.2f} s, exit at {marks['end']:.2f} s",
    ]
