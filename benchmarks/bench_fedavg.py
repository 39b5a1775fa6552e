"""Speed benchmark: FedAvg through HetFL against a plain-PyTorch floor.

The workload (the speed-benchmark issue): the small CNN (20,490 parameters), Fashion-MNIST
IID over 20 clients that all take part every round, 1 local epoch, batch 32, SGD lr 0.05
without momentum, 5 rounds, the global model evaluated on the 10k test set every round,
2 threads.

- `hetfl` side: a validated config -> `hetfl.runner.build_simulation` -> `Simulation.run`,
  progress display off, no local evaluation, no intermediate checkpoints.
- `floor` side: plain PyTorch written to be fast and simple -- one model, `load_state_dict`
  per client, every client's data preloaded as tensors, the same initial weights and batch
  order as HetFL (generators derived as the engine derives them), a sample-weighted average
  accumulated in float64 and cast once, the same test evaluation (batches of 1000).

The driver runs the two sides interleaved (which side goes first alternates per repetition),
each in its own subprocess so that each peak RSS is its own. Data loading and partitioning
are not timed: the clock starts at round 1. The two sides must end with the same weights
(max |delta| <= 1e-4) or the benchmark fails. The last line printed is

    ratio hetfl/floor: X.XX

the median over repetitions of the median per-round time ratio (target: <= 1.10).

Usage: python benchmarks/bench_fedavg.py [--rounds 5] [--reps 3] [--clients 20] [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

SEED = 0
THREADS = 2
BATCH = 32
LR = 0.05
EVAL_BATCH = 1000  # hetfl.core.client.evaluate_model's default, used by the engine
TOLERANCE = 1e-4
TARGET = 1.10
NOISY = 0.25  # cores kept busy by other processes above which a side's times are flagged


# -- the two sides (each runs in a child process) ----------------------------------------------
def run_hetfl(args: argparse.Namespace) -> dict[str, Any]:
    """FedAvg through the library's public path: config -> runner -> Simulation."""
    import torch

    from hetfl.config import validate
    from hetfl.engine.progress import Progress
    from hetfl.runner import build_simulation

    class RoundClock(Progress):
        """A silent progress display that records when each round's work is done."""

        def __init__(self, total: int) -> None:
            super().__init__(total, enabled=False)
            self.marks: list[float] = []

        def round(self, round: int, row: dict[str, Any] | None) -> None:
            self.marks.append(time.perf_counter())

    cfg = validate(
        {
            "name": "bench-fedavg",
            "seed": SEED,
            "algorithm": "fedavg",
            "data": {
                "dataset": "fashion-mnist",
                "num_clients": args.clients,
                "partition": {"kind": "iid"},
                "test_per_client": 0,  # local evaluation is off: no local test splits
            },
            "model": {"name": "small-cnn"},
            "train": {
                "rounds": args.rounds,
                "clients_per_round": args.clients,
                "local_epochs": 1,
                "batch_size": BATCH,
                "lr": LR,
                "momentum": 0.0,
            },
            "eval": {"every": 1, "local_eval": "none"},
            # The engine has no "never": it always checkpoints after the last round.
            "checkpoint_every": args.rounds + 1,
            "device": "cpu",
            "threads": THREADS,
        }
    )
    run_dir = Path(args.workdir) / "hetfl-run"
    sim = build_simulation(cfg, run_dir, show_progress=False)  # loads and partitions the data
    clock = RoundClock(cfg.train.rounds)
    sim.progress = clock
    sim.setup()  # initial global state, as `run_one` does before the run starts
    n_params = sum(v.numel() for v in sim.state.values())
    assert torch.get_num_threads() == THREADS, torch.get_num_threads()

    monitor = CpuMonitor()
    profiler = _start_profile(args)
    start = time.perf_counter()
    summary = sim.run()
    end = time.perf_counter()
    _stop_profile(profiler, args)
    others = monitor.others()

    marks = [start, *clock.marks[:-1], end]  # the last round ends when `run` returns
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    torch.save(dict(sim.state), args.weights)
    return {
        "n_params": n_params,
        "total_s": end - start,
        "round_s": [b - a for a, b in itertools.pairwise(marks)],
        "acc": [r["global_acc"] for r in rows],
        "final_acc": summary["final"]["global_acc"],
        "other_cores": others,
    }


