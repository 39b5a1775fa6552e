"""Atomic checkpoints: a run can be killed at any moment and resumed to the same result.

A checkpoint holds the round, the global state (`global`), what the strategy's parts keep
across rounds (`strategy`: server optimiser moments), the cumulative counters, the base
seed and what the engine adds (the simulator's client store). No generator state needs
saving: every generator is derived from (seed, round, client, purpose), so the seed is
the whole RNG state. The file is written to a temporary name,
flushed and renamed, so a crash never leaves a half-written checkpoint behind.

An entry that is an `Entries` mapping (the client store: one entry per client, possibly
spilled to disk) is not pickled into `latest.pt`: it is streamed, one client at a time,
into its own file of raw records next to it (`<key>-<token>.entries`,
`hetfl.core.entryfile`), flushed before `latest.pt` names it, so writing a checkpoint of
10,000 clients never holds more than one spilled entry in memory. Once the new `latest.pt`
is in place, every `.entries` file it does not name is removed. Loading gives back an
`EntryFile` there, which reads each entry as asked for.

Every checkpoint carries `format`, the version of its layout. A resumed run must equal an
uninterrupted one bit for bit, so a checkpoint of another layout is refused, never
converted: what it lacks or names differently cannot be reconstructed exactly.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import torch

from hetfl.core.entryfile import Entries, EntryFile, write_entries

LATEST = "latest.pt"
#: The layout of what `save_checkpoint` writes; bump it whenever a checkpoint's entries
#: change, so that older checkpoints are refused with a message instead of misread.
FORMAT = 3
#: The mark that stands in `latest.pt` for an entry streamed into its own file.
_STREAMED = "entries_file"
_SUFFIX = ".entries"


class CheckpointFormatError(ValueError):
    """A checkpoint written in another layout than this version of hetfl reads."""


def save_checkpoint(directory: Path, payload: dict[str, Any]) -> Path:
    """Write `payload` (plus its `format`) atomically as `directory/latest.pt`, each
    `Entries` value streamed into its own file first."""
    directory.mkdir(parents=True, exist_ok=True)
    body = {
        key: _stream(directory, key, v) if isinstance(v, Entries) else v
        for key, v in payload.items()
    }
    final = directory / LATEST
    tmp = directory / f".{LATEST}.tmp"
    with open(tmp, "wb") as fh:
        torch.save({**body, "format": FORMAT}, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, final)
    named = {v[_STREAMED] for v in body.values() if _is_streamed(v)}
    for stale in directory.glob(f"*{_SUFFIX}"):
        if stale.name not in named:
            stale.unlink()
    return final


def _stream(directory: Path, key: str, entries: Entries) -> dict[str, str]:
    """Write `entries` into a new file in `directory`; the mark `latest.pt` holds instead."""
    name = f"{key}-{uuid.uuid4().hex[:12]}{_SUFFIX}"
    write_entries(directory / name, ((cid, entries[cid]) for cid in entries))
    return {_STREAMED: name}


def _is_streamed(value: Any) -> bool:
    return isinstance(value, dict) and set(value) == {_STREAMED}


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
    return {
        k: EntryFile(directory / v[_STREAMED]) if _is_streamed(v) else v for k, v in ckpt.items()
    }
