"""Which device a run uses, and its determinism settings: what every process that runs
part of a run (the simulator, its worker processes, the Flower server and nodes) sets up
the same way before its first tensor."""

from __future__ import annotations

import os

import torch


def resolve_device(name: str) -> torch.device:
    """`auto` takes a GPU where one is present, else the CPU."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but no CUDA device is available")
    return torch.device(name)


#: The cuBLAS workspace setting that makes its results reproducible (NVIDIA's cuBLAS guide,
#: "Results reproducibility"); PyTorch's deterministic mode refuses cuBLAS calls without it.
CUBLAS_WORKSPACE_CONFIG = ":4096:8"


def make_deterministic(device: torch.device, deterministic: bool) -> None:
    """Deterministic kernels, or not, for a run on a CUDA `device`, as the config key
    `deterministic` says; nothing for other devices.

    With it: PyTorch's deterministic algorithms, cuDNN's deterministic mode without its
    benchmark (which picks kernels by timing), and `CUBLAS_WORKSPACE_CONFIG` unless the user
    set it. cuBLAS reads that variable when it creates its handle, so every process that
    runs part of a run calls this before its first CUDA tensor: `build_parts` does, for the
    simulator, the Flower server and each Flower node, and a worker process must do the same.
    Without it, deterministic algorithms and cuDNN's deterministic mode are switched off
    (a sweep runs its points in one process, so a point's own setting must hold): faster,
    and not bit-reproducible. Never at import."""
    if device.type != "cuda":
        return
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(deterministic)
    torch.backends.cudnn.deterministic = deterministic
