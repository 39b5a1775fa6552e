"""Server programs: the server side of rounds with more than one exchange (split learning).

SplitFed returns a gradient to the client every batch; DTFL trains a server-side copy per
client on the client's activations without answering. Both are a *server program* that the
strategy provides (`Strategy.server_program(round, state, tasks)`, from its server side)
and the engine runs:

    engine: program = strategy.server_program(round, state, tasks)   (None: no server side)
    per task: session = program.open(task, private)   private = that client's kept server state
              client loop: parts call ctx.send(z, y) -> gradient or None, every batch
              result = session.close() -> ServerResult (tensors, passes, kept state)
    engine -> strategy.aggregate(round, state, TrainedRound(trained, failures, server_results))

The `Channel` is the client's end of that exchange. It copies what crosses it (the server
never shares autograd graphs or storage with the client, as over a network), counts the
bytes of activations and labels sent up and of gradients sent down, and measures the time
the server spent. Activations are never collected as one payload: they cross per batch.

`ServerProgram` and `ServerSession` are protocols: a method's server side is any object with
their methods. `ServerResult`, the plain data a session returns, is in `hetfl.core.types`.
`ServerProgram.parallel` declares how the two sides overlap in time, for the simulated
clock: True when the server trains while the client goes on (DTFL: the round takes the
longer of the two sides), False when the client waits for each answer (SplitFed: the sides
add up).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch

from hetfl.core.state import State, state_bytes
from hetfl.core.types import ClientTask, Problem, ServerResult


class ServerSession(Protocol):
    """One client's server side for one round."""

    def batch(self, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """Take one batch of activations `z` (a leaf copy) and labels `y`; return the
        gradient of the loss with respect to `z` (SplitFed) or None (DTFL)."""
        ...

    def close(self) -> ServerResult:
        """End the round: the trained server-side tensors and the passes run."""
        ...


class ServerProgram(Protocol):
    """Opens a session per client.

    `parallel` is True when the server side runs alongside the client's computation (DTFL,
    Eq. 5), False when the client waits for every answer (SplitFed)."""

    @property
    def parallel(self) -> bool: ...

    def open(self, task: ClientTask, private: State) -> ServerSession:
        """A session for `task`'s client; `private` is what the server kept for it (empty
        before its first round)."""
        ...


@dataclass(frozen=True)
class ChannelCounts:
    """What crossed one client's channel in a round: bytes of activations and labels sent
    up, of gradients sent down, and the seconds its server session spent answering. The
    engine charges them to the counters and the clock (even for a client that failed:
    they crossed)."""

    bytes_up: int = 0
    bytes_down: int = 0
    server_wall_s: float = 0.0


class Channel:
    """The client's end of the per-batch exchange with its server session.

    Parts reach it through `TrainContext.send`, from a recipe's forward, backward or
    trackers. The bytes of
    everything that crosses are counted here; the engine adds them to `bytes_up` and
    `bytes_down` and to the client's communication time.
    """

    def __init__(self, session: ServerSession) -> None:
        self.session = session
        self.bytes_up = 0
        self.bytes_down = 0
        self.batches = 0
        self.server_wall_s = 0.0

    def send(self, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """Send activations and labels; the server's answer (a gradient shaped like `z`,
        or None). Both directions are copies, detached from the sender's graph."""
        z_sent = z.detach().clone()
        y_sent = y.detach().clone()
        self.bytes_up += state_bytes({"z": z_sent, "y": y_sent})
        started = time.perf_counter()
        answer = self.session.batch(z_sent, y_sent)
        self.server_wall_s += time.perf_counter() - started
        self.batches += 1
        if answer is None:
            return None
        if answer.shape != z.shape:
            raise ValueError(
                f"server answered a gradient of shape {tuple(answer.shape)} to activations "
                f"of shape {tuple(z.shape)}"
            )
        received = answer.detach().clone()
        self.bytes_down += state_bytes({"g": received})
        return received

    def counts(self) -> ChannelCounts:
        """What has crossed so far, as a plain record."""
        return ChannelCounts(self.bytes_up, self.bytes_down, self.server_wall_s)


def server_result_problem(result: ServerResult, cid: int) -> Problem | None:
    """Why a server side's result cannot be aggregated (a diverged server copy), or None."""
    if result.cid != cid:
        return Problem(
            "invalid", f"server result is for client {result.cid}, the session was for client {cid}"
        )
    bad = [k for k, v in result.tensors.items() if v.is_floating_point() and not v.isfinite().all()]
    if bad:
        return Problem("non-finite", f"server side: tensors {bad} have non-finite values")
    return None
