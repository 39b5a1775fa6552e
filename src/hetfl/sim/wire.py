"""How the process executor moves values between processes: a pickle and one flat buffer.

Pickling a structure of tensors with `multiprocessing`'s own pickler sends each tensor as
its own shared-memory segment and file descriptor; a client result of a few hundred small
tensors, times the clients of a round, exhausts the descriptors a process may hold. Here a
message is instead a plain pickle in which every tensor is replaced by a reference
(pickle's persistent ids), followed by one flat byte buffer holding the referenced
tensors' bytes: two pipe writes per message, whatever the number of tensors.

A reference is one of three kinds:

- into the message's own buffer (the tensor's bytes, each at a 64-byte aligned offset;
  the receiver copies each out into a tensor of its own);
- into a `SharedBuffer`, the run's data (clients' samples, test and validation sets) placed
  once in shared memory that every worker maps: a view of it travels as its offset, shape
  and stride, and no byte of data is copied;
- to a tensor the same `Sender` already sent to this receiver in the same exchange (the
  round's global weights in every client's task): sent once per worker per exchange.

Values arrive exact: the bytes are the tensor's, whatever its dtype. A plain tensor
arrives detached from autograd; an `nn.Parameter` pickles as its class does, around its
data (so a module's parameters stay parameters).
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

#: Every tensor's bytes start at a multiple of this in a message's buffer.
ALIGN = 64
#: A view of the shared block: (element offset, dtype, shape, stride).
_SharedRef = tuple[int, torch.dtype, tuple[int, ...], tuple[int, ...]]


class SharedBuffer:
    """One block of shared memory holding many tensors: `place(value)` returns a copy of a
    structure whose tensors are views of the block (what the parent keeps and what travels
    by reference), and the block itself is sent to each worker once."""

    def __init__(self, storage: torch.Tensor) -> None:
        self.block = storage  # a 1-d uint8 tensor in shared memory
        self._base = storage.untyped_storage().data_ptr()

    @classmethod
    def place(cls, value: Any) -> tuple[SharedBuffer, Any]:
        """A new shared block holding every tensor of `value`, and `value` rebuilt with
        views of the block in place of its tensors."""
        tensors: list[torch.Tensor] = []
        meta = _Collect(tensors).dumps(value)
        offsets, total = _layout(tensors)
        block = torch.empty(max(total, 1), dtype=torch.uint8).share_memory_()
        for t, off in zip(tensors, offsets, strict=True):
            block[off : off + _nbytes(t)] = _bytes_of(t)
        placed = [_view(block, off, *_meta(t)) for t, off in zip(tensors, offsets, strict=True)]
        return cls(block), _Rebuild(meta, placed.__getitem__).load()

    def ref(
        self, t: torch.Tensor
    ) -> tuple[int, torch.dtype, tuple[int, ...], tuple[int, ...]] | None:
        """(element offset, dtype, shape, stride) of `t` when it is a view of this block."""
        if t.device.type != "cpu" or t.untyped_storage().data_ptr() != self._base:
            return None
        return int(t.storage_offset()), t.dtype, tuple(t.shape), tuple(t.stride())

    def view(
        self, offset: int, dtype: torch.dtype, shape: tuple[int, ...], stride: tuple[int, ...]
    ) -> torch.Tensor:
        return torch.empty(0, dtype=dtype).set_(self.block.untyped_storage(), offset, shape, stride)


@dataclass
class Sender:
    """One side's end of a pipe: remembers which tensors it already sent in the current
    exchange (`reset()` starts the next one) so that a repeated tensor travels once."""

    conn: Connection
    shared: SharedBuffer | None = None

    def __post_init__(self) -> None:
        self._sent: dict[int, int] = {}
        self._keep: list[torch.Tensor] = []  # keeps ids valid while they are remembered

    def reset(self) -> None:
        self._sent, self._keep = {}, []

    def send(self, value: Any) -> None:
        fresh: list[torch.Tensor] = []
        pickler = _Refer(self, fresh)
        payload = pickler.dumps(value)
        offsets, total = _layout(fresh)
        buffer = bytearray(total)
        flat = torch.frombuffer(buffer, dtype=torch.uint8) if total else None
        for t, off in zip(fresh, offsets, strict=True):
            assert flat is not None
            flat[off : off + _nbytes(t)] = _bytes_of(t)
        header = pickle.dumps((payload, [_meta(t) for t in fresh], offsets, total))
        self.conn.send_bytes(header)
        self.conn.send_bytes(buffer)


class Receiver:
    """The other end: rebuilds each message, keeping what the sender may refer to again
    within the exchange."""

    def __init__(self, conn: Connection, shared: SharedBuffer | None = None) -> None:
        self.conn = conn
        self.shared = shared
        self.seen: dict[int, torch.Tensor] = {}

    def reset(self) -> None:
        self.seen = {}

    def recv(self) -> Any:
        payload, metas, offsets, total = pickle.loads(self.conn.recv_bytes())
        buffer = bytearray(total)
        if total:
            self.conn.recv_bytes_into(buffer)
        else:
            self.conn.recv_bytes()
        # Each tensor is copied out of the buffer into its own storage: some of torch's
        # functions (Generator.set_state) misread a tensor at a storage offset.
        flat = torch.frombuffer(buffer, dtype=torch.uint8) if total else None
        fresh = [
            _view(flat, off, *meta).clone()  # type: ignore[arg-type]
            for meta, off in zip(metas, offsets, strict=True)
        ]
        return _Rebuild(payload, fresh.__getitem__, self).load()


# -- pickling with references ----------------------------------------------------------------
class _Collect(pickle.Pickler):
    """Pickles `value` with every tensor replaced by its index in `tensors`."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._file = io.BytesIO()
        super().__init__(self._file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors = tensors

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) is torch.Tensor:  # a Parameter pickles as its class does, around its data
            self.tensors.append(_dense(obj.detach().to("cpu")))
            return ("new", len(self.tensors) - 1)
        return None

    def dumps(self, value: Any) -> bytes:
        self.dump(value)
        return self._file.getvalue()


