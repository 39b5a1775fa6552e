"""Set-up time and per-phase core use of `hetfl run` (issue 48 item 2), read from the runs'
own `summary.json` `phases` (docs/contracts.md §1.7).

Runs, each through the repository's CLI (`python -m hetfl.cli run ...`, the interpreter and
`PYTHONPATH` this script runs under) with the process executor at `--workers` workers of one
thread:

- `F`: the shipped FedFA config as issue 48 states it, `configs/fedfa_fmnist_both.yaml
  sweep=null train.rounds=R eval.local_trained=true`, `data.num_clients=--clients`, under a
  fresh, empty `HETFL_CACHE`, so FedFA's ZiCo scores of the candidates (Park and Joe-Wong,
  "Federated Learning with Flexible Architectures", ECML-PKDD 2024, §4) are computed cold;
- `Fe` (unless `--no-warm`): the same with `eval.every=1`, under the same, now warm, cache:
  a FedFA workload evaluated every round, its set-up without the ZiCo computation;
- `H`: the benchmark's workload H (HeteroFL on `flanc-cnn` at four widths, `bench_workloads`),
  written as a config file, R rounds.

Per run it prints the set-up (data + the strategy's set-up, its query included) against
round 1, wall and CPU seconds (`F setup/round-1 ratio: X  target <= 2.00: met`), the time
to the first metrics row, and per phase the share of the cores kept busy,
`cpu_s / (wall_s x cores)`, with the issue's `target >= 0.85` on `H` and `Fe`. The load
average before and after each run, and the cores other processes kept busy meanwhile
(`bench_proc.CpuWindow`), say whether the machine was quiet: on a loaded machine the wall
ratios and shares are not measurements; the CPU-second ratios still are, roughly.

Usage: python benchmarks/bench_phases.py [--clients 100] [--rounds 2] [--workers N]
       [--runs F,Fe,H] [--no-warm] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from bench_phase_shares import busy_lines, first_row_s, free_share, setup_lines
from bench_proc import CpuWindow, become_subreaper, reap_orphans
from bench_workloads import WORKLOADS, executor_overrides, hetfl_config

ROOT = Path(__file__).resolve().parents[1]
FEDFA = ROOT / "configs" / "fedfa_fmnist_both.yaml"
CLI = [sys.executable, "-m", "hetfl.cli", "run"]
NOISY = 0.25  # as bench.py: cores other processes kept busy above which times are flagged
RUNS = ("F", "Fe", "H")
#: `--smoke`: FedFA on 4 clients of 32 samples, 2 per round (so 2 asked the set-up query),
#: one local step, three candidates of depth 2.
SMOKE_FEDFA = [
    "data.groups=[{clients: 4, samples: 32}]",
    "data.test_per_client=5",
    "train.clients_per_round=2",
    "train.local_steps=1",
    "options.fedfa.depths=[2]",
    "options.fedfa.widths=[0.25,0.5,0.75]",
    "eval.test_samples=50",
    "eval.stats_samples=32",
]


def fedfa_args(args: argparse.Namespace, out: Path, every_round: bool) -> list[str]:
    """The FedFA command's config and overrides: the issue's, the scale, the executor."""
    keys = executor_overrides("processes", args.workers)
    over = [
        "sweep=null",
        f"train.rounds={args.rounds}",
        "eval.local_trained=true",
        f"data.num_clients={args.clients}",
        *(SMOKE_FEDFA if args.smoke else []),
        *(["eval.every=1"] if every_round else []),
        *(f"{k}={v}" for k, v in keys.items()),
        f"output_dir={out}",
    ]
    return [str(FEDFA), *over]


def h_args(args: argparse.Namespace, out: Path) -> list[str]:
    """Workload H's config, written under `out`."""
    w = WORKLOADS["H"].smoke() if args.smoke else WORKLOADS["H"]
    cfg = hetfl_config(w, args.rounds, str(out), executor_overrides("processes", args.workers))
    path = out / "h.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return [str(path)]


