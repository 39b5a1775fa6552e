"""Per-client server copies: the server side of split learning as SplitFed and DTFL run it.

Both keep on the server one copy of the server-side model per client, started each round
from the global state and trained on the activations that client sends every batch, with
cross-entropy against its labels: SplitFed's main server (Thapa et al., "SplitFed: When
Federated Learning Meets Split Learning", AAAI 2022, §3, Algorithm 1, SFLV1) and DTFL's
server ("Speed up Federated Learning in Heterogeneous Environment: A Dynamic Tiering
Approach", §3.2, Algorithm 1 lines 5-8). They differ in what the server answers: SplitFed
returns the activations' gradient, for which its client waits; DTFL returns nothing, and
its client trains on its own auxiliary loss.

`CopiesSide` is the strategy's server side (`hetfl.core.server.strategy.ServerSide`):

- `program(round, state, tasks)`: `ServerCopies` on the round's global state;
- `ServerCopies.open(task, private)`: the copy of `server_spec(task.spec)` (a function of
  the client's spec: the same tier's server side), built from the state through the
  family's map of that spec, whose entries must be whole tensors; its optimiser is the
  task's own local settings (`LocalTraining`: the optimiser, this round's lr, betas,
  weight decay, and `clip_grad_norm` on the server side's gradient alone), fresh each
  round, or with `keep_momentum` kept per client in `ServerResult.private`, as the client
  keeps its own; with `fresh_optimiser="batch"` it starts afresh before every batch, as
  DTFL's code re-creates its server's optimiser (mahmoudsajjadi/DTFL `main.py`,
  `train_server`);
- `CopySession.batch(z, y)`: the copy's forward, the batch's mean cross-entropy, the
  backward and the optimiser's step; the answer is ∂loss/∂z (`answers`) or None;
- `CopySession.close()`: the copy's tensors under their global names (so `index_map` is
  the identity over them), its passes (`train+input` when it answers, else `train`), the
  shape of one activation, and its mean training loss in `metrics` under `"loss"` when
  the loss is the client's (`client_loss`: SplitFed's client has no head, so the engine
  reports the server's loss as its training loss) or under `"server_loss"` otherwise.

The copy is trained by the trainable step a client's loop takes
(`hetfl.core.client.trainable`: plain dicts through `torch.func.functional_call`, the same
functional optimiser and clipping), so that a client side and its server copy stepped
apart equal the joined model stepped whole.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from hetfl.core.client.trainable import Trainable
from hetfl.core.spec import IndexMap, Spec, full_map
from hetfl.core.state import extract
from hetfl.core.types import ClientTask, ModelFamily, PassRecord, ServerResult, State

#: When a copy's optimiser state starts afresh: each round, or before each batch.
FreshOptimiser = Literal["round", "batch"]


@dataclass(frozen=True)
class CopiesSide:
    """The server side of a strategy whose server trains a copy per client (see the module
    docstring). `server_spec` must pickle (a module-level function or a family's bound
    method): the process executor sends the round's program to its workers."""

    family: ModelFamily
    server_spec: Callable[[Spec], Spec]
    answers: bool
    parallel: bool
    client_loss: bool = False
    fresh_optimiser: FreshOptimiser = "round"

    def __post_init__(self) -> None:
        if self.fresh_optimiser not in ("round", "batch"):
            raise ValueError(
                f"fresh_optimiser must be 'round' or 'batch', got {self.fresh_optimiser!r}"
            )

    def program(
        self, round: int, state: Mapping[str, torch.Tensor], tasks: Sequence[ClientTask]
    ) -> ServerCopies:
        return ServerCopies(self, dict(state))

    def index_map(self, served: ServerResult) -> IndexMap:
        return full_map(served.tensors)


@dataclass(frozen=True)
class ServerCopies:
    """One round's server program: a `CopySession` per client, from the round's state."""

    side: CopiesSide
    state: State

    @property
    def parallel(self) -> bool:
        return self.side.parallel

    def open(self, task: ClientTask, private: State) -> CopySession:
        spec = self.side.server_spec(task.spec)
        imap = self.side.family.index_map(spec)
        partial = [e.local for e in imap if e.index != () or e.mask is not None]
        if partial:
            raise ValueError(
                f"server copies are built from whole global tensors, but the map of {spec} "
                f"slices or masks {partial[:3]}"
            )
        return CopySession(self.side, task, spec, imap, extract(self.state, imap), private)


class CopySession:
    """One client's server copy for one round."""

    def __init__(
        self,
        side: CopiesSide,
        task: ClientTask,
        spec: Spec,
        imap: IndexMap,
        tensors: State,
        private: State,
    ) -> None:
        self.side, self.cid, self.spec, self.imap = side, task.cid, spec, imap
        self.keep = task.config.keep_momentum
        kept = private if self.keep else {}
        self.copy = Trainable.of(side.family, spec, tensors, task.config, kept)
        self.batches: dict[int, int] = {}  # batch size -> batches of that size
        self.loss_sum, self.seen = 0.0, 0
        self.input_shape: tuple[int, ...] = ()

    def batch(self, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        z.requires_grad_(self.side.answers)
        loss = F.cross_entropy(self.copy.model(z), y)
        if self.side.fresh_optimiser == "batch":
            self.copy.state.clear()
        self.copy.train(loss)
        b = int(y.shape[0])
        self.batches[b] = self.batches.get(b, 0) + 1
        self.loss_sum += float(loss.detach()) * b
        self.seen += b
        self.input_shape = tuple(z.shape[1:])
        return z.grad if self.side.answers else None

    def close(self) -> ServerResult:
        local = self.copy.tensors()
        tensors = {e.global_name: local[e.local] for e in self.imap}
        kind = "train+input" if self.side.answers else "train"
        passes = [PassRecord(self.spec, kind, b, n) for b, n in self.batches.items()]
        kept = self.copy.kept() if self.keep else {}
        loss = "loss" if self.side.client_loss else "server_loss"
        metrics = {loss: self.loss_sum / max(self.seen, 1)}
        return ServerResult(self.cid, tensors, passes, self.input_shape, kept, metrics)
