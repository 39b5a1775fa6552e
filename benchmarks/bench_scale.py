"""Scale benchmark: 10,000 clients with private BatchNorm and heads under a store memory budget.

The workload (issue 16, item 7): `stage-cnn` with `bn: batch`, FedBN + FedPer (FedAvg with
`private_norm` and `private_head`: every client keeps its BatchNorm tensors and its head),
Fashion-MNIST IID over 10,000 clients (6 training samples each), 100 clients per round drawn
without replacement across rounds (`sampling: cyclic`), 100 rounds, so that after the run
every client holds private state (17,992 bytes each, about 172 MiB in all), with
`store.memory_budget: 64MiB`: the client store spills to disk. One local step per client
(batch 32 over its 6 samples), the global model tested on a 1,000-image subsample every 10
rounds, no local evaluation, a checkpoint every 25 rounds (each streams the whole store).

Two sides, each in its own child process:

- `private`: the run above;
- `shared`: the same run with the private layers off (plain FedAvg, nothing kept per
  client), the same budget.

The driver samples the proportional set size (PSS) of each child's process tree (the child
and its descendants, `/proc/<pid>/smaps_rollup`) every 50 ms in a thread and reports each
side's peak. Targets: peak(private) <= 1.10 x peak(shared), and < 4 GiB. The last lines are

    peak PSS private/shared: X.XX
    private < 4 GiB: yes|no

Usage: python benchmarks/bench_scale.py [--rounds 100] [--clients 10000] [--per-round 100]
       [--budget 64MiB] [--side private|shared] (a pilot: --rounds 10)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

SEED = 0
THREADS = 1
SAMPLE_S = 0.05
RATIO_TARGET = 1.10
ABSOLUTE_TARGET = 4 << 30


# -- one side (in a child process) ----------------------------------------------------------------
def config(args: argparse.Namespace, private: bool) -> dict[str, Any]:
    return {
        "name": f"bench-scale-{'private' if private else 'shared'}",
        "seed": SEED,
        "algorithm": "fedavg",
        "options": {
            "fedavg": {"private_norm": private, "private_head": private, "sampling": "cyclic"}
        },
        "data": {
            "dataset": "fashion-mnist",
            "num_clients": args.clients,
            "partition": {"kind": "iid"},
            "test_per_client": 0,
        },
        "model": {"name": "stage-cnn", "bn": "batch"},
        "train": {
            "rounds": args.rounds,
            "clients_per_round": args.per_round,
            "local_steps": 1,
            "batch_size": 32,
            "lr": 0.05,
        },
        "eval": {"every": 10, "local_eval": "none", "test_samples": 1000},
        "checkpoint_every": 25,
        "store": {"memory_budget": args.budget},
        "device": "cpu",
        "threads": THREADS,
    }


def run_side(args: argparse.Namespace) -> dict[str, Any]:
    from hetfl.config import validate
    from hetfl.runner import build_simulation

    started = time.perf_counter()
    cfg = validate(config(args, private=args.side == "private"))
    sim = build_simulation(cfg, Path(args.workdir) / args.side, show_progress=False)
    built = time.perf_counter()
    sim.run()
    ended = time.perf_counter()
    rows = [
        json.loads(line)
        for line in (Path(args.workdir) / args.side / "metrics.jsonl").read_text().splitlines()
    ]
    store = sim.store
    return {
        "side": args.side,
        "build_s": built - started,
        "run_s": ended - built,
        "round_s": (ended - built) / args.rounds,
        "clients_with_state": len(store),
        "store_mib": store.nbytes() / 2**20,
        "store_in_memory_mib": store.memory_nbytes() / 2**20,
        "spilled": store.spilled_count(),
        "spill_left": (Path(args.workdir) / args.side / "spill").exists(),
        "last_row": {k: rows[-1][k] for k in ("round", "clients", "global_acc", "loss")},
    }


# -- the driver ---------------------------------------------------------------------------------
def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (from /proc/<pid>/task/*/children)."""
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            with contextlib.suppress(OSError):  # the task ended meanwhile
                todo += [int(c) for c in (task / "children").read_text().split()]
    return tree


def pss_bytes(pids: list[int]) -> int:
    total = 0
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
                    break
        except OSError:
            pass  # it ended between listing and reading
    return total


class PeakPss:
    """The peak summed PSS of a process tree, sampled every `SAMPLE_S` seconds."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self.samples = pid, 0, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, pss_bytes(process_tree(self.pid)))
            self.samples += 1
            self._done.wait(SAMPLE_S)

    def stop(self) -> int:
        self._done.set()
        self._thread.join()
        return self.peak


def measure(args: argparse.Namespace, side: str, workdir: Path) -> dict[str, Any]:
    out = workdir / f"{side}.json"
    cmd = [
        sys.executable,
        __file__,
        "--side",
        side,
        "--workdir",
        str(workdir),
        "--result",
        str(out),
        "--rounds",
        str(args.rounds),
        "--clients",
        str(args.clients),
        "--per-round",
        str(args.per_round),
        "--budget",
        str(args.budget),
    ]
    started = time.perf_counter()
    child = subprocess.Popen(cmd)
    peak = PeakPss(child.pid)
    code = child.wait()
    result = {"peak_pss_mib": peak.stop() / 2**20, "samples": peak.samples}
    if code != 0:
        raise SystemExit(f"the {side} side exited with code {code}")
    result |= json.loads(out.read_text())
    result["wall_s"] = time.perf_counter() - started
    print(json.dumps(result), flush=True)
    return result


def driver(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="hetfl-bench-scale-", dir=args.workdir) as tmp:
        private = measure(args, "private", Path(tmp))
        shared = measure(args, "shared", Path(tmp))
    ratio = private["peak_pss_mib"] / shared["peak_pss_mib"]
    print(
        f"{args.clients} clients, {args.per_round} per round, {args.rounds} rounds, "
        f"budget {args.budget}: private state {private['store_mib']:.1f} MiB for "
        f"{private['clients_with_state']} clients, {private['spilled']} spilled, "
        f"{private['store_in_memory_mib']:.1f} MiB in memory"
    )
    for side in (private, shared):
        print(
            f"  {side['side']}: peak PSS {side['peak_pss_mib']:.0f} MiB, run {side['run_s']:.0f} s "
            f"({side['round_s']:.2f} s/round), build {side['build_s']:.0f} s, "
            f"spill dir left: {side['spill_left']}"
        )
    print(f"peak PSS private/shared: {ratio:.2f} (target <= {RATIO_TARGET:.2f})")
    below = private["peak_pss_mib"] * 2**20 < ABSOLUTE_TARGET
    print(f"private < 4 GiB: {'yes' if below else 'no'}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--clients", type=int, default=10_000)
    p.add_argument("--per-round", type=int, default=100)
    p.add_argument("--budget", default="64MiB")
    p.add_argument("--side", choices=("private", "shared"))
    p.add_argument("--workdir", default=None, help="where the runs go (default: a tempdir)")
    p.add_argument("--result", help="(child) where the side writes its result")
    args = p.parse_args(argv)
    if args.side is None:
        driver(args)
        return
    Path(args.result).write_text(json.dumps(run_side(args)))


if __name__ == "__main__":
    main()
