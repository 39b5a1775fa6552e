"""On a GPU: HeteroFL clients of several widths packed on one device by the vectorised
executor, against the sequential executor and a plain one-process PyTorch loop, in one run;
and whether the determinism settings make two runs agree bit for bit.

Never in the suite (CI has no GPU) and not part of `make bench`. Run it on a machine with a
CUDA device; it uses that machine's own torch, and HetFL's pure-Python dependencies can
travel as wheels (see benchmarks/README.md, "On a GPU"). Data is synthetic (Gaussian
classes, `hetfl.data.synthetic`), written to an `.npz` so that the run takes it through the
ordinary `dataset: npz` path: no download. `--smoke` runs both workloads at a tiny scale,
on the CPU by default, so that a check without a GPU exercises the whole script.

1. Packed rounds. One round's local training of HeteroFL (Diao, Ding and Tarokh, ICLR
   2021, §3: width levels of one model, static BatchNorm, masked loss), levels 1, 1/2, 1/4
   and 1/8 in equal fixed proportions, every client in the round, SGD with momentum 0.9:
   (a) `mnist`: an MNIST-sized CNN (`flanc-cnn`, 1x28x28, 10 classes), 100 clients of 600
       samples, 5 local epochs of batch 10 (the setting of Flower's HeteroFL baseline:
       100 clients, 5 local epochs);
   (b) `cifar`: ResNet-18 (`resnet18`, ScalableFL's Table IV layout, widths 64-512 at level
       1) on 3x32x32, 20 clients, 10 steps of batch 32.
   Three sides on the same jobs, interleaved `--reps` times (the first vectorised run
   apart: torch.func loads its batching rules then): the sequential executor, the
   vectorised executor, and a plain loop (one `nn.Module` per width loaded with each
   client's tensors, `torch.optim.SGD`, cross-entropy, HeteroFL's clipping; HetFL's batch
   order; no class mask, no host wait inside a client's steps). Each side's median round
   time (only the training; the device synchronised), samples/s and peak GPU memory
   (`torch.cuda.max_memory_allocated`, reset before each side; the round's resident data
   and global model count for all three), the vectorised executor's groups and resident
   bytes, the largest difference between the executors' results, and the ratios
   `vectorised/sequential samples/s` (target >= 4 on (a)) and
   `vectorised/plain peak memory` (target <= 1.5); on a GPU, how often one vectorised round
   makes the host wait for the device (torch's sync debug mode; the sequential executor
   waits once a step, for its loss). A stack holds K
   clients' activations where the plain loop holds one's: `--max-stack N` caps K, trading
   speed for memory.
2. Determinism: a 2-round run of the ResNet-18 setting (8 clients, 4 per round, evaluation
   every round) twice with `deterministic: true` and twice with `false`, each in a fresh
   process; each pair's final model compared tensor by tensor. It prints
   `deterministic true: bit-identical` (or the number of tensors that differ and the
   largest difference), the same for false, and each run's wall time. Not with `--smoke`.

    python benchmarks/bench_gpu.py [--reps 2] [--skip packed|determinism] [--no-tf32]
    python benchmarks/bench_gpu.py --smoke          # tiny, on the CPU (a check, not a figure)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hetfl.config import validate
from hetfl.core.client.loop import batch_order
from hetfl.core.client.program import ClientProgram
from hetfl.core.init import build_model
from hetfl.core.pixels import model_inputs
from hetfl.core.spec import Spec
from hetfl.core.types import ClientOutput
from hetfl.data.synthetic import load_synthetic
from hetfl.runner import build_simulation
from hetfl.sim import ClientJob, Executor, SequentialExecutor, Simulation, TaskOutcome
from hetfl.sim.vectorised import VectorisedExecutor

sys.path.insert(0, str(Path(__file__).parent))
from bench_vectorised import round_jobs

LEVELS = [1.0, 0.5, 0.25, 0.125]


@dataclass(frozen=True)
class Workload:
    """One packed round: the model, the input shape, the clients and their training."""

    name: str
    model: str
    shape: tuple[int, ...]
    clients: int
    per_client: int
    epochs: int
    steps: int | None
    batch: int
    lr: float


FULL = {
    "mnist": Workload("mnist", "flanc-cnn", (1, 28, 28), 100, 600, 5, None, 10, 0.01),
    "cifar": Workload("cifar", "resnet18", (3, 32, 32), 20, 320, 1, 10, 32, 0.05),
}
SMOKE = {
    "mnist": Workload("mnist", "flanc-cnn", (1, 28, 28), 8, 10, 1, None, 5, 0.01),
    "cifar": Workload("cifar", "resnet18", (3, 32, 32), 8, 8, 1, 1, 4, 0.05),
}


def write_data(path: Path, shape: tuple[int, ...], n_train: int) -> Path:
    """Synthetic data of `shape` as an npz the `npz` dataset reads."""
    ds = load_synthetic(n_train=n_train, n_test=200, num_classes=10, shape=shape, noise=4.0)
    np.savez(path, x_train=ds.x_train, y_train=ds.y_train, x_test=ds.x_test, y_test=ds.y_test)
    return path


def config(data: Path, work: Workload, clients: int, device: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": f"bench-gpu-{work.name}",
        "seed": 0,
        "algorithm": "heterofl",
        "options": {"heterofl": {"levels": LEVELS, "assignment": "fixed"}},
        "data": {
            "dataset": "npz",
            "path": str(data),
            "num_clients": clients,
            "partition": {"kind": "iid"},
            "test_per_client": 0,
        },
        "model": {"name": work.model},
        "train": {
            "rounds": 1,
            "clients_per_round": clients,
            "local_epochs": work.epochs,
            "local_steps": work.steps,
            "batch_size": work.batch,
            "lr": work.lr,
            "momentum": 0.9,
        },
        "eval": {"local_eval": "none"},
        "device": device,
        **extra,
    }


class PlainLoop:
    """The plain one-process loop: a module per width, each client's tensors loaded into it,
    `torch.optim.SGD` over HetFL's batch order, gradient clipping as HeteroFL's settings ask."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.modules: dict[Spec, nn.Module] = {}

    def module(self, spec: Spec) -> nn.Module:
        if spec not in self.modules:
            family, device = self.sim.programs.family, self.sim.programs.device
            self.modules[spec] = build_model(family, spec).to(device)
        return self.modules[spec]

    def run(self, jobs: list[ClientJob]) -> list[dict[str, torch.Tensor]]:
        out = []
        for job in jobs:
            task, data = job.task, self.sim.clients[job.task.cid]
            program = self.sim.programs.program_for(task.cid)
            assert isinstance(program, ClientProgram), "an unwrapped client program"
            model = self.module(task.spec)
            model.load_state_dict(program.own_tensors(task, job.info, job.private))
            model.train()
            settings = task.config
            optimiser = torch.optim.SGD(
                model.parameters(), lr=settings.lr, momentum=settings.momentum,
                weight_decay=settings.weight_decay,
            )  # fmt: skip
            for idx in batch_order(data.n_train, settings, job.generator):
                idx = idx.to(data.x_train.device)
                x, y = model_inputs(data.x_train[idx], data.pixels), data.y_train[idx]
                optimiser.zero_grad(set_to_none=True)
                F.cross_entropy(model(x), y).backward()
                if settings.clip_grad_norm is not None:
                    nn.utils.clip_grad_norm_(model.parameters(), settings.clip_grad_norm)
                optimiser.step()
            out.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        return out


