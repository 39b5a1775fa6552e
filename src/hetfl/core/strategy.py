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
   should return the state unchanged. In rounds where `server_program(round, tasks)`
   returned a program (split learning, `hetfl.core.server_program`), the engine ran one
   server session per client alongside its training and adds the keyword
   `server_results=` (the valid clients' `ServerResult`s, sorted by client id).
4. every k rounds, `eval_models(state)` names the models to test on the global test set,
   and `eval_task(info, evaluated)` the client-side evaluation of a client's model with its
   private layers on its local test split (`evaluated`: the models just tested, as tested,
   that is after any statistics pass, by name).

`state_dict` / `load_state_dict` carry the global state and whatever the strategy keeps
across rounds (server optimiser moments, tier histories), for checkpoints. A strategy takes
explicit constructor arguments and never sees the whole config or the engine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from hetfl.core.declared import DeclaredTensor, build_declared
from hetfl.core.init import build_model, initialize
from hetfl.core.server_program import ServerProgram
from hetfl.core.spec import IndexMap, Spec, local_names, ungrouped
from hetfl.core.state import extract
from hetfl.core.training import LocalTraining
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
        train: LocalTraining,
    ) -> None:
        """`train`: the run's local-training settings, with their lr schedule."""
        if clients_per_round < 1:
            raise ValueError(f"clients_per_round must be >= 1, got {clients_per_round}")
        if not isinstance(train, LocalTraining):
            raise TypeError(
                f"train must be a LocalTraining record (hetfl.core.training), got "
                f"{type(train).__name__}"
            )
        self.family = family
        self.clients_per_round = clients_per_round
        self.train = train
        self.global_state: State = {}
        self.specs: dict[int, Spec] = {}
        self._global_spec: Spec | None = None
        self._parameter_names: list[str] | None = None
        self.rounds: int | None = None
        self.planned: dict[int, ClientTask] = {}

    # -- set-up -----------------------------------------------------------------------
    def setup(
        self,
        clients: Sequence[ClientInfo],
        generator: torch.Generator,
        rounds: int | None = None,
    ) -> None:
        """Assign specs to all clients, derive the global spec, initialise the global state.

        `rounds` is the planned length of the run, for schedules by fraction of training.
        """
        self.rounds = rounds
        self.specs = {c.cid: self.spec_for(c) for c in clients}
        self._global_spec = self.family.global_spec(self.possible_specs())
        self.global_state = self.init_global_state(generator)

    def possible_specs(self) -> list[Spec]:
        """Every spec a client may train in some round (the global spec is derived from
        them). Default: the static assignment; per-round assignments override it."""
        return list(self.specs.values())

    def declared_tensors(self) -> list[DeclaredTensor]:
        """Global tensors that are not slices of the global model, built at their own shape
        (`hetfl.core.declared`). Default: the family's, from `family.declared_tensors(specs)`
        over `possible_specs()` when the family has that method; a strategy that adds its own
        (per-tier heads) extends this list."""
        declare = getattr(self.family, "declared_tensors", None)
        return list(declare(self.possible_specs())) if declare is not None else []

    def init_global_state(self, generator: torch.Generator) -> State:
        """The initial global state: the global model's tensors that some index map shares,
        then every declared tensor.

        Private layers never enter it, not even at initialisation. A group-qualified name
        (`"<group>/<name>"`, see `hetfl.core.spec.group_qualified`) starts as a copy of the
        global model's tensor `<name>`, so every group starts from the same weights, unless
        it is declared (`declared_tensors`): a declared tensor is drawn at its own shape from
        a generator derived from `generator`'s seed and its name, so the global model's
        draws are the same with or without declarations.
        """
        model = initialize(build_model(self.family, self.global_spec), generator)
        tensors = model.state_dict()
        declared = build_declared(self.declared_tensors(), generator)
        clash = sorted(set(declared) & set(tensors))
        if clash:
            raise ValueError(
                f"declared tensors {clash[:5]} are tensors of the global model already; "
                "declare only new names (e.g. group-qualified '<group>/<name>')"
            )
        shared = {
            e.global_name
            for spec in {*self.possible_specs(), self.global_spec}
            for e in self.index_map_for(spec)
        }
        copied = shared - set(declared)
        missing = sorted(n for n in copied if ungrouped(n) not in tensors)
        if missing:
            raise KeyError(
                f"index maps name tensors the global model lacks: {missing[:5]}; declare "
                "tensors of their own shape with declared_tensors()"
            )
        ordered = [n for n in tensors if n in copied] + sorted(copied - set(tensors))
        state = {n: tensors[ungrouped(n)].detach().clone() for n in ordered}
        state.update(declared)
        return state

    @property
    def global_spec(self) -> Spec:
        if self._global_spec is None:
            raise RuntimeError("strategy.setup(...) has not been called")
        return self._global_spec

    def parameter_names(self) -> list[str]:
        """Global tensors that are trainable parameters, as opposed to buffers (BatchNorm's
        running statistics and counters), which server optimisers leave to plain averaging.
        A declared tensor is what its `role` says."""
        if self._parameter_names is None:
            found: set[str] = set()
            for spec in {*self.specs.values(), self.global_spec}:
                params = dict(build_model(self.family, spec).named_parameters())
                found.update(e.global_name for e in self.index_map_for(spec) if e.local in params)
            roles = {d.name: d.role for d in self.declared_tensors()}
            found = {n for n in found if n not in roles}
            found.update(n for n, role in roles.items() if role == "parameter")
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

    def task_config(self, round: int, info: ClientInfo) -> LocalTraining:
        """Local training settings sent with the task, with this round's lr from the run's
        schedule (`LocalTraining.for_round`)."""
        return self.train.for_round(round, self.rounds)

    def spec_in_round(self, round: int, info: ClientInfo, rng: torch.Generator) -> Spec:
        """The spec a sampled client trains this round. Default: its static spec; FLANC's
        capacities, HeteroFL's dynamic rates and DTFL's tiers are drawn here."""
        return self.specs.get(info.cid) or self.spec_for(info)

    def index_map_in_round(self, round: int, info: ClientInfo, spec: Spec) -> IndexMap:
        """The map of one client's task: the spec's map, plus anything client-specific
        (HeteroFL's and FedFA's label-split masks)."""
        return self.index_map_for(spec)

    def plan(
        self, round: int, available: Sequence[ClientInfo], rng: torch.Generator
    ) -> list[ClientTask]:
        """Tasks for the sampled clients; each is remembered so that `aggregate` writes a
        result through exactly the map its client was given."""
        tasks = []
        for info in self.sample(round, available, rng):
            spec = self.spec_in_round(round, info, rng)
            imap = self.index_map_in_round(round, info, spec)
            tasks.append(
                ClientTask(
                    cid=info.cid,
                    spec=spec,
                    payload=extract(self.global_state, imap),
                    index_map=imap,
                    config=self.task_config(round, info),
                )
            )
        self.planned = {t.cid: t for t in tasks}
        return tasks

    def result_map(self, result: ClientResult) -> IndexMap:
        """The map a result is written through: the one its task was planned with."""
        task = self.planned.get(result.cid)
        if task is None:
            raise KeyError(f"client {result.cid} returned a result but was not planned this round")
        return task.index_map

    def aggregate(
        self, round: int, results: Sequence[ClientResult], failures: Sequence[Failure]
    ) -> State:
        raise NotImplementedError(f"{type(self).__name__} must implement aggregate")

    def server_program(self, round: int, tasks: Sequence[ClientTask]) -> ServerProgram | None:
        """The server side of this round's split learning, or None (no per-batch exchange).

        A strategy that overrides this needs an engine that runs server programs: see
        `needs_server_program`.
        """
        return None

    @property
    def needs_server_program(self) -> bool:
        """Whether this strategy has a server program, so engines that cannot run one (the
        Flower adapter) can refuse it up front rather than fail in the first batch."""
        return type(self).server_program is not Strategy.server_program

    # -- evaluation ---------------------------------------------------------------------
    def eval_models(self, state: State) -> list[EvalModel]:
        """The global model, when the shared state is a complete model; else nothing."""
        spec = self.global_spec
        imap = self.index_map_for(spec)
        names = set(build_model(self.family, spec).state_dict())
        if set(local_names(imap)) != names:
            return []
        return [EvalModel(name="global", spec=spec, tensors=extract(state, imap))]

    def eval_task(self, info: ClientInfo, evaluated: Mapping[str, State] | None = None) -> EvalTask:
        """How client `info` is judged on its local test split. `evaluated` holds this
        round's `eval_models` as the engine tested them (complete tensors after any
        statistics pass), by name; engines always pass it, so a method may judge clients
        with one of them (HeteroFL's full-rate model). Default: the client's own spec
        with the global tensors and its private layers."""
        spec = self.specs.get(info.cid) or self.spec_for(info)
        imap = self.index_map_for(spec)
        return EvalTask(
            cid=info.cid, spec=spec, payload=extract(self.global_state, imap), index_map=imap
        )

    def describe(self) -> dict[str, Any]:
        """What set-up decided that a reader of the run should see (JSON-serialisable),
        written to `summary.json` under "strategy": ScalableFL's per-group models and the
        parameter gap of its HeteroFL comparison. Default: nothing."""
        return {}

    def observe(self, round: int, row: Mapping[str, Any]) -> None:
        """Called after each evaluation with the metrics row (DTFL's plateau schedule);
        anything changed here must be part of `extra_state`."""
        return None

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