class _Refer(_Collect):
    """A `Sender`'s pickler: shared views and tensors already sent become references."""

    def __init__(self, sender: Sender, fresh: list[torch.Tensor]) -> None:
        super().__init__(fresh)
        self.sender = sender

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) is not torch.Tensor:
            return None
        s = self.sender
        if s.shared is not None and (where := s.shared.ref(obj)) is not None:
            return ("shared", *where)
        key = s._sent.get(id(obj))
        if key is not None:
            return ("seen", key)
        new = super().persistent_id(obj)
        key = len(s._sent)
        s._sent[id(obj)] = key
        s._keep.append(obj)
        return (*new, key)


class _Rebuild(pickle.Unpickler):
    def __init__(self, payload: bytes, fresh: Any, receiver: Receiver | None = None) -> None:
        super().__init__(io.BytesIO(payload))
        self.fresh = fresh
        self.receiver = receiver

    def persistent_load(self, pid: Any) -> Any:
        kind = pid[0]
        if kind == "new":
            t = self.fresh(pid[1])
            if self.receiver is not None and len(pid) == 3:
                self.receiver.seen[pid[2]] = t
            return t
        assert self.receiver is not None, f"reference {kind!r} outside a pipe"
        if kind == "seen":
            return self.receiver.seen[pid[1]]
        if kind == "shared":
            assert self.receiver.shared is not None, "a shared view arrived before the block"
            return self.receiver.shared.view(*pid[1:])
        raise pickle.UnpicklingError(f"unknown tensor reference {pid!r}")


# -- bytes ------------------------------------------------------------------------------------
def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _is_dense(t: torch.Tensor) -> bool:
    """Whether `t`'s elements fill exactly `numel` consecutive slots of its storage, in
    some order of its dimensions (a contiguous or channels-last tensor, not a slice)."""
    expected = 1
    for size, stride in sorted((d, s) for d, s in zip(t.shape, t.stride(), strict=True) if d != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _dense(t: torch.Tensor) -> torch.Tensor:
    """`t` itself when dense, else a dense copy in its layout's order. The layout travels
    with the values: some kernels (oneDNN's convolutions) round differently on a
    channels-last input, so a tensor must arrive with the strides it left with."""
    return t if _is_dense(t) else t.clone(memory_format=torch.preserve_format)


def _meta(t: torch.Tensor) -> tuple[torch.dtype, tuple[int, ...], tuple[int, ...]]:
    return t.dtype, tuple(t.shape), tuple(t.stride())


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A dense `t`'s memory, in memory order, as a flat uint8 tensor."""
    if not t.numel():
        return torch.empty(0, dtype=torch.uint8)
    return t.as_strided((t.numel(),), (1,), t.storage_offset()).view(torch.uint8)


def _layout(tensors: Iterable[torch.Tensor]) -> tuple[list[int], int]:
    """Each tensor's aligned byte offset in one buffer, and the buffer's size."""
    offsets, end = [], 0
    for t in tensors:
        start = -(-end // ALIGN) * ALIGN
        offsets.append(start)
        end = start + _nbytes(t)
    return offsets, end


def _view(
    flat: torch.Tensor, offset: int, dtype: torch.dtype, shape: Any, stride: Any
) -> torch.Tensor:
    """A tensor of `dtype`, `shape` and `stride` over `flat`'s bytes from `offset` (no
    copy; `flat` is uint8, so its element offset is a byte offset)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    start = (flat.storage_offset() + offset) // itemsize
    return torch.empty(0, dtype=dtype).set_(
        flat.untyped_storage(), start, list(shape), list(stride)
    )
