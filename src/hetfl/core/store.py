"""The client store: what each client keeps between rounds and never sends.

Private layers (FedBN's BatchNorm, FedPer's head, ScalableFL's both), a client's own model
in local-only training, and optimiser state that a method keeps across rounds live here,
keyed by client id. An entry is created on a client's first participation. The store
serialises into checkpoints; nothing in it is ever counted in bytes.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

State = dict[str, torch.Tensor]


class ClientStore:
    def __init__(self) -> None:
        self._entries: dict[int, State] = {}

    def get(self, cid: int) -> State:
        """The client's private tensors (empty before its first participation)."""
        return self._entries.get(cid, {})

    def put(self, cid: int, private: Mapping[str, torch.Tensor]) -> None:
        self._entries[cid] = {k: v.detach().clone() for k, v in private.items()}

    def __contains__(self, cid: object) -> bool:
        return cid in self._entries

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for e in self._entries.values() for t in e.values())

    def state_dict(self) -> dict[int, State]:
        return {cid: dict(e) for cid, e in self._entries.items()}

    def load_state_dict(self, state: Mapping[int, Mapping[str, torch.Tensor]]) -> None:
        self._entries = {int(cid): dict(e) for cid, e in state.items()}
