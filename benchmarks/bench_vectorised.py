"""The vectorised executor against the sequential one: one round's local training.

Workload: FedAvg, the small CNN, Fashion-MNIST IID over 200 clients of 300 samples, 20 of
them in the round (10 steps of batch 32 each, the last one of 12), SGD lr 0.05 with
momentum 0.9. Both executors train the same round's jobs (fresh generators each time),
interleaved, `--reps` times; only `Executor.run` is timed. The first vectorised run of a
process is timed apart: `torch.func` loads its batching rules then (seconds, once).
It prints each executor's median seconds, the largest difference between the two
executors' result tensors, and `ratio vectorised/sequential: X.XX`.

    .venv/bin/python benchmarks/bench_vectorised.py [--reps 3] [--threads 1] [--device cuda]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hetfl.config import validate
from hetfl.core.rng import torch_generator
from hetfl.core.types import ClientOutput
from hetfl.runner import build_simulation
from hetfl.sim import ClientJob, Executor, SequentialExecutor, Simulation, TaskOutcome
from hetfl.sim.vectorised import VectorisedExecutor


def _simulation(device: str, threads: int, workdir: Path) -> Simulation:
    cfg = validate(
        {
            "name": "bench-vectorised",
            "seed": 0,
            "algorithm": "fedavg",
            "data": {
                "dataset": "fashion-mnist",
                "num_clients": 200,
                "partition": {"kind": "iid"},
                "test_per_client": 0,
            },
            "model": {"name": "small-cnn"},
            "train": {
                "rounds": 1,
                "clients_per_round": 20,
                "local_epochs": 1,
                "batch_size": 32,
                "lr": 0.05,
                "momentum": 0.9,
            },
            "eval": {"local_eval": "none"},
            "device": device,
            "threads": threads,
        }
    )
    sim = build_simulation(cfg, workdir, show_progress=False)
    sim.setup()
    return sim


def round_jobs(sim: Simulation) -> list[ClientJob]:
    """Round 1's jobs as the engine builds them, with fresh generators (each side draws)."""
    sample = torch_generator(0, 1, -1, "sample")
    tasks = sorted(
        sim.strategy.plan(1, sim.state, sim.known_clients(), sample), key=lambda t: t.cid
    )
    return [
        ClientJob(t, sim.infos[t.cid], {}, torch_generator(0, 1, t.cid, "train"), {}) for t in tasks
    ]


def _timed(executor: Executor, sim: Simulation) -> tuple[float, list[TaskOutcome]]:
    jobs = round_jobs(sim)
    if sim.programs.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    done = executor.run(sim.programs, jobs, sim.clients, None)
    if sim.programs.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, done


def _max_diff(a: list[TaskOutcome], b: list[TaskOutcome]) -> float:
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        assert isinstance(x.output, ClientOutput) and isinstance(y.output, ClientOutput)
        for k, v in x.output.result.tensors.items():
            worst = max(worst, float((v - y.output.result.tensors[k]).abs().max()))
    return worst


def compare(sim: Simulation, reps: int) -> tuple[float, float, float, VectorisedExecutor]:
    """The sequential and the vectorised executor on the same round's jobs, interleaved
    `reps` times (who goes first alternates), after one untimed-apart vectorised run: their
    median seconds, the largest difference between their results, and the vectorised
    executor (its groups)."""
    sequential, vectorised = SequentialExecutor(), VectorisedExecutor()
    first, _ = _timed(vectorised, sim)
    print(f"first vectorised run (loads torch.func's rules): {first:.2f} s", flush=True)
    times: dict[str, list[float]] = {"sequential": [], "vectorised": []}
    diff = 0.0
    for rep in range(reps):
        order: list[tuple[str, Executor]] = [("sequential", sequential), ("vectorised", vectorised)]
        outcomes = {}
        for name, executor in order if rep % 2 == 0 else order[::-1]:
            seconds, outcomes[name] = _timed(executor, sim)
            times[name].append(seconds)
        diff = max(diff, _max_diff(outcomes["sequential"], outcomes["vectorised"]))
        print(
            f"rep {rep + 1}: sequential {times['sequential'][-1]:.2f} s, "
            f"vectorised {times['vectorised'][-1]:.2f} s",
            flush=True,
        )
    seq, vec = (statistics.median(times[k]) for k in ("sequential", "vectorised"))
    return seq, vec, diff, vectorised


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        sim = _simulation(args.device, args.threads, Path(workdir))
        seq, vec, diff, vectorised = compare(sim, args.reps)
        assert vectorised.grouped, "the round was not vectorised"
        print(
            f"device {sim.programs.device}, threads {args.threads}, "
            f"groups {len(vectorised.grouped)}"
        )
        print(f"median: sequential {seq:.2f} s, vectorised {vec:.2f} s; max |diff| {diff:.2e}")
        print(f"ratio vectorised/sequential: {vec / seq:.2f}")


if __name__ == "__main__":
    main()
