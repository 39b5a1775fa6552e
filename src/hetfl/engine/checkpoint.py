"""Atomic checkpoints: a run can be killed at any moment and resumed to the same result.

A checkpoint holds the round, the strategy's state (global state included), the cumulative
counters, the base seed and what the engine adds (the simulator's client store). No
generator state needs saving: every generator is derived from (seed, round, client,
purpose), so the seed is the whole RNG state. The file is written to a temporary name,
flushed and renamed, so a crash never leaves a half-written checkpoint behind.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

LATEST = "latest.pt"


def save_checkpoint(directory: Path, payload: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / LATEST
    tmp = directory / f".{LATEST}.tmp"
    with open(tmp, "wb") as fh:
        torch.save(payload, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, final)
    return final


def load_checkpoint(directory: Path) -> dict[str, Any]:
    path = directory / LATEST
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}: the run has not reached one yet")
    return torch.load(path, map_location="cpu", weights_only=False)
