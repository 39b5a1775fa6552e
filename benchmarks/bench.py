"""Speed and memory benchmark: HetFL against plain-PyTorch floors, workload by workload.

Workloads (`bench_workloads`): A (FedAvg, 20 clients x 3,000 samples, all per round),
B (FedAvg, 200 clients, 20 sampled per round), H (HeteroFL on FLANC's CNN at four widths).
Each runs against its own floor in this invocation: the sides interleaved (who goes first
alternates), each in its own subprocess, 3 repetitions. Every workload's floor also runs as
two one-thread processes (`floor2`: clients and evaluation split between them, what two
cores give when the work is split by hand). On A, HetFL also runs with its Ray executor
(side `ray`: a local Ray of `--workers` units of one thread), against the process executor:
`A ratio ray/processes: X.XX  target <= 1.15` (skipped with `--no-ray`, with `--smoke`, or
where Ray is not installed). Also on A, with Ray: side `flower`, the floor written as a
Flower app and run on Flower's simulation engine (`bench_flower_sim`, Ray backend, one
actor of one CPU per core), what researchers use today: `A ratio flower/processes: X.XX`
beside the Ray line (no target: it is the reference, not ours). Also on A, where an
interpreter with pfl-research is given (`--pfl-python`, or `$HETFL_PFL_PYTHON`): side `pfl`,
the floor written for pfl-research's simulator and run as pfl runs on several cores
(`bench_pfl_sim`: `torchrun`, `--workers` processes of one thread): `A ratio pfl/processes:
X.XX` (the reference, no target). pfl-research cannot express H (benchmarks/README.md).

Measured per side (`bench_side`, `bench_proc`): per-round times (metrics row to metrics row),
the total from before the data is loaded, the peak summed PSS of its process tree (sampled
every 100 ms by this driver) and the cores other processes kept busy meanwhile (a noise
flag). A workload fails unless every side ends with HetFL's weights: max |delta| <= 1e-4
between sides training with the same intra-op thread count, <= 5e-3 across counts (float
rounding, see `ACROSS_THREADS`).
Then start-up times of the `hetfl` command (`bench_startup`).

Output, two lines per workload: `A ratio hetfl/floor: X.XX  target <= 0.60: met` and
`A ratio hetfl/floor2: X.XX  target <= 1.03: met`, the median over repetitions of the
median per-round time ratio; with the total-time ratios on A (against floor and floor2)
and the peak-memory ratios, each next to its target; per workload also `X round-1 ratio
hetfl/floor2: X.XX  target <= 1.10` (round 1 alone: a start-up that leaks into it shows
there) and `X peak PSS hetfl/floor: X.XX  target <= 1.50`.

`--baseline DIR` adds a side `base`: HetFL of another checkout (DIR, e.g. a `git worktree`
of an older commit) through that checkout's own `bench.py --side hetfl`, interleaved with
the others, so a change's cost is measured in one invocation: `X ratio base/floor` and
`X ratio hetfl/base` per workload (median over repetitions of the per-round ratios).

`--smoke` runs every workload's code path and every side but Ray's on a tiny shape (4 clients of 64
samples, 1 round, 1 repetition, no start-up timings) with the weight check and the ratio
lines: the test suite runs it so the benchmark cannot rot; its times mean nothing.

Usage: python benchmarks/bench.py [--workload A,B,H] [--reps 3] [--rounds N] [--quick]
       [--smoke] [--baseline DIR] [--executor processes|sequential] [--workers 2]
       [--no-startup] [--no-ray] [--pfl-python PATH]
       python benchmarks/bench.py --workload A --side hetfl --profile /tmp/h.prof
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench_proc import CpuWindow, PeakTreePss, become_subreaper, reap_orphans
from bench_startup import startup
from bench_summary import per_round_medians, ratio_line, round_ratio, verdict
from bench_workloads import (
    EXECUTORS,
    FLOOR2_TARGET,
    MEMORY_TARGET,
    RAY_TARGET,
    ROUND1_TARGET,
    THREADS,
    TOTAL_TARGET_A,
    TOTAL_TARGET_A_FLOOR2,
    WORKLOADS,
    Workload,
    executor_overrides,
)

#: Max |delta| of the final weights between HetFL and a floor training with the same
#: intra-op thread count: the same computation, so the same weights up to float rounding.
TOLERANCE = 1e-4
#: The same between sides of different thread counts (the two-thread floor against HetFL's
#: one-thread tasks under the process executor): a thread count changes the summation order
#: inside a convolution, and A's 94 steps per client amplify that to ~1e-4 in one round.
#: The one-thread floor (floor2) holds HetFL to TOLERANCE in that case.
ACROSS_THREADS = 5e-3
NOISY = 0.25  # cores kept busy by other processes above which a side's times are flagged
SIDES = ("hetfl", "floor", "floor2")
#: The side that runs HetFL with its Ray executor (a local Ray, `--workers` units), on A.
RAY = "ray"
#: The side that runs the floor as a Flower app on Flower's simulation engine, on A.
FLOWER = "flower"
#: The side that runs the floor on pfl-research's simulator (`--pfl-python`), on A.
PFL = "pfl"
#: The side that runs HetFL from another checkout (`--baseline DIR`).
BASE = "base"


# -- a side, in its own process -----------------------------------------------------------------
def child(args: argparse.Namespace) -> None:
    w = chosen_workload(args.workload, args.smoke)
    workdir, weights = Path(args.workdir), Path(args.weights)
    executor = executor_overrides("ray" if args.side == RAY else args.executor, args.workers)
    if args.side in ("hetfl", RAY):
        from bench_hetfl import run_hetfl

        report = run_hetfl(w, args.rounds, workdir, weights, executor, args.profile)
    elif args.side == FLOWER:
        from bench_flower_sim import run_flower_sim

        report = run_flower_sim(w, args.rounds, workdir, weights, args.profile, smoke=args.smoke)
    elif w.algorithm == "heterofl":
        from bench_floor_heterofl import (
            run_floor_heterofl,
            run_floor_heterofl_two_processes,
        )

        run = run_floor_heterofl if args.side == "floor" else run_floor_heterofl_two_processes
        report = run(w, args.rounds, workdir, weights, args.profile)
    else:
        from bench_floor_fedavg import run_floor, run_floor_two_processes

        run = run_floor if args.side == "floor" else run_floor_two_processes
        report = run(w, args.rounds, workdir, weights, args.profile)
    Path(args.out).write_text(json.dumps(report))


def run_side(
    side: str, w: Workload, rounds: int, args: argparse.Namespace, tmp: Path, rep: int
) -> dict[str, Any]:
    tag = f"{w.name}-{side}-{rep}"
    out, weights, workdir = tmp / f"{tag}.json", tmp / f"{tag}.pt", tmp / tag
    workdir.mkdir()
    script, env = Path(__file__).resolve(), None
    if side == BASE:  # HetFL as the other checkout has it, through its own driver
        tree = Path(args.baseline).resolve()
        script = tree / "benchmarks" / "bench.py"
        env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    files = ["--out", str(out), "--weights", str(weights), "--workdir", str(workdir)]
    smoke = ["--smoke"] if args.smoke else []
    cmd = [
        sys.executable, str(script),
        "--side", "hetfl" if side == BASE else side, "--workload", w.name, "--rounds", str(rounds),
        "--executor", args.executor, "--workers", str(args.workers), *files, *smoke,
    ]  # fmt: skip
    if side == PFL:  # pfl's own launch: torchrun, one process per worker, in pfl's interpreter
        src = str(script.parents[1] / "src")
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, (src, os.environ.get("PYTHONPATH")))),
        }
        cmd = [
            args.pfl_python, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node", str(args.workers), str(script.with_name("bench_pfl_sim.py")),
            "--workload", w.name, "--rounds", str(rounds), *files, *smoke,
        ]  # fmt: skip
    window = CpuWindow()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    peak = PeakTreePss(proc.pid)
    output, _ = proc.communicate()
    reap_orphans()  # a fork server and its workers end after the side's process
    usage = window.usage(peak.stop())
    if proc.returncode != 0:
        sys.stderr.write(output)
        sys.exit(f"benchmark FAILED: {w.name}'s {side} side exited with code {proc.returncode}")
    report: dict[str, Any] = json.loads(out.read_text())
    report.update(
        weights=str(weights),
        peak_pss_mib=usage.peak_pss_mib,
        tree_cpu_s=usage.tree_cpu_s,
        other_cores=usage.others_cores,
    )
    return report


def max_abs_delta(path_a: str, path_b: str) -> float:
    import torch

    a, b = torch.load(path_a), torch.load(path_b)
    if set(a) != set(b):
        sys.exit(f"benchmark FAILED: the sides' final states name different tensors: {a} {b}")
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


# -- a workload ---------------------------------------------------------------------------------
def run_workload(w: Workload, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    rounds = args.rounds or (w.quick_rounds if args.quick else w.rounds)
    sides = (*SIDES, BASE) if args.baseline else SIDES
    sides = (*sides, RAY, FLOWER) if ray_side(w, args) else sides
    sides = (*sides, PFL) if pfl_side(w, args) else sides
    print(f"\n== {w.describe(rounds)}", flush=True)
    reps: list[dict[str, Any]] = []
    for rep in range(args.reps):
        order = sides if rep % 2 == 0 else sides[::-1]
        res = {side: run_side(side, w, rounds, args, tmp, rep) for side in order}
        h, f = res["hetfl"], res["floor"]
        rec = {
            **res,
            "order": "/".join(order),
            "round_ratio": round_ratio(h["round_s"], f["round_s"]),
            "round_ratio_floor2": round_ratio(h["round_s"], res["floor2"]["round_s"]),
            "round1_ratio_floor2": h["round_s"][0] / res["floor2"]["round_s"][0],
            "total_ratio": h["total_s"] / f["total_s"],
            "delta": {s: max_abs_delta(h["weights"], res[s]["weights"]) for s in sides[1:]},
            **(
                {
                    "ray_ratio": round_ratio(res[RAY]["round_s"], h["round_s"]),
                    "flower_ratio": round_ratio(res[FLOWER]["round_s"], h["round_s"]),
                }
                if RAY in sides
                else {}
            ),
            **(
                {"pfl_ratio": round_ratio(res[PFL]["round_s"], h["round_s"])}
                if PFL in sides
                else {}
            ),
        }
        reps.append(rec)
        print(
            f"rep {rep + 1}/{args.reps} ({rec['order']}): "
            + ", ".join(f"{s} {res[s]['total_s']:.2f} s" for s in sides)
            + f"; per-round ratio {rec['round_ratio']:.3f} (hetfl/floor2 "
            f"{rec['round_ratio_floor2']:.3f}), total ratio "
            f"{rec['total_ratio']:.3f}; max|delta| vs hetfl "
            + ", ".join(f"{s} {d:.1e}" for s, d in rec["delta"].items()),
            flush=True,
        )
        for side in order:
            busy = res[side]["other_cores"]
            if busy is not None and busy > NOISY:
                print(
                    f"  warning: other processes kept {busy:.2f} cores busy during the {side} "
                    "side; its times are not trustworthy (re-run on a quiet machine)",
                    flush=True,
                )
    return summarise(w, sides, reps, args.executor)


def ray_side(w: Workload, args: argparse.Namespace) -> bool:
    """Whether workload `w` gets the Ray sides (HetFL's Ray executor, Flower's simulation
    engine): on A, against the process executor, unless
    `--no-ray` or `--smoke` (a Ray start is seconds) or Ray is not installed."""
    if w.name != "A" or args.executor != "processes" or args.no_ray or args.smoke:
        return False
    try:
        import ray  # noqa: F401 (only whether it imports)
    except ImportError:
        print("(no Ray side: Ray is not installed; pip install 'hetfl[ray]')", flush=True)
        return False
    return True


def pfl_side(w: Workload, args: argparse.Namespace) -> bool:
    """Whether workload `w` gets the pfl side: on A, against the process executor, where an
    interpreter with pfl-research is given (it lives in its own environment: its pins are
    not HetFL's, benchmarks/README.md)."""
    if w.name != "A" or args.executor != "processes":
        return False
    if not args.pfl_python:
        print("(no pfl side: give --pfl-python or set HETFL_PFL_PYTHON, see benchmarks/README.md)")
        return False
    return True


def side_threads(side: str, executor: str) -> int:
    """The intra-op threads a side trains with."""
    if side in (RAY, FLOWER, PFL):
        return 1
    if side in ("hetfl", BASE):
        return 1 if executor == "processes" else THREADS
    return 1 if side == "floor2" else THREADS


def tolerance(side: str, executor: str) -> float:
    """How far a side's final weights may be from HetFL's. Flower's FedAvg averages in
    float32 (HetFL and the floors sum in float64): rounding of the same order as another
    thread count's, which the next round's 94 steps per client amplify (1.6e-4 on A)."""
    if side in (FLOWER, PFL):  # both average in float32
        return ACROSS_THREADS
    same = side_threads(side, executor) == side_threads("hetfl", executor)
    return TOLERANCE if same else ACROSS_THREADS


def summarise(
    w: Workload, sides: tuple[str, ...], reps: list[dict[str, Any]], executor: str
) -> dict[str, Any]:
    """Print the workload's table; return its ratios and whether its weights agree."""
    print(
        "rep  order               "
        + "".join(f"{s + ' s':>10} {s + ' setup':>12}" for s in sides)
        + "  per-round  total  "
        + "".join(f"{s + ' MiB':>11}" for s in sides)
        + "  others' cores"
    )
    for i, r in enumerate(reps, 1):
        busy = "/".join(
            "n/a" if r[s]["other_cores"] is None else f"{r[s]['other_cores']:.2f}" for s in sides
        )
        print(
            f"{i:>3}  {r['order']:<19} "
            + "".join(f"{r[s]['total_s']:10.2f} {r[s]['setup_s']:12.2f}" for s in sides)
            + f"  {r['round_ratio']:9.3f}  {r['total_ratio']:5.3f}  "
            + "".join(f"{r[s]['peak_pss_mib']:11.0f}" for s in sides)
            + f"  {busy}"
        )
    for s in sides:
        rounds = per_round_medians([r[s]["round_s"] for r in reps])
        print(f"{s} seconds per round (median over reps): " + " ".join(f"{t:.3f}" for t in rounds))
    print(
        "final global accuracy: "
        + "; ".join(f"{s} " + ", ".join(f"{r[s]['acc'][-1]:.4f}" for r in reps) for s in sides)
    )
    if reps[0]["hetfl"].get("widths"):
        for s in sides:
            print(f"{s} accuracy by width (last rep): {reps[-1][s]['widths']}")
    mem = {s: statistics.median(r[s]["peak_pss_mib"] for r in reps) for s in sides}
    memory_ratio = mem["hetfl"] / mem["floor"]
    round1 = statistics.median(r["round1_ratio_floor2"] for r in reps)
    print(
        f"{w.name} round 1 (median over reps): "
        + ", ".join(
            f"{s} {statistics.median(r[s]['round_s'][0] for r in reps):.2f} s" for s in sides
        )
        + f"; hetfl/floor2 {round1:.2f}  {verdict(round1, ROUND1_TARGET)}"
    )
    print(
        f"{w.name} peak PSS of the process tree (median over reps): "
        + ", ".join(f"{s} {m:.0f} MiB" for s, m in mem.items())
        + f"; hetfl/floor {memory_ratio:.2f}  {verdict(memory_ratio, MEMORY_TARGET)}"
    )
    for floor, target in (("floor", TOTAL_TARGET_A), ("floor2", TOTAL_TARGET_A_FLOOR2)):
        total = statistics.median(r["hetfl"]["total_s"] / r[floor]["total_s"] for r in reps)
        total_line = f"{w.name} total-time ratio hetfl/{floor}: {total:.2f}"
        print(total_line + (f"  {verdict(total, target)}" if w.name == "A" else ""))
    bound = statistics.median(
        round_ratio(r["floor2"]["round_s"], r["floor"]["round_s"]) for r in reps
    )
    print(f"{w.name} per-round floor2/floor: {bound:.2f} (two one-thread processes against one)")
    if BASE in sides:
        for a, b in ((BASE, "floor"), ("hetfl", BASE)):
            versus = statistics.median(round_ratio(r[a]["round_s"], r[b]["round_s"]) for r in reps)
            print(f"{w.name} ratio {a}/{b}: {versus:.2f} (per round, median over reps)")
    worst = {s: max(r["delta"][s] for r in reps) for s in sides[1:]}
    print(
        f"{w.name} final weights, max |delta| vs hetfl: "
        + ", ".join(
            f"{s} {d:.1e} (tolerance {tolerance(s, executor):g}, {side_threads(s, executor)} "
            "thread(s))"
            for s, d in worst.items()
        )
    )
    differ = [f"{w.name}'s {s}" for s, d in worst.items() if not d <= tolerance(s, executor)]
    ratio = statistics.median(r["round_ratio"] for r in reps)
    ratio2 = statistics.median(r["round_ratio_floor2"] for r in reps)
    ray, flower = (
        (statistics.median(r[k] for r in reps) for k in ("ray_ratio", "flower_ratio"))
        if RAY in sides
        else (None, None)
    )
    return {
        "ratio": ratio,
        "ratio_floor2": ratio2,
        "round1_floor2": round1,
        "memory": memory_ratio,
        "pfl_ratio": statistics.median(r["pfl_ratio"] for r in reps) if PFL in sides else None,
        "ray_ratio": ray,
        "flower_ratio": flower,
        "differ": differ,
    }


# -- the driver ---------------------------------------------------------------------------------
def driver(args: argparse.Namespace) -> None:
    become_subreaper()  # a side's fork server and workers are reaped here, their CPU its own
    chosen = [chosen_workload(name, args.smoke) for name in args.workload]
    print(
        f"HetFL benchmark: workloads {', '.join(w.name for w in chosen)}, {args.reps} "
        f"interleaved repetition(s); hetfl executor {args.executor}"
        + (f" with {args.workers} workers" if args.executor == "processes" else "")
        + f"; floors in one process of {THREADS} threads",
        flush=True,
    )
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="hetfl-bench-") as tmp:
        for w in chosen:
            results[w.name] = run_workload(w, args, Path(tmp))
        lines = (
            []
            if args.no_startup
            else startup(Path(tmp), executor_overrides(args.executor, args.workers))
        )
    print()
    for line in lines:
        print(line)
    for name, r in results.items():
        print(ratio_line(name, r["ratio"], WORKLOADS[name].target))
        print(ratio_line(name, r["ratio_floor2"], FLOOR2_TARGET, versus="floor2"))
        print(f"{name} round-1 ratio hetfl/floor2: {r['round1_floor2']:.2f}  "
              + verdict(r["round1_floor2"], ROUND1_TARGET))  # fmt: skip
        print(
            f"{name} peak PSS hetfl/floor: {r['memory']:.2f}  {verdict(r['memory'], MEMORY_TARGET)}"
        )
        if r["ray_ratio"] is not None:
            print(ratio_line(name, r["ray_ratio"], RAY_TARGET, versus="processes", side=RAY))
            print(f"{name} ratio {FLOWER}/processes: {r['flower_ratio']:.2f}  (the reference)")
        if r["pfl_ratio"] is not None:
            print(f"{name} ratio {PFL}/processes: {r['pfl_ratio']:.2f}  (the reference)")
    if args.smoke:
        print("(--smoke: tiny shapes, one repetition; the times and ratios mean nothing)")
    failed = [side for r in results.values() for side in r["differ"]]
    if failed:
        bar = "!" * 78
        sys.stderr.write(
            f"\n{bar}\nBENCHMARK FAILED: HetFL and a floor ended with different weights: "
            f"{', '.join(failed)} (past the tolerance printed above).\nThe sides do not "
            f"compute the same method, so their times cannot be compared.\n{bar}\n"
        )
        sys.exit(1)


