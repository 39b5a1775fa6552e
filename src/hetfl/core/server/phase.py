"""A round's server phase: the server's own work once every client of the round has finished.

Split learning's server programs (`hetfl.core.server_program`) work per client and per
batch, while the client trains. Some methods instead need the server to see all of a
round's uploads at once: FedGKT (He, Annavaram and Avestimehr, "Group Knowledge Transfer:
Federated Learning of Large CNNs at the Edge", NeurIPS 2020, §3, Algorithm 1) trains its
large server model over every client's uploaded features for several epochs, then answers
each client with per-sample logits. The strategy provides such a phase as a part
(`Strategy(extras=Extras(server_phase=...))`) and the engine runs it:

    plan:    each task declares the uploads its client must send (`uploads(info, spec)`,
             `ClientTask.uploads`: names and shapes) and carries the client's pending
             download, if any (`ClientTask.download`, counted in `bytes_down` then)
    clients: train; each sends `ClientResult.uploads` (counted in `bytes_up`, checked
             against the declaration: a bad upload fails that client, not the run)
    engine:  state, defence, beyond = strategy.aggregate(...)
             phase = run(round, state, uploads of the valid clients in client-id order,
                         generator (seed, round, SERVER, "server-phase"))
             -> PhaseResult(new state, downloads by client, passes, input shape)
             downloads are held in the engine's pending-download store (checkpointed,
             spilled under the store's memory budget) until each client's next task;
             passes are priced by the cost model and run after the clients on the clock.

The simulator runs the phase in its own process (the parent, never a worker of the
process executor) at the run's thread count, so that its result does not depend on the
executor. A phase that keeps state across rounds (its optimiser's moments) has
`extra_state` / `load_extra_state`: it is then part of the strategy's extra state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from hetfl.core.spec import Spec
from hetfl.core.state import State
from hetfl.core.types import ClientInfo, PassRecord


@dataclass(frozen=True)
class Upload:
    """One valid client's upload this round: its declared non-parameter tensors and its
    training-set size."""

    cid: int
    tensors: State
    num_examples: int


@dataclass
class PhaseResult:
    """What a server phase produced: the new global `state`; `downloads`, per client, the
    tensors to deliver with its next task; the `passes` the server ran, priced over inputs
    of `input_shape` (one sample, without the batch dimension); scalar `metrics`."""

    state: State
    downloads: dict[int, State] = field(default_factory=dict)
    passes: list[PassRecord] = field(default_factory=list)
    input_shape: tuple[int, ...] = ()
    metrics: dict[str, float] = field(default_factory=dict)


class ServerPhase(Protocol):
    """A strategy's round-level server work (see the module docstring)."""

    def uploads(self, info: ClientInfo, spec: Spec) -> Mapping[str, tuple[int, ...]]:
        """The non-parameter tensors client `info` training `spec` must upload, by name,
        with their shapes."""
        ...

    def run(
        self,
        round: int,
        state: Mapping[str, torch.Tensor],
        uploads: Sequence[Upload],
        generator: torch.Generator,
    ) -> PhaseResult:
        """The round's server work on every valid upload (client-id order); called in
        every round, also when `uploads` is empty (then it returns the state unchanged)."""
        ...
