"""Random generators derived from (seed, round, client id, purpose).

No HetFL code touches the global RNG. Every draw (client sampling, batch order, dropout
widths, Rademacher signs, partitions, profile switches) takes a generator derived here, so a
round's result does not depend on the order clients run in, on batching clients together,
or on where a run was resumed. Derivation hashes the four parts, so neighbouring seeds or
rounds give unrelated streams.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

#: The client id used for server-side draws (sampling, initialisation).
SERVER = -1


def derive_seed(seed: int, round: int, client: int, purpose: str) -> int:
    """A 63-bit seed unique to (seed, round, client, purpose)."""
    key = f"{int(seed)}|{int(round)}|{int(client)}|{purpose}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1


def torch_generator(
    seed: int, round: int, client: int, purpose: str, device: str | torch.device = "cpu"
) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(derive_seed(seed, round, client, purpose))
    return g


def numpy_generator(seed: int, round: int, client: int, purpose: str) -> np.random.Generator:
    return np.random.default_rng(derive_seed(seed, round, client, purpose))


def sibling_generator(
    parent: torch.Generator, purpose: str, device: str | torch.device = "cpu"
) -> torch.Generator:
    """A generator of its own `purpose` derived from `parent`'s seed, not from its stream:
    drawing from one never shifts the other. A client's training generator is derived from
    (seed, round, client, "train"), so its siblings are unique per (seed, round, client)
    too (the dropout masks of `hetfl.core.client.dropout`)."""
    return torch_generator(parent.initial_seed(), 0, 0, purpose, device)