def timed_run(argv: list[str], cache: Path) -> dict[str, Any]:
    """Run `hetfl run argv`; seconds to its first metrics row (its first `round r/R` line
    on stderr, printed once the row is written) and to its end, the load and the noise."""
    env = {**os.environ, "HETFL_CACHE": str(cache)}
    load = os.getloadavg()[0]
    window = CpuWindow()
    started = time.perf_counter()
    proc = subprocess.Popen(
        [*CLI, *argv, "--overwrite"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stderr is not None and proc.stdout is not None
    first_row, lines = None, []
    for line in proc.stderr:
        lines.append(line)
        if first_row is None and line.startswith("round "):
            first_row = time.perf_counter() - started
    out = proc.stdout.read()
    if proc.wait() != 0 or first_row is None:
        sys.exit(f"benchmark FAILED: `hetfl run {' '.join(argv)}` went wrong:\n{''.join(lines)}")
    end = time.perf_counter() - started
    reap_orphans()
    usage = window.usage(0)
    run_dir = Path(out.strip().splitlines()[-1].split(": round ")[0])
    return {
        "run_dir": run_dir,
        "first_row": first_row,
        "end": end,
        "load": (load, os.getloadavg()[0]),
        "others": usage.others_cores,
    }


def report(label: str, run: dict[str, Any], judged: bool) -> list[str]:
    """The lines of one run."""
    summary = json.loads((run["run_dir"] / "summary.json").read_text())
    phases = summary["phases"]
    cores = int(phases["cores"])
    rows = [json.loads(r) for r in (run["run_dir"] / "metrics.jsonl").read_text().splitlines()]
    lines = [
        f"{label} first metrics row (round {rows[0]['round']}) at {run['first_row']:.1f} s "
        f"after the command started ({first_row_s(phases, rows):.1f} s of set-up and rounds), "
        f"exit at {run['end']:.1f} s",
        *setup_lines(label, phases),
        *busy_lines(label, phases, judged),
        f"{label} load average (1 min) before {run['load'][0]:.2f}, after {run['load'][1]:.2f}",
    ]
    if run["others"] is not None:
        lines.append(f"{label} other processes kept {run['others']:.2f} cores busy meanwhile")
        if run["others"] > NOISY:
            lines.append(
                f"  warning: a loaded machine: {label}'s wall ratios and busy shares are not "
                "measurements (re-run on a quiet machine); its CPU-second ratios still hold. "
                f"Others left it about {free_share(run['others'], cores):.2f} of the cores"
            )
    return lines


def main(args: argparse.Namespace) -> None:
    become_subreaper()  # the runs' fork servers and workers are reaped here
    with tempfile.TemporaryDirectory(prefix="hetfl-phases-") as tmp:
        work = Path(args.keep or tmp)
        cache = work / "cache"
        cache.mkdir(parents=True, exist_ok=False)  # fresh: F computes ZiCo cold, Fe finds it warm
        commands = {
            "F": lambda: fedfa_args(args, work / "f", every_round=False),
            "Fe": lambda: fedfa_args(args, work / "fe", every_round=True),
            "H": lambda: h_args(args, work),
        }
        for label in args.runs:
            print(f"{label}: hetfl run {' '.join(commands[label]())}", flush=True)
            lines = report(label, timed_run(commands[label](), cache), judged=label != "F")
            print("\n".join(lines), flush=True)
    if args.smoke:
        print("(--smoke: tiny shapes; the times and ratios mean nothing)")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--clients", type=int, default=100, help="FedFA's data.num_clients")
    p.add_argument("--rounds", type=int, default=2, help="rounds of every run")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="process workers")
    p.add_argument("--runs", default=",".join(RUNS), help="which runs, of F, Fe, H")
    p.add_argument("--no-warm", action="store_true", help="skip Fe (the warm-cache FedFA run)")
    p.add_argument("--keep", help="a new folder to keep the runs (and their cache) in")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, 1 round (a check)")
    args = p.parse_args(argv)
    args.runs = [r for r in args.runs.split(",") if r and not (args.no_warm and r == "Fe")]
    unknown = [r for r in args.runs if r not in RUNS]
    if unknown:
        p.error(f"--runs: unknown run(s) {', '.join(unknown)}; choose from {', '.join(RUNS)}")
    if args.clients < 1 or args.rounds < 1:
        p.error(f"--clients and --rounds must be >= 1, got {args.clients}, {args.rounds}")
    if args.smoke:
        args.clients, args.rounds = 4, 1
    return args


if __name__ == "__main__":
    main(parse())
