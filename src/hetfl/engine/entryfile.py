"""Client entries on disk: the client store's spill files and a checkpoint's store file.

An entry is one client's private tensors (`hetfl.engine.store`). On disk it is one raw
record: an 8-byte little-endian header length, a JSON header (the client id and, for each
tensor in order, its name, dtype, shape and device), then each tensor's bytes in the same
order. A file holds one record (a spilled entry) or many, one after another (a checkpoint's
store). Reading a record gives back every tensor with the same dtype, shape, device and
values, bit for bit; strides are not kept (every tensor comes back contiguous).

Raw records rather than `torch.save`: an entry of `stage-cnn`'s private BatchNorm and head
(FedBN + FedPer, 22 tensors, 17,992 bytes) took 3.1-3.6 ms to `torch.save` into a file of
its own and 7.0-7.6 ms to `torch.load`, against 0.7 ms to append as a raw record to a
`SpillSegment` and 0.5-0.7 ms to read back (1,000 entries, page cache, this 2-core machine
under a load of ~4.8): the zip container and pickling cost far more than the bytes for
entries this small; what is left is mostly PyTorch's per-tensor call overhead.

`Entries` marks a mapping of client id to entry whose entries are read one at a time: a
checkpoint streams such a mapping into a file of records (`hetfl.engine.checkpoint`), so
writing or reading it never holds more than one entry that is not already in memory.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import struct
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Protocol

import torch

from hetfl.core.state import State

_LENGTH = struct.Struct("<Q")


class Entries(Mapping[int, State]):
    """Client id -> entry, read one entry at a time (`__getitem__` may read a file)."""


class _Writable(Protocol):
    def write(self, data: bytes | memoryview, /) -> int | None: ...


class _Hashing:
    """A file being written, and the SHA-256 of every byte written to it."""

    def __init__(self, fh: io.BufferedIOBase) -> None:
        self.fh = fh
        self.sha256 = hashlib.sha256()

    def write(self, data: bytes | memoryview, /) -> int:
        self.sha256.update(data)
        return self.fh.write(data)


def write_entry(fh: _Writable, cid: int, entry: Mapping[str, torch.Tensor]) -> None:
    """Append `entry` as one record at `fh`'s position."""
    tensors = [(name, _raw(name, t)) for name, t in entry.items()]
    header = {
        "cid": cid,
        "tensors": [
            [name, str(t.dtype).removeprefix("torch."), list(t.shape), str(t.device)]
            for name, t in entry.items()
        ],
    }
    encoded = json.dumps(header).encode()
    fh.write(_LENGTH.pack(len(encoded)))
    fh.write(encoded)
    for _, raw in tensors:
        fh.write(raw.numpy().data)