def run_floor(args: argparse.Namespace) -> dict[str, Any]:
    """The same FedAvg in plain PyTorch, written to be fast and simple."""
    import torch
    import torch.nn.functional as F

    # Data preparation and the starting point come from HetFL's own functions (not timed),
    # so that both sides see the same client tensors and the same initial weights.
    from hetfl.core.init import initialize
    from hetfl.core.rng import SERVER, numpy_generator, torch_generator
    from hetfl.data import iid, load_fashion_mnist
    from hetfl.models.plain import SmallCNN

    torch.set_num_threads(THREADS)
    ds = load_fashion_mnist()
    parts = iid(ds.y_train, args.clients, numpy_generator(SEED, 0, SERVER, "partition"))
    with warnings.catch_warnings():  # the cached arrays are read-only; they are only read
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        x_all, y_all = torch.from_numpy(ds.x_train), torch.from_numpy(ds.y_train)
        x_test, y_test = torch.from_numpy(ds.x_test), torch.from_numpy(ds.y_test)
    xs = [x_all[torch.from_numpy(p)] for p in parts]
    ys = [y_all[torch.from_numpy(p)] for p in parts]
    sizes = [int(y.shape[0]) for y in ys]

    model = SmallCNN(ds.input_shape, ds.num_classes)
    initialize(model, torch_generator(SEED, 0, SERVER, "init"))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    n_params = sum(v.numel() for v in state.values())

    monitor = CpuMonitor()
    profiler = _start_profile(args)
    start = time.perf_counter()
    marks, accs = [start], []
    # Created on the clock, as HetFL creates its optimisers in round 1: PyTorch's first
    # optimiser construction imports torch._dynamo (about a second), and both sides pay it.
    # foreach and zeroed (not freed) gradients: the fastest plain settings on CPU here.
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, foreach=True)
    for rnd in range(1, args.rounds + 1):
        sums = {k: torch.zeros(v.shape, dtype=torch.float64) for k, v in state.items()}
        for cid in range(args.clients):
            model.load_state_dict(state)
            model.train()
            x, y, n = xs[cid], ys[cid], sizes[cid]
            perm = torch.randperm(n, generator=torch_generator(SEED, rnd, cid, "train"))
            for s in range(0, n, BATCH):
                idx = perm[s : s + BATCH]
                loss = F.cross_entropy(model(x[idx]), y[idx])
                optimizer.zero_grad(set_to_none=False)
                loss.backward()
                optimizer.step()
            for k, v in model.state_dict().items():
                sums[k].add_(v.double(), alpha=n)
        total = float(sum(sizes))
        state = {k: (s / total).to(state[k].dtype) for k, s in sums.items()}
        # Evaluation of the new global model on the whole test set.
        model.load_state_dict(state)
        model.eval()
        correct, loss_sum = 0, 0.0
        with torch.no_grad():
            for s in range(0, int(y_test.shape[0]), EVAL_BATCH):
                out = model(x_test[s : s + EVAL_BATCH])
                yb = y_test[s : s + EVAL_BATCH]
                loss_sum += float(F.cross_entropy(out, yb, reduction="sum"))
                correct += int((out.argmax(dim=1) == yb).sum())
        accs.append(correct / int(y_test.shape[0]))
        marks.append(time.perf_counter())
    end = marks[-1]
    _stop_profile(profiler, args)
    others = monitor.others()

    torch.save(state, args.weights)
    return {
        "n_params": n_params,
        "total_s": end - start,
        "round_s": [b - a for a, b in itertools.pairwise(marks)],
        "acc": accs,
        "final_acc": accs[-1],
        "other_cores": others,
    }