def samples_of(sim: Simulation, jobs: list[ClientJob]) -> int:
    """The samples a round's jobs train on (every side draws the same batches)."""
    total = 0
    for job in jobs:
        n = sim.clients[job.task.cid].n_train
        total += sum(len(b) for b in batch_order(n, job.task.config, job.generator))
    return total


def _synchronise(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(sim: Simulation, side: Executor | PlainLoop) -> tuple[float, int | None, Any]:
    """One round of `side` on fresh jobs: its seconds, its peak GPU memory (None on a CPU)
    and what it returned."""
    device = sim.programs.device
    jobs = round_jobs(sim)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    _synchronise(device)
    start = time.perf_counter()
    if isinstance(side, PlainLoop):
        done: Any = side.run(jobs)
    else:
        done = side.run(sim.programs, jobs, sim.clients, None)
    _synchronise(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    return seconds, peak, done


def host_waits(sim: Simulation, executor: Executor) -> int:
    """How many times one round of `executor` makes the host wait for the GPU (torch's
    sync debug mode, one warning a synchronising call; an extra, untimed round)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            executor.run(sim.programs, round_jobs(sim), sim.clients, None)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in seen)


def max_diff(a: list[TaskOutcome], b: list[TaskOutcome]) -> float:
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        assert isinstance(x.output, ClientOutput) and isinstance(y.output, ClientOutput)
        for k, v in x.output.result.tensors.items():
            worst = max(
                worst, float((v.double() - y.output.result.tensors[k].double()).abs().max())
            )
    return worst


def _mib(peak: int | None) -> str:
    return "n/a (CPU)" if peak is None else f"{peak / 2**20:.1f} MiB"


def packed_round(work: Workload, args: argparse.Namespace, root: Path) -> None:
    """Workload `work`: the three sides interleaved `args.reps` times; medians and ratios."""
    data = write_data(root / f"{work.name}.npz", work.shape, work.clients * work.per_client)
    cfg = validate(config(data, work, work.clients, args.device, deterministic=args.deterministic))
    sim = build_simulation(cfg, root / f"sim-{work.name}", show_progress=False)
    sim.setup()
    samples = samples_of(sim, round_jobs(sim))
    sides: dict[str, Executor | PlainLoop] = {
        "sequential": SequentialExecutor(),
        "vectorised": VectorisedExecutor(max_stack=args.max_stack),
        "plain": PlainLoop(sim),
    }
    print(f"-- ({work.name}) HeteroFL {work.model}, {work.clients} clients at "
          f"{len(LEVELS)} widths, {samples} samples in the round", flush=True)  # fmt: skip
    first, _, _ = timed(sim, sides["vectorised"])
    print(f"first vectorised run (loads torch.func's rules): {first:.2f} s", flush=True)
    seconds: dict[str, list[float]] = {k: [] for k in sides}
    peaks: dict[str, int | None] = dict.fromkeys(sides)
    diff = 0.0
    names = list(sides)
    for rep in range(args.reps):
        done = {}
        for name in names[rep % 3 :] + names[: rep % 3]:  # who goes first rotates
            s, peaks[name], done[name] = timed(sim, sides[name])
            seconds[name].append(s)
        diff = max(diff, max_diff(done["sequential"], done["vectorised"]))
        print(
            f"rep {rep + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in seconds.items()),
            flush=True,
        )
    vectorised = sides["vectorised"]
    assert isinstance(vectorised, VectorisedExecutor)
    print(f"vectorised groups: {[len(g) for g in vectorised.grouped]} clients; "
          f"alone: {vectorised.alone}; resident per group: "
          f"{[_mib(b) for b in vectorised.resident]}")  # fmt: skip
    median = {k: statistics.median(v) for k, v in seconds.items()}
    for name in sides:
        print(f"{name}: round {median[name]:.2f} s, {samples / median[name]:,.0f} samples/s, "
              f"peak GPU memory {_mib(peaks[name])}")  # fmt: skip
    print(f"max |diff| sequential against vectorised: {diff:.2e}")
    print(
        f"ratio vectorised/sequential samples/s: {median['sequential'] / median['vectorised']:.2f}"
    )
    print(f"ratio vectorised/plain samples/s: {median['plain'] / median['vectorised']:.2f}")
    peak_v, peak_p = peaks["vectorised"], peaks["plain"]
    if peak_v is not None and peak_p is not None:
        print(f"ratio vectorised/plain peak memory: {peak_v / peak_p:.2f}")
        print(f"host waits for the GPU in one vectorised round: {host_waits(sim, vectorised)} "
              f"({len(vectorised.grouped)} stacks; the sequential executor waits once a step, "
              "for its loss)")  # fmt: skip


def one_run(data: Path, out: Path, deterministic: bool, device: str) -> float:
    """A 2-round run in a fresh process (cuBLAS reads its workspace setting at start)."""
    cfg = config(data, FULL["cifar"], 8, device, deterministic=deterministic)
    cfg["train"].update(rounds=2, clients_per_round=4)
    cfg["eval"] = {"local_eval": "none", "every": 1}
    cfg["output_dir"], cfg["name"] = str(out.parent), out.name
    path = out.parent / f"{out.name}.json"
    path.write_text(json.dumps(cfg))
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "hetfl.cli", "run", str(path), "--quiet"], check=True)
    return time.perf_counter() - start


def final_state(run: Path) -> dict[str, torch.Tensor]:
    files = sorted(run.glob("checkpoints/*"), key=lambda p: p.stat().st_mtime)
    blob = torch.load(files[-1], map_location="cpu", weights_only=False)
    return dict(_tensors(blob, ""))


def _tensors(obj: Any, prefix: str) -> list[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        return [(prefix, obj)]
    if isinstance(obj, dict):
        return [t for k, v in obj.items() for t in _tensors(v, f"{prefix}/{k}")]
    if isinstance(obj, list | tuple):
        return [t for i, v in enumerate(obj) for t in _tensors(v, f"{prefix}/{i}")]
    return []


def compare_runs(a: Path, b: Path) -> str:
    x, y = final_state(a), final_state(b)
    assert x.keys() == y.keys(), "the two runs saved different tensors"
    differ = [k for k in x if not torch.equal(x[k], y[k])]
    if not differ:
        return f"bit-identical ({len(x)} tensors)"
    worst = max(float((x[k].double() - y[k].double()).abs().max()) for k in differ)
    return f"{len(differ)} of {len(x)} tensors differ, max |diff| {worst:.2e}"


def same_metrics(a: Path, b: Path) -> bool:
    """The metrics rows of two runs, wall times aside."""

    def rows(run: Path) -> list[dict[str, Any]]:
        lines = (run / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(x).items() if "wall" not in k} for x in lines]

    return rows(a) == rows(b)


def determinism(args: argparse.Namespace, root: Path) -> None:
    data = write_data(root / "determinism.npz", FULL["cifar"].shape, 8 * 320)
    for deterministic in (True, False):
        runs = [root / f"det-{deterministic}-{i}" for i in (1, 2)]
        walls = [one_run(data, run, deterministic, args.device) for run in runs]
        print(
            f"deterministic {str(deterministic).lower()}: {compare_runs(*runs)}; "
            f"metrics rows {'equal' if same_metrics(*runs) else 'differ'}; "
            f"runs {walls[0]:.1f} s and {walls[1]:.1f} s",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument(
        "--max-stack",
        type=int,
        default=None,
        help="the vectorised executor's most clients a stack (default: a whole width's group)",
    )
    parser.add_argument("--device", default=None, help="cuda (default), or cpu with --smoke")
    parser.add_argument("--workloads", nargs="+", choices=list(FULL), default=list(FULL))
    parser.add_argument("--smoke", action="store_true", help="tiny scale, 1 rep, no determinism")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--skip", choices=["packed", "determinism"], default=None)
    parser.add_argument(
        "--deterministic",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the packed rounds' determinism settings (HetFL's default: on)",
    )
    parser.add_argument(
        "--no-tf32",
        action="store_true",
        help="cuDNN and cuBLAS in full float32 (PyTorch lets cuDNN convolutions use TF32 by "
        "default on Ampere and later, which HetFL leaves as it is)",
    )
    args = parser.parse_args()
    args.device = args.device or ("cpu" if args.smoke else "cuda")
    if args.smoke:
        args.reps = 1
    if args.no_tf32:
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    if args.device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        print(
            f"device: {props.name}, {props.total_memory / 2**30:.0f} GiB, "
            f"torch {torch.__version__}, "
            f"CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}"
        )
    scale = SMOKE if args.smoke else FULL
    with tempfile.TemporaryDirectory() as tmp:
        root = args.out or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        if args.skip != "packed":
            for name in args.workloads:
                packed_round(scale[name], args, root)
        if args.skip != "determinism" and not args.smoke:
            determinism(args, root)


if __name__ == "__main__":
    main()