def _raw(name: str, t: torch.Tensor) -> torch.Tensor:
    """`t`'s values as a flat CPU byte tensor."""
    if t.layout != torch.strided or t.is_quantized:
        raise TypeError(
            f"private tensor {name!r} has layout {t.layout}"
            f"{' (quantized)' if t.is_quantized else ''}: the client store keeps dense "
            "(strided, not quantized) tensors only"
        )
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def read_entry(fh: io.BufferedIOBase, where: Path) -> tuple[int, State]:
    """The record at `fh`'s position (`where` names the file in errors)."""
    header = _read_header(fh, where)
    entry: State = {}
    for name, dtype_name, shape, device in header["tensors"]:
        dtype = getattr(torch, dtype_name)
        n = torch.Size(shape).numel() * dtype.itemsize
        buf = bytearray(n)
        if fh.readinto(buf) != n:
            raise ValueError(f"{where} ends inside tensor {name!r} of client {header['cid']}")
        flat = torch.frombuffer(buf, dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
        entry[name] = flat.view(dtype).reshape(shape).to(device)
    return int(header["cid"]), entry


def _read_header(fh: io.BufferedIOBase, where: Path) -> dict:  # type: ignore[type-arg]
    length = fh.read(_LENGTH.size)
    if len(length) != _LENGTH.size:
        raise ValueError(f"{where} ends where a client entry's header should begin")
    header: dict = json.loads(fh.read(_LENGTH.unpack(length)[0]))  # type: ignore[type-arg]
    return header


def _skip_entry(fh: io.BufferedIOBase, where: Path) -> int:
    """The client id of the record at `fh`'s position; leaves `fh` after the record."""
    header = _read_header(fh, where)
    size = sum(
        torch.Size(shape).numel() * getattr(torch, dtype).itemsize
        for _, dtype, shape, _ in header["tensors"]
    )
    fh.seek(size, 1)
    return int(header["cid"])


def write_entries(path: Path, entries: Iterable[tuple[int, Mapping[str, torch.Tensor]]]) -> str:
    """Write `entries` one record after another into `path`, flushed to disk (a checkpoint
    names the file only after this returns); returns the file's SHA-256 (hex), which a
    checkpoint records to verify the file when it is read back."""
    with open(path, "wb") as fh:
        hashing = _Hashing(fh)
        for cid, entry in entries:
            write_entry(hashing, cid, entry)
        fh.flush()
        os.fsync(fh.fileno())
    return hashing.sha256.hexdigest()


def file_sha256(path: Path, chunk: int = 1 << 20) -> str:
    """The SHA-256 (hex) of `path`'s bytes, read a chunk at a time."""
    sha256 = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            sha256.update(block)
    return sha256.hexdigest()


class SpillSegment:
    """An append-only file of records with an index in memory: where the client store
    spills (`hetfl.engine.store`). A record that is replaced or discarded is dead; when the
    dead records outweigh the live ones (and pass `COMPACT_MIN` bytes), the live ones are
    copied, one at a time and without decoding, into a new file that replaces the old."""

    COMPACT_MIN = 1 << 20

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._fh: io.BufferedRandom | None = None
        self._where: dict[int, tuple[int, int]] = {}  # client id -> (offset, length)
        self._end = 0
        self._dead = 0

    def __contains__(self, cid: object) -> bool:
        return cid in self._where

    def nbytes(self) -> int:
        """The segment's size, dead records included."""
        return self._end

    def write(self, cid: int, entry: Mapping[str, torch.Tensor]) -> None:
        """Append `entry` as `cid`'s record (any older one becomes dead)."""
        self.discard(cid)
        fh = self._open()
        fh.seek(self._end)
        write_entry(fh, cid, entry)
        start, self._end = self._end, fh.tell()
        self._where[cid] = (start, self._end - start)
        live = self._end - self._dead
        if self._dead > max(live, self.COMPACT_MIN):
            self._compact()

    def read(self, cid: int) -> State:
        offset, _ = self._where[cid]
        fh = self._open()
        fh.seek(offset)
        return read_entry(fh, self.path)[1]

    def discard(self, cid: int) -> None:
        if cid in self._where:
            self._dead += self._where.pop(cid)[1]

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def _open(self) -> io.BufferedRandom:
        if self._fh is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.path, "w+b")  # noqa: SIM115 (held open until close)
        return self._fh

    def _compact(self) -> None:
        fh = self._open()
        fresh = self.path.with_name(self.path.name + ".compacting")
        where: dict[int, tuple[int, int]] = {}
        with open(fresh, "wb") as out:
            for cid, (offset, length) in sorted(self._where.items(), key=lambda kv: kv[1]):
                fh.seek(offset)
                where[cid] = (out.tell(), length)
                out.write(fh.read(length))
            end = out.tell()
        fh.close()
        os.replace(fresh, self.path)
        self._fh = open(self.path, "r+b")  # noqa: SIM115 (held open until close)
        self._where, self._end, self._dead = where, end, 0


class EntryFile(Entries):
    """A file of records (`write_entries`), read lazily: opening indexes where each
    client's record starts; an entry is read when asked for."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._offsets: dict[int, int] = {}
        end = self.path.stat().st_size
        with open(self.path, "rb") as fh:
            while fh.tell() < end:
                offset = fh.tell()
                self._offsets[_skip_entry(fh, self.path)] = offset
            if fh.tell() != end:
                raise ValueError(
                    f"{self.path} ends inside the entry of client {[*self._offsets][-1]}"
                )

    def __getitem__(self, cid: int) -> State:
        offset = self._offsets[cid]
        with open(self.path, "rb") as fh:
            fh.seek(offset)
            return read_entry(fh, self.path)[1]

    def __iter__(self) -> Iterator[int]:
        return iter(self._offsets)

    def __len__(self) -> int:
        return len(self._offsets)