def chosen_workload(name: str, smoke: bool) -> Workload:
    return WORKLOADS[name].smoke() if smoke else WORKLOADS[name]


def workloads(text: str) -> list[str]:
    names = [n.strip().upper() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"--workload takes names among {', '.join(WORKLOADS)} separated by commas, got {text!r}"
        )
    return names


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--workload", type=workloads, default=list(WORKLOADS), help="e.g. A,H (default: all)"
    )
    p.add_argument("--reps", type=int, default=3, help="interleaved repetitions (default 3)")
    p.add_argument("--rounds", type=int, help="rounds of every workload (default: its own)")
    p.add_argument("--quick", action="store_true", help="1 repetition, few rounds")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="every code path on tiny shapes (1 round, 1 repetition, no start-up timings)",
    )
    p.add_argument("--executor", choices=EXECUTORS, default="processes", help="HetFL's executor")
    p.add_argument("--workers", type=int, default=2, help="HetFL's worker processes (default 2)")
    p.add_argument("--no-startup", action="store_true", help="skip the start-up timings")
    p.add_argument(
        "--no-ray",
        action="store_true",
        help="skip the Ray sides: HetFL's Ray executor and Flower's simulation (on A by default)",
    )
    p.add_argument(
        "--pfl-python",
        metavar="PATH",
        default=os.environ.get("HETFL_PFL_PYTHON"),
        help="an interpreter with pfl-research installed: adds the pfl side on A",
    )
    p.add_argument(
        "--baseline", metavar="DIR", help="also time HetFL of this other checkout (side 'base')"
    )
    p.add_argument(
        "--side", choices=(*SIDES, RAY, FLOWER), help="run one side of one workload (to profile it)"
    )
    p.add_argument("--profile", help="with --side: write cProfile stats of the timed part here")
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--weights", help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick or args.smoke:
        args.reps = 1
    if args.smoke:
        args.no_startup = True
    if args.reps < 1 or (args.rounds is not None and args.rounds < 1) or args.workers < 1:
        p.error("--reps, --rounds and --workers must be >= 1")
    if args.side is None:
        driver(args)
        return
    if len(args.workload) != 1:
        p.error("--side runs one workload: give --workload A, B or H")
    args.workload = args.workload[0]
    w = chosen_workload(args.workload, args.smoke)
    args.rounds = args.rounds or (w.quick_rounds if args.quick else w.rounds)
    with tempfile.TemporaryDirectory(prefix="hetfl-bench-side-") as tmp:
        args.out = args.out or str(Path(tmp) / "report.json")
        args.weights = args.weights or str(Path(tmp) / "weights.pt")
        args.workdir = args.workdir or tmp
        child(args)


if __name__ == "__main__":
    main()
