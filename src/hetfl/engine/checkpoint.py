"""Atomic checkpoints: a run can be killed at any moment and resumed to the same result.

A checkpoint holds the round, the global state (`global`), what the strategy's parts keep
across rounds (`strategy`: server optimiser moments), the cumulative counters, the base
seed and what the engine adds (the simulator's client store). No generator state needs
saving: every generator is derived from (seed, round, client, purpose), so the seed is
the whole RNG state. The file is written to a temporary name,
flushed and renamed, so a crash never leaves a half-written checkpoint behind.

Every checkpoint carries `format`, the version of its layout. A resumed run must equal an
uninterrupted one bit for bit, so a checkpoint of another layout is refused, never
converted: what it lacks or names differently cannot be reconstructed exactly.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

LATEST = "latest.pt"
#: The layout of what `save_checkpoint` writes; bump it whenever a checkpoint's entries
#: change, so that older checkpoints are refused with a message instead of misread.
FORMAT = 2


class CheckpointFormatError(ValueError):
    """A checkpoint written in another layout than this version of hetfl reads."""


def save_checkpoint(directory: Path, payload: dict[str, Any]) -> Path:
    """Write `payload` (plus its `format`) atomically as `directory/latest.pt`."""
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / LATEST
    tmp = directory / f".{LATEST}.tmp"
    with open(tmp, "wb") as fh:
        torch.save({**payload, "format": FORMAT}, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, final)
    return final


def load_checkpoint(directory: Path) -> dict[str, Any]:
    """The checkpoint in `directory`; refused unless it was written in format `FORMAT`."""
    path = directory / LATEST
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}: the run has not reached one yet")
    ckpt: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=False)
    found = ckpt.get("format", "none (written before checkpoints were versioned)")
    if found != FORMAT:
        raise CheckpointFormatError(
            f"checkpoint {path} has format {found}, this hetfl reads format {FORMAT} only: "
            "a resumed run must equal an uninterrupted one, so an old checkpoint is not "
            "converted; re-run from the start (or resume with the hetfl version that wrote it)"
        )
    return ckpt
