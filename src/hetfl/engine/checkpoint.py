"""Atomic checkpoints: a run can be killed at any moment and resumed to the same result.

A checkpoint holds the round, the config it was written under (`config`, its YAML, which
`hetfl resume` compares with the run folder's), the global state (`global`), what the
strategy's parts keep across rounds (`strategy`: server optimiser moments), the cumulative
counters, the base seed and what the engine adds (the simulator's client store). No
generator state needs saving: every generator is derived from (seed, round, client,
purpose), so the seed is the whole RNG state. The file is written to a temporary name,
flushed and renamed, so a crash never leaves a half-written checkpoint behind.

An entry that is an `Entries` mapping (the client store: one entry per client, possibly
spilled to disk) is not pickled into `latest.pt`: it is streamed, one client at a time,
into its own file of raw records next to it (`<key>-<token>.entries`,
`hetfl.engine.entryfile`), flushed before `latest.pt` names it, so writing a checkpoint of
10,000 clients never holds more than one spilled entry in memory. Once the new `latest.pt`
is in place, every `.entries` file it does not name is removed. Loading gives back an
`EntryFile` there, which reads each entry as asked for.

Every checkpoint carries `format`, the version of its layout. A resumed run must equal an
uninterrupted one bit for bit, so a checkpoint of another layout is refused, never
converted: what it lacks or names differently cannot be reconstructed exactly.

Every file is verified when read. `latest.pt` records the SHA-256 of each `.entries` file
it names, and ends with a trailer holding the SHA-256 of everything before it
(`_TRAILER`); loading checks both before anything is unpickled. `torch.load` alone does
not notice a changed byte inside a tensor (it loads different values without error), and a
resumed run from a changed file would silently differ from the uninterrupted one: a file
that fails its check is refused as damaged (`CheckpointDamagedError`), naming it.
"""

from __future__ import annotations

import hashlib
import io
import os
import uuid
from pathlib import Path
from typing import Any

import torch

from hetfl.engine.entryfile import Entries, EntryFile, file_sha256, write_entries

LATEST = "latest.pt"
#: The layout of what `save_checkpoint` writes; bump it whenever a checkpoint's entries
#: change, so that older checkpoints are refused with a message instead of misread.
#: Format 4: digests of `latest.pt` (its trailer) and of each `.entries` file; format 5:
#: `config`, the YAML of the config the checkpoint was written under.
FORMAT = 5
#: The mark that stands in `latest.pt` for an entry streamed into its own file, and the key
#: of that file's SHA-256 beside it.
_STREAMED = "entries_file"
_DIGEST = "sha256"
_SUFFIX = ".entries"
#: `latest.pt` ends with this, then the hex SHA-256 of the bytes before it.
_TRAILER = b"\nhetfl-checkpoint-sha256:"
_HEX = 64


class CheckpointFormatError(ValueError):
    """A checkpoint written in another layout than this version of hetfl reads."""


class CheckpointDamagedError(ValueError):
    """A checkpoint file whose bytes are not those that were written (truncated, changed
    or missing)."""

    def __init__(self, path: Path, why: str) -> None:
        directory = path.parent
        super().__init__(
            f"checkpoint file {path} is damaged ({why}); it cannot be resumed from, since a "
            "run resumed from changed bytes would not equal the uninterrupted run. Restore "
            f"the checkpoint folder {directory} from a copy, or remove it and run "
            "`hetfl resume` on the run folder, which then starts the run again from round 1"
        )
        self.path = path


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
    buffer = io.BytesIO()
    torch.save({**body, "format": FORMAT}, buffer)
    data = buffer.getbuffer()
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.write(_TRAILER + hashlib.sha256(data).hexdigest().encode())
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, final)
    named = {v[_STREAMED] for v in body.values() if _is_streamed(v)}
    for stale in directory.glob(f"*{_SUFFIX}"):
        if stale.name not in named:
            stale.unlink()
    return final


def _stream(directory: Path, key: str, entries: Entries) -> dict[str, str]:
    """Write `entries` into a new file in `directory`; the mark `latest.pt` holds instead,
    with the file's SHA-256."""
    name = f"{key}-{uuid.uuid4().hex[:12]}{_SUFFIX}"
    digest = write_entries(directory / name, ((cid, entries[cid]) for cid in entries))
    return {_STREAMED: name, _DIGEST: digest}


def _is_streamed(value: Any) -> bool:
    return isinstance(value, dict) and set(value) == {_STREAMED, _DIGEST}


def has_checkpoint(directory: Path) -> bool:
    """Whether `directory` holds a checkpoint (`load_checkpoint` may still refuse it)."""
    return (directory / LATEST).exists()


def load_checkpoint(directory: Path) -> dict[str, Any]:
    """The checkpoint in `directory`, every file verified against its digest; refused
    unless it was written in format `FORMAT`."""
    path = directory / LATEST
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}: the run has not reached one yet")
    ckpt = _read_latest(path)
    found = ckpt.get("format", "none (written before checkpoints were versioned)")
    if found != FORMAT:
        raise CheckpointFormatError(
            f"checkpoint {path} has format {found}, this hetfl reads format {FORMAT} only: "
            "a resumed run must equal an uninterrupted one, so an old checkpoint is not "
            "converted; re-run from the start (or resume with the hetfl version that wrote it)"
        )
    return {k: _entry_file(directory, v) if _is_streamed(v) else v for k, v in ckpt.items()}


def written_under(directory: Path) -> tuple[int, str]:
    """The round of the checkpoint in `directory` and the YAML of the config it was written
    under ("" from a run built without a config), verified as `load_checkpoint` verifies."""
    ckpt = load_checkpoint(directory)
    return int(ckpt["round"]), str(ckpt.get("config", ""))


def _read_latest(path: Path) -> dict[str, Any]:
    """`latest.pt` unpickled once its trailer's digest matches. A file without the trailer
    is unpickled only to read an older format's number (refused by the caller); one that
    cannot be read at all is damaged."""
    data = path.read_bytes()
    end = len(data) - len(_TRAILER) - _HEX
    if end >= 0 and data[end : end + len(_TRAILER)] == _TRAILER:
        body = memoryview(data)[:end]
        if hashlib.sha256(body).hexdigest().encode() != data[-_HEX:]:
            raise CheckpointDamagedError(path, "its SHA-256 differs from the one written with it")
        return _unpickle(path, io.BytesIO(body))
    ckpt = _unpickle(path, io.BytesIO(data))
    if ckpt.get("format") == FORMAT:
        raise CheckpointDamagedError(path, "its SHA-256 trailer is missing")
    return ckpt


def _unpickle(path: Path, source: io.BytesIO) -> dict[str, Any]:
    try:
        ckpt = torch.load(source, map_location="cpu", weights_only=False)
    except Exception as exc:  # truncated or not a checkpoint: torch raises many kinds
        raise CheckpointDamagedError(
            path, f"it cannot be read as a checkpoint: {type(exc).__name__}"
        ) from exc
    if not isinstance(ckpt, dict):
        raise CheckpointDamagedError(path, f"it holds a {type(ckpt).__name__}, not a checkpoint")
    return ckpt


def _entry_file(directory: Path, mark: dict[str, str]) -> EntryFile:
    """The `.entries` file `latest.pt` names, once its SHA-256 is the one recorded."""
    path = directory / mark[_STREAMED]
    if not path.exists():
        raise CheckpointDamagedError(path, f"it is missing, though {LATEST} names it")
    if file_sha256(path) != mark[_DIGEST]:
        raise CheckpointDamagedError(path, "its SHA-256 differs from the one recorded in " + LATEST)
    return EntryFile(path)
