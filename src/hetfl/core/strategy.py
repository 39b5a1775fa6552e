"""The strategy protocol: whom to ask, what to send, how to combine, what to evaluate.

A method is a `Strategy` subclass (server side) plus, when it changes local training,
`ClientHooks` (client side, `hetfl.core.client`). Engines (the simulator, the Flower
adapter) call only these verbs, in this order, every round:

1. `plan(round, available, rng)` -> tasks. `available` holds the clients the engine can
   reach this round, sorted by id; an empty list of tasks skips the round's training.
2. the engine runs each task's client program and validates its result against the task's
   index map (names, shapes, finiteness); invalid results and clients that raised become
   `Failure`s.
3. `aggregate(round, results, failures)` -> the new global state, which the engine stores in
   `global_state`. `results` holds every valid result at once, sorted by client id, so
   norms across clients and robust rules are possible. With no results, a strategy
   should return the state unchanged.
4. every k rounds, `eval_models(state)` names the models to test on the global test set,
   and `eval_task(info)` the client-side evaluation of a client's model with its private
   layers on its local test split.

`state_dict` / `load_state_dict` carry the global state and whatever the strategy keeps
across rounds (server optimiser moments, tier histories), for checkpoints. A strategy takes
explicit constructor arguments and never sees the whole config or the engine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from hetfl.core.init import build_model, initialize
from hetfl.core.spec import IndexMap, Spec, local_names
from hetfl.core.state import extract
from hetfl.core.types import (
    ClientInfo,
    ClientResult,
    ClientTask,
    EvalModel,
    EvalTask,
    Failure,
    ModelFamily,
    State,
)


def uniform_sample(
    available: Sequence[ClientInfo], k: int, rng: torch.Generator
) -> list[ClientInfo]:
    """`min(k, len(available))` clients drawn uniformly without replacement, sorted by id."""
    pool = sorted(available, key=lambda c: c.cid)
    if k >= len(pool):
        return pool
    chosen = torch.randperm(len(pool), generator=rng)[:k].tolist()
    return [pool[i] for i in sorted(chosen)]


class Strategy:
    """Base strategy: uniform sampling, one spec for everyone, identity index maps.

    Subclasses implement `aggregate` and override what their method changes: `spec_for`
    (heterogeneous sub-models), `index_map_for` (private layers, slicing), `task_config`
    (per-client settings), `eval_models`, `eval_task`, `extra_state`.
    """

    #: Registry name; set by each method module.
    name: str = "base"

    def __init__(
        self,
        family: ModelFamily,
        *,
        clients_per_round: int,
        train: Mapping[str, Any],
    ) -> None:
        if clients_per_round < 1:
            raise ValueError(f"clients_per_round must be >= 1, got {clients_per_round}")
        self.family = family
        self.clients_per_round = clients_per_round
        self.train = dict(train)
        self.global_state: State = {}
        self.specs: dict[int, Spec] = {}
        self._global_spec: Spec | None = None
        self._parameter_names: list[str] | None = None

    # -- set-up -----------------------------------------------------------------------
    def setup(self, clients: Sequence[ClientInfo], generator: torch.Generator) -> None:
        """Assign specs to all clients, derive the global spec, initialise the global state.

        The global state holds only tensors some index map shares: private layers never
        enter it, not even at initialisation.
        """
        self.specs = {c.cid: self.spec_for(c) for c in clients}
        self._global_spec = self.family.global_spec(list(self.specs.values()))
        model = initialize(build_model(self.family, self._global_spec), generator)
        shared = {
            e.global_name
            for spec in {*self.specs.values(), self._global_spec}
            for e in self.index_map_for(spec)
        }
        self.global_state = {
            k: v.detach().clone() for k, v in model.state_dict().items() if k in shared
        }

    @property
    def global_spec(self) -> Spec:
        if self._global_spec is None:
            raise RuntimeError("strategy.setup(...) has not been called")
        return self._global_spec

    def parameter_names(self) -> list[str]:
        """Global tensors that are trainable parameters, as opposed to buffers (BatchNorm's
        running statistics and counters), which server optimisers leave to plain averaging."""
        if self._parameter_names is None:
            found: set[str] = set()
            for spec in {*self.specs.values(), self.global_spec}:
                params = dict(build_model(self.family, spec).named_parameters())
                found.update(e.global_name for e in self.index_map_for(spec) if e.local in params)
            self._parameter_names = [k for k in self.global_state if k in found]
        return self._parameter_names

    def spec_for(self, info: ClientInfo) -> Spec:
        """The spec of a client's local model. Default: the family's one spec."""
        return self.family.global_spec([])

    def index_map_for(self, spec: Spec) -> IndexMap:
        """Which local tensors are shared, and where they sit in the global state."""
        return self.family.index_map(spec)

    # -- round verbs --------------------------------------------------------------------
    def sample(
        self, round: int, available: Sequence[ClientInfo], rng: torch.Generator
    ) -> list[ClientInfo]:
        return uniform_sample(available, self.clients_per_round, rng)

    def task_config(self, round: int, info: ClientInfo) -> dict[str, Any]:
        """Local training settings sent with the task (see `hetfl.core.client.LocalTraining`)."""
        return dict(self.train)

    def plan(
        self, round: int, available: Sequence[ClientInfo], rng: torch.Generator
    ) -> list[ClientTask]:
        tasks = []
        for info in self.sample(round, available, rng):
            spec = self.specs.get(info.cid) or self.spec_for(info)
            imap = self.index_map_for(spec)
            tasks.append(
                ClientTask(
                    cid=info.cid,
                    spec=spec,
                    payload=extract(self.global_state, imap),
                    index_map=imap,
                    config=self.task_config(round, info),
                )
            )
        return tasks

    def aggregate(
        self, round: int, results: Sequence[ClientResult], failures: Sequence[Failure]
    ) -> State:
        raise NotImplementedError(f"{type(self).__name__} must implement aggregate")

    # -- evaluation ---------------------------------------------------------------------
    def eval_models(self, state: State) -> list[EvalModel]:
        """The global model, when the shared state is a complete model; else nothing."""
        spec = self.global_spec
        imap = self.index_map_for(spec)
        names = set(build_model(self.family, spec).state_dict())
        if set(local_names(imap)) != names:
            return []
        return [EvalModel(name="global", spec=spec, tensors=extract(state, imap))]

    def eval_task(self, info: ClientInfo) -> EvalTask:
        spec = self.specs.get(info.cid) or self.spec_for(info)
        imap = self.index_map_for(spec)
        return EvalTask(
            cid=info.cid, spec=spec, payload=extract(self.global_state, imap), index_map=imap
        )

    # -- checkpoints --------------------------------------------------------------------
    def extra_state(self) -> dict[str, Any]:
        """Strategy-specific state kept across rounds (override with `load_extra_state`)."""
        return {}

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"global": dict(self.global_state), "extra": self.extra_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.global_state = dict(state["global"])
        self.load_extra_state(state.get("extra", {}))
