"""A server side that trains one copy per client of the model's server part, on the
activations that client sends (split learning, `hetfl.core.server_program`).

DTFL ("Speed up Federated Learning in Heterogeneous Environment: A Dynamic Tiering
Approach", Algorithm 1 lines 4-8, §3.2) keeps one server-side model per client, starts it
from the global model each round, and trains it with cross-entropy on the client's
activations and labels, in parallel with the client and without answering (the client
learns from its own head). SplitFed (Thapa et al., AAAI 2022) trains the same copies but
answers every batch with the activations' gradient and the client waits: `answer=True`.

The copy of a client whose task has spec s is the family's model of `server_spec(s)`,
loaded from the round's global state through that spec's index map, and its trained
tensors (parameters and BatchNorm buffers) go back into aggregation through the same map,
with its client's weight. The optimiser is the task's own settings (optimiser, lr of the
round, weight decay: the same on both sides, DTFL App. A.3), run by the client's functional
optimisers (`hetfl.core.local.optim`); its state starts afresh each round, or, with
`fresh_optimiser="batch"`, before every batch, as the authors' code re-creates the server's
optimiser per batch (`main.py`, `train_server`). Each batch records one training pass of
the server spec over the activation's shape, which the engine prices for the clock.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import torch
import torch.nn.functional as F

from hetfl.core.init import build_model
from hetfl.core.local.optim import optimiser_for, param_groups
from hetfl.core.server_program import ServerSession
from hetfl.core.spec import IndexMap, Spec
from hetfl.core.state import State, extract
from hetfl.core.types import ClientTask, ModelFamily, PassRecord, ServerResult

#: When a copy's optimiser state starts afresh: each round (HetFL's default) or each batch.
FreshOptimiser = Literal["round", "batch"]


class CopySession:
    """One client's server copy for one round (a `ServerSession`)."""

    def __init__(
        self,
        family: ModelFamily,
        task: ClientTask,
        spec: Spec,
        payload: State,
        *,
        answer: bool,
        fresh_optimiser: FreshOptimiser,
    ) -> None:
        self.cid, self.spec, self.answer = task.cid, spec, answer
        self.fresh_optimiser = fresh_optimiser
        device = next(iter(payload.values())).device  # the global state's
        self.model = build_model(family, spec).to(device)
        self.model.load_state_dict(payload, strict=True)
        self.model.train()
        self.params = dict(self.model.named_parameters())
        self.optimiser = optimiser_for(task.config)
        self.groups = param_groups(self.model, list(self.params), task.config)
        self.state: dict[str, torch.Tensor] = {}
        self.passes: list[PassRecord] = []
        self.input_shape: tuple[int, ...] = ()

    def batch(self, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """One step of the copy on (z (B, ...), y (B,)); the gradient of its loss with
        respect to z when it answers, else None."""
        z.requires_grad_(self.answer)
        loss = F.cross_entropy(self.model(z), y)
        for p in self.params.values():
            p.grad = None
        loss.backward()
        if self.fresh_optimiser == "batch":
            self.state = {}
        grads = {k: p.grad for k, p in self.params.items() if p.grad is not None}
        with torch.no_grad():
            self.optimiser.step(self.groups, self.params, grads, self.state)
        kind = "train+input" if self.answer else "train"
        self.passes.append(PassRecord(self.spec, kind, int(y.shape[0]), 1))
        self.input_shape = tuple(z.shape[1:])
        return z.grad if self.answer else None

    def close(self) -> ServerResult:
        tensors = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        return ServerResult(self.cid, tensors, self.passes, self.input_shape)


class CopyProgram:
    """The round's server program: a fresh copy per client from the round's global state."""

    def __init__(
        self,
        family: ModelFamily,
        state: Mapping[str, torch.Tensor],
        specs: Mapping[int, Spec],
        *,
        parallel: bool,
        fresh_optimiser: FreshOptimiser,
    ) -> None:
        self.family, self.state, self.specs = family, state, specs
        self.parallel, self.fresh_optimiser = parallel, fresh_optimiser

    def open(self, task: ClientTask, private: State) -> ServerSession:
        spec = self.specs[task.cid]
        payload = extract(self.state, self.family.index_map(spec))
        return CopySession(
            self.family,
            task,
            spec,
            payload,
            answer=not self.parallel,
            fresh_optimiser=self.fresh_optimiser,
        )


class ServerCopies:
    """The server side of a split strategy (`hetfl.core.strategy.ServerSide`): per round a
    `CopyProgram` over the tasks' server specs (`server_spec(task.spec)`), and each
    session's tensors placed through its spec's index map. `parallel` is DTFL's (the
    sides overlap, Eq. 5; no answer), not SplitFed's (the client waits for the gradient).

    The round's server specs, by client, are kept from `program` to `index_map` within the
    round (a checkpoint falls between rounds, never inside one)."""

    def __init__(
        self,
        family: ModelFamily,
        server_spec: Callable[[Spec], Spec],
        *,
        parallel: bool,
        fresh_optimiser: FreshOptimiser = "round",
    ) -> None:
        if fresh_optimiser not in ("round", "batch"):
            raise ValueError(f"fresh_optimiser must be 'round' or 'batch', got {fresh_optimiser!r}")
        self.family, self.server_spec = family, server_spec
        self.parallel, self.fresh_optimiser = parallel, fresh_optimiser
        self.specs: dict[int, Spec] = {}

    def program(
        self, round: int, state: Mapping[str, torch.Tensor], tasks: Sequence[ClientTask]
    ) -> CopyProgram:
        self.specs = {t.cid: self.server_spec(t.spec) for t in tasks}
        return CopyProgram(
            self.family,
            state,
            self.specs,
            parallel=self.parallel,
            fresh_optimiser=self.fresh_optimiser,
        )

    def index_map(self, served: ServerResult) -> IndexMap:
        return self.family.index_map(self.specs[served.cid])