class CpuMonitor:
    """How many cores other processes kept busy while a side was timed (a noise flag).

    Reads the machine's busy time from /proc/stat (Linux) and subtracts this process's own
    CPU time; where /proc/stat is missing the result is None.
    """

    def __init__(self) -> None:
        self.start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        try:
            fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        except OSError:
            return None
        ticks = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
        busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
        own = resource.getrusage(resource.RUSAGE_SELF)
        return busy, own.ru_utime + own.ru_stime, time.perf_counter()

    def others(self) -> float | None:
        end = self._sample()
        if self.start is None or end is None:
            return None
        busy, own, wall = (e - s for e, s in zip(end, self.start, strict=True))
        return max(busy - own, 0.0) / wall


def _start_profile(args: argparse.Namespace) -> Any:
    if not args.profile:
        return None
    import cProfile

    profiler = cProfile.Profile()
    profiler.enable()
    return profiler


def _stop_profile(profiler: Any, args: argparse.Namespace) -> None:
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(args.profile)


def child(args: argparse.Namespace) -> None:
    report = run_hetfl(args) if args.side == "hetfl" else run_floor(args)
    report["side"] = args.side
    report["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB
    Path(args.out).write_text(json.dumps(report))


# -- the driver ---------------------------------------------------------------------------------
def run_side(side: str, args: argparse.Namespace, workdir: Path, rep: int) -> dict[str, Any]:
    tag = f"{side}-{rep}"
    out, weights = workdir / f"{tag}.json", workdir / f"{tag}.pt"
    side_dir = workdir / tag
    side_dir.mkdir()
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--side", side,
        "--out", str(out),
        "--weights", str(weights),
        "--workdir", str(side_dir),
        "--rounds", str(args.rounds),
        "--clients", str(args.clients),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout + proc.stderr)
        sys.exit(f"benchmark FAILED: the {side} side exited with code {proc.returncode}")
    report = json.loads(out.read_text())
    report["weights"] = str(weights)
    return report


