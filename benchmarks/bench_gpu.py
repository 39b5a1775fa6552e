"""On a GPU: the vectorised executor against the sequential one for a CIFAR-shaped ResNet-18
HeteroFL round, and whether the determinism settings make two runs agree bit for bit.

Never in the suite (CI has no GPU). Run it on a machine with a CUDA device; it uses that
machine's own torch, and HetFL's pure-Python dependencies can travel as wheels (see
benchmarks/README.md, "On a GPU"). Data is synthetic and CIFAR-shaped (3x32x32, 10 Gaussian
classes, `hetfl.data.synthetic`), written to an `.npz` so that the run takes it through the
ordinary `dataset: npz` path: no download.

1. One round's local training, HeteroFL on the scalable `resnet18` family (ScalableFL's
   Table IV layout: 4 stages of 2 basic blocks, base widths 64-512), levels 1, 1/2, 1/4 and
   1/8 in equal fixed proportions, `--clients` clients in the round (a quarter per level),
   each training `--steps` mini-batches of 32. Sequential and vectorised runs interleaved
   `--reps` times; only `Executor.run` is timed (the first vectorised run apart: torch.func
   loads its batching rules then). It prints both medians, the groups the vectorised
   executor formed, the largest difference between the two executors' results, and
   `ratio vectorised/sequential: X.XX`.
   Both with the determinism settings on and off.
2. Determinism: the same 2-round run (evaluation included) twice with `deterministic: true`
   and twice with `deterministic: false`, each in a fresh process; each pair's final model
   compared tensor by tensor. It prints `deterministic true: bit-identical` (or the number
   of tensors that differ and the largest difference), the same for false, and each run's
   wall time.

    python benchmarks/bench_gpu.py [--clients 20] [--steps 10] [--reps 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hetfl.config import validate
from hetfl.data.synthetic import load_synthetic
from hetfl.runner import build_simulation
from hetfl.sim import Simulation

sys.path.insert(0, str(Path(__file__).parent))
from bench_vectorised import compare


def write_data(path: Path, clients: int, per_client: int) -> Path:
    """Synthetic CIFAR-shaped data as an npz the `npz` dataset reads."""
    ds = load_synthetic(
        n_train=clients * per_client, n_test=1000, num_classes=10, shape=(3, 32, 32), noise=4.0
    )
    np.savez(path, x_train=ds.x_train, y_train=ds.y_train, x_test=ds.x_test, y_test=ds.y_test)
    return path


def config(data: Path, clients: int, steps: int, device: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": "bench-gpu",
        "seed": 0,
        "algorithm": "heterofl",
        "options": {"heterofl": {"levels": [1.0, 0.5, 0.25, 0.125], "assignment": "fixed"}},
        "data": {
            "dataset": "npz",
            "path": str(data),
            "num_clients": clients,
            "partition": {"kind": "iid"},
            "test_per_client": 0,
        },
        "model": {"name": "resnet18"},
        "train": {
            "rounds": 1,
            "clients_per_round": clients,
            "local_epochs": 1,
            "local_steps": steps,
            "batch_size": 32,
            "lr": 0.05,
            "momentum": 0.9,
        },
        "eval": {"local_eval": "none"},
        "device": device,
        **extra,
    }


def vectorised_round(
    data: Path, args: argparse.Namespace, workdir: Path, deterministic: bool
) -> None:
    print(f"-- vectorised against sequential, deterministic {str(deterministic).lower()}")
    cfg = validate(config(data, args.clients, args.steps, args.device, deterministic=deterministic))
    sim: Simulation = build_simulation(cfg, workdir, show_progress=False)
    sim.setup()
    seq, vec, diff, vectorised = compare(sim, args.reps)
    print(f"vectorised groups: {vectorised.grouped}; alone: {vectorised.alone}")
    print(f"median: sequential {seq:.2f} s, vectorised {vec:.2f} s; max |diff| {diff:.2e}")
    print(f"ratio vectorised/sequential: {vec / seq:.2f}")


def one_run(data: Path, out: Path, deterministic: bool, args: argparse.Namespace) -> float:
    """A 2-round run in a fresh process (cuBLAS reads its workspace setting at start)."""
    cfg = config(data, 8, args.steps, args.device, deterministic=deterministic)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--skip", choices=["vectorised", "determinism"], default=None)
    parser.add_argument(
        "--no-tf32",
        action="store_true",
        help="cuDNN and cuBLAS in full float32 (PyTorch lets cuDNN convolutions use TF32 by "
        "default on Ampere and later, which HetFL leaves as it is)",
    )
    args = parser.parse_args()
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
    with tempfile.TemporaryDirectory() as tmp:
        root = args.out or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        data = write_data(root / "cifar_shaped.npz", max(args.clients, 8), 32 * args.steps)
        if args.skip != "vectorised":
            for deterministic in (True, False):
                vectorised_round(data, args, root / f"sim-{deterministic}", deterministic)
        if args.skip != "determinism":
            for deterministic in (True, False):
                runs = [root / f"det-{deterministic}-{i}" for i in (1, 2)]
                walls = [one_run(data, run, deterministic, args) for run in runs]
                print(
                    f"deterministic {str(deterministic).lower()}: {compare_runs(*runs)}; "
                    f"metrics rows {'equal' if same_metrics(*runs) else 'differ'}; "
                    f"runs {walls[0]:.1f} s and {walls[1]:.1f} s",
                    flush=True,
                )


if __name__ == "__main__":
    main()