def max_abs_delta(path_a: str, path_b: str) -> float:
    import torch

    a, b = torch.load(path_a), torch.load(path_b)
    if set(a) != set(b):
        sys.exit(f"benchmark FAILED: the sides' final states name different tensors: {a} {b}")
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def driver(args: argparse.Namespace) -> None:
    print(
        f"FedAvg benchmark: small-cnn on Fashion-MNIST IID, {args.clients} clients (all per "
        f"round), 1 epoch, batch {BATCH}, SGD lr {LR}, {args.rounds} rounds, test eval every "
        f"round, {THREADS} threads, {args.reps} interleaved repetition(s)",
        flush=True,
    )
    reps: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="hetfl-bench-") as tmp:
        for rep in range(args.reps):
            order = ("hetfl", "floor") if rep % 2 == 0 else ("floor", "hetfl")
            res = {side: run_side(side, args, Path(tmp), rep) for side in order}
            h, f = res["hetfl"], res["floor"]
            per_round = [a / b for a, b in zip(h["round_s"], f["round_s"], strict=True)]
            rec = {
                "order": "/".join(order),
                "hetfl": h,
                "floor": f,
                "total_ratio": h["total_s"] / f["total_s"],
                "round_ratio": statistics.median(per_round),
                "per_round": per_round,
                "delta": max_abs_delta(h["weights"], f["weights"]),
            }
            reps.append(rec)
            print(
                f"rep {rep + 1}/{args.reps} ({rec['order']}): hetfl {h['total_s']:.2f}s, "
                f"floor {f['total_s']:.2f}s, total ratio {rec['total_ratio']:.3f}, "
                f"median per-round ratio {rec['round_ratio']:.3f}, max|delta| {rec['delta']:.1e}",
                flush=True,
            )
            for side in order:
                busy = res[side]["other_cores"]
                if busy is not None and busy > NOISY:
                    print(
                        f"  warning: other processes kept {busy:.2f} cores busy during the "
                        f"{side} side; its times are not trustworthy (re-run on a quiet machine)",
                        flush=True,
                    )

    print()
    print(
        "rep  order        hetfl s   floor s  total  per-round  hetfl MiB  floor MiB"
        "  max|delta|  others' cores h/f"
    )
    for i, r in enumerate(reps, 1):
        busy = "/".join(
            "n/a" if r[s]["other_cores"] is None else f"{r[s]['other_cores']:.2f}"
            for s in ("hetfl", "floor")
        )
        print(
            f"{i:>3}  {r['order']:<11} {r['hetfl']['total_s']:8.2f}  {r['floor']['total_s']:8.2f}"
            f"  {r['total_ratio']:5.3f}  {r['round_ratio']:9.3f}"
            f"  {r['hetfl']['peak_rss_mib']:9.0f}  {r['floor']['peak_rss_mib']:9.0f}"
            f"  {r['delta']:10.1e}  {busy}"
        )
    print()

    def by_round(key: str, side: str | None = None) -> str:
        cols = zip(*((r[side] if side else r)[key] for r in reps), strict=True)
        return " ".join(f"{statistics.median(col):.3f}" for col in cols)

    print(f"hetfl seconds per round (median over reps): {by_round('round_s', 'hetfl')}")
    print(f"floor seconds per round (median over reps): {by_round('round_s', 'floor')}")
    print(f"hetfl/floor per round (median over reps):   {by_round('per_round')}")

    first = reps[0]
    print(f"parameters: hetfl {first['hetfl']['n_params']:,}, floor {first['floor']['n_params']:,}")
    print(
        "final test accuracy: hetfl "
        + ", ".join(f"{r['hetfl']['final_acc']:.4f}" for r in reps)
        + "; floor "
        + ", ".join(f"{r['floor']['final_acc']:.4f}" for r in reps)
    )
    hetfl_mem = statistics.median(r["hetfl"]["peak_rss_mib"] for r in reps)
    floor_mem = statistics.median(r["floor"]["peak_rss_mib"] for r in reps)
    print(f"peak RSS (median over reps): hetfl {hetfl_mem:.0f} MiB, floor {floor_mem:.0f} MiB")
    total_ratio = statistics.median(r["total_ratio"] for r in reps)
    print(f"median total-time ratio hetfl/floor: {total_ratio:.3f}")

    worst = max(r["delta"] for r in reps)
    if not worst <= TOLERANCE:
        bar = "!" * 78
        sys.stderr.write(
            f"\n{bar}\nBENCHMARK FAILED: HetFL and the floor ended with different weights: "
            f"max |delta| = {worst:.3e} > {TOLERANCE:g}.\nThe two sides do not compute the same "
            f"FedAvg, so their times cannot be compared.\n{bar}\n"
        )
        sys.exit(1)
    print(f"final weights agree: max |delta| = {worst:.1e} <= {TOLERANCE:g}")
    ratio = statistics.median(r["round_ratio"] for r in reps)
    verdict = "meets" if ratio <= TARGET else "MISSES"
    print(f"median per-round ratio {verdict} the target of <= {TARGET:.2f}")
    print(f"ratio hetfl/floor: {ratio:.2f}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=5, help="FedAvg rounds (default 5)")
    p.add_argument("--reps", type=int, default=3, help="interleaved repetitions (default 3)")
    p.add_argument("--clients", type=int, default=20, help="clients, all per round (default 20)")
    p.add_argument("--quick", action="store_true", help="smoke check: 2 rounds, 1 repetition")
    # Child mode (the driver starts these; run one directly to profile a side).
    p.add_argument("--side", choices=("hetfl", "floor"), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--weights", help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    p.add_argument("--profile", help="with --side: write cProfile stats of the timed part here")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.reps = 2, 1
    if min(args.rounds, args.reps, args.clients) < 1:
        p.error("--rounds, --reps and --clients must be >= 1")
    if args.side is None:
        driver(args)
        return
    with tempfile.TemporaryDirectory(prefix="hetfl-bench-side-") as tmp:
        args.out = args.out or os.devnull
        args.weights = args.weights or str(Path(tmp) / "weights.pt")
        args.workdir = args.workdir or tmp
        child(args)


if __name__ == "__main__":
    main()
