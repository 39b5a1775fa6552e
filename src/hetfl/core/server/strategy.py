"""One job: the strategy, whom to ask, what to send, how to combine, what to evaluate — one
final class composed from parts.

A method is a `Strategy` built from parts (the server's half) plus a `LocalRecipe` (the
clients' half, `hetfl.core.client.recipe`: forward, loss terms, gradient transforms,
projections, trackers, backward; the optimiser comes from the `LocalTraining` settings).
The strategy's parts:

- a `Sampler` and an `Assignment` (`hetfl.core.server.assign`): which clients a round asks, and
  which spec each trains (at set-up and this round), with every spec a client may train;
- map transforms (`hetfl.core.server.maps`), chained: private layers, label-split masks;
- a weighting per result and an optional round-level scaling (`hetfl.core.server.weighting`:
  factors computed from all of the round's results, FedFA's `hetfl.algorithms.parts.fedfa_scaling`);
- a reducer factory (`hetfl.core.state`: the `Accumulator`'s weighted mean by default;
  `hetfl.core.server.robust`: coordinate-wise median and trimmed mean), through which every
  reduction of a round goes;
- a server update (`hetfl.core.server.update`): the reduced weights, or a server optimiser
  on a direction (FedOpt's pseudo-gradient, FedNova's normalised step);
- evaluation parts (`hetfl.core.server.evaluation`): the models tested globally, each client's
  local task;
- optionally a set-up query (`SetupQuery`: what each client declares from its own data
  before set-up, which the engine asks), a server side for split learning
  (`ServerSide`), a round-level server phase (`hetfl.core.server.phase`: FedGKT's server
  training on all uploads, after the aggregation and its round-level scaling), a pooled
  evaluation on the clients' own splits (`pooled_eval`), declared global tensors,
  a description for the run summary, an observer of metrics rows and the fields it declares
  per client for the per-client trace (`trace_fields`: a tier, a group).

The global state flows through the round; the engine holds it and writes no attribute of
the strategy, and the strategy keeps nothing between `plan` and `aggregate`: what
aggregation needs of the plan comes back in the tasks of `TrainedRound`. Engines (the
simulator, the Flower adapter) call these verbs:

0. `setup(clients, generator, rounds)` -> the initial global state; where the strategy
   has a set-up query (`capabilities.setup_query`), the engine first asks every client it
   and puts the answers in the clients' `attrs`.
1. `plan(round, state, available, rng)` -> tasks. `available` holds the clients the engine
   can reach this round, sorted by id; an empty list of tasks skips the round's training.
2. the engine runs each task's client program and validates its result against the task's
   index map (names, shapes, finiteness); invalid results and clients that raised become
   `Failure`s.
3. `aggregate(round, state, trained)` -> `Aggregated`: the new global state and what a
   defence among the reducers decided (`Aggregated.defence`; a coverage-aware rule's
   elements beyond the breakdown point, `Aggregated.beyond`). `trained` (a
   `TrainedRound`) holds every valid result at once with the task it answered, sorted by
   client id, so norms across clients and robust rules are possible, and each result is
   written through the index map its task carried; without results the state comes back
   unchanged. In rounds where `server_program(round, state, tasks)` returned a program
   (split learning, `hetfl.core.server_program`), the engine ran one server session per
   client alongside its training, and `trained.server_results` holds the valid clients'
   `ServerResult`s in the same order (None in other rounds).
3b. with a server phase, `run_phase(round, state, trained, generator)` -> the phase's
   result (new state, per-client downloads, passes), after `aggregate`.
4. every k rounds, `eval_models(state)` names the models to test on the global test set,
   and `eval_task(info, state, evaluated)` the client-side evaluation of a client's model
   with its private layers on its local test split (`evaluated`: the models just tested,
   as tested, that is after any statistics pass, by name).

`extra_state` / `load_extra_state` carry what the parts keep across rounds (server
optimiser moments), for checkpoints; the engine checkpoints the global state itself.
What an engine must know before it runs the method (a server program, a server phase,
pooled scoring, a set-up query, the training settings) is one declared record,
`capabilities` (`Capabilities`), not attributes of the parts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, final, runtime_checkable

import torch

from hetfl.core.declared import DeclaredTensor, build_declared
from hetfl.core.init import build_model, initialize
from hetfl.core.plateau import PlateauLr
from hetfl.core.rng import sibling_generator
from hetfl.core.server.assign import Assignment, Sampler, SeededAssignment, round_specs
from hetfl.core.server.defences import DecisionRecorder, RoundDecisions
from hetfl.core.server.evaluation import (
    GlobalEval,
    Layout,
    LocalEval,
    LocalModel,
    WholeModel,
    own_spec,
)
from hetfl.core.server.maps import MapTransform
from hetfl.core.server.phase import PhaseResult, ServerPhase, Upload
from hetfl.core.server.robust import Beyond
from hetfl.core.server.update import (
    Averaged,
    Contribution,
    RoundResults,
    ServerUpdate,
    reduce,
)
from hetfl.core.server.weighting import Scaling, Weighting
from hetfl.core.server_program import ServerProgram
from hetfl.core.spec import IndexMap, Spec, ungrouped
from hetfl.core.state import Accumulator, ReducerFactory, extract
from hetfl.core.training import LocalTraining
from hetfl.core.types import (
    ClientData,
    ClientInfo,
    ClientTask,
    EvalModel,
    EvalTask,
    ModelFamily,
    ServerResult,
    State,
    TrainedRound,
)


class ServerSide(Protocol):
    """The server half of split learning: a program for the round's sessions, and where a
    session's returned tensors sit in the global state (they are reduced with their
    client's result and weight)."""

    def program(
        self, round: int, state: Mapping[str, torch.Tensor], tasks: Sequence[ClientTask]
    ) -> ServerProgram | None: ...

    def index_map(self, served: ServerResult) -> IndexMap: ...


class SetupQuery(Protocol):
    """A question each client answers once, before set-up, from its own training data;
    the answer is what it declares (merged under `ClientInfo.attrs`, where an attribute
    the client declared itself wins). FedFA's clients score their candidate architectures
    with ZiCo there. An engine that cannot ask its clients refuses the strategy up front
    and prints `instead`, what to configure so that no question is needed. `key` names
    everything besides the client's data and generator that the answer depends on, so
    that an engine may keep answers across runs under it (None: never kept)."""

    instead: str
    key: str | None

    def __call__(
        self, info: ClientInfo, data: ClientData, generator: torch.Generator
    ) -> Mapping[str, Any]: ...


#: Which clients a strategy's set-up query asks, from the clients and the generator its
#: assignment's set-up gets, each with the attributes it is told before it answers, as a
#: server tells a device its share: FedFA's clients are told their MACs budget, so that each
#: scores only the candidates within it (a client's own declared attribute wins).
SetupQueryClients = Callable[
    [Sequence[ClientInfo], torch.Generator], Mapping[int, Mapping[str, Any]]
]


#: `(info, task this round or None) -> {name: scalar}`: a method's fields for a client's
#: row of the per-client trace (`Strategy.trace_fields`).
TraceFields = Callable[[ClientInfo, ClientTask | None], Mapping[str, Any]]


class Aggregated(NamedTuple):
    """A round's aggregation: the new global state, what the method's defence decided for
    each trained client (`hetfl.core.server.defences`; None without a defence or results),
    and the elements a coverage-aware rule found beyond the breakdown point
    (`DecisionRecorder.beyond`; None without such a rule or results)."""

    state: State
    defence: RoundDecisions | None
    beyond: Beyond | None = None


@dataclass(frozen=True)
class Aggregation:
    """How a round's results become the new global state: each result's `weighting`,
    an optional round-level `scaling`, the map `transforms` (chained, in order) its
    tensors are reduced through, the `reducer` every reduction goes through, and the
    `server_update` that turns the reduced weights into the new state (by default they
    are the new state)."""

    weighting: Weighting
    server_update: ServerUpdate = field(default_factory=Averaged)
    transforms: Sequence[MapTransform] = ()
    scaling: Scaling | None = None
    reducer: ReducerFactory = Accumulator


@dataclass(frozen=True)
class Evaluation:
    """How the method is judged: the models tested on the global test set
    (`global_eval`), each client's task on its local split (`local_eval`) and, for a
    method without a single global model whose clients still share one (FedGKT: each
    client's extractor joined to the server model), the task that judges a client on its
    own split (`pooled_eval`), which the engine pools by samples as `pooled_acc`."""

    global_eval: GlobalEval = field(default_factory=WholeModel)
    local_eval: LocalEval = field(default_factory=lambda: LocalModel(own_spec()))
    pooled_eval: LocalEval | None = None


@dataclass(frozen=True)
class Extras:
    """What some methods add: `declared` global tensors of their own shape, split
    learning's `server_side`, a round-level `server_phase` (FedGKT), a `describe` for the
    run summary, an `observer` of metrics rows, per-client `trace_fields`, a
    `setup_query` clients answer before set-up and `setup_query_clients`, which of them
    the assignment will read an answer of, each with what it is told before it answers
    (from the clients and the generator its `setup_seeded` gets; None: every client, told
    nothing)."""

    declared: Sequence[DeclaredTensor] = ()
    server_side: ServerSide | None = None
    server_phase: ServerPhase | None = None
    describe: Callable[[], dict[str, Any]] | None = None
    observer: Callable[[int, Mapping[str, Any]], None] | None = None
    trace_fields: TraceFields | None = None
    setup_query: SetupQuery | None = None
    setup_query_clients: SetupQueryClients | None = None


@dataclass(frozen=True)
class Capabilities:
    """What an engine must know of a method before it runs one, declared once by the
    strategy (`Strategy.capabilities`) rather than read off its parts: an engine that
    cannot give the method what it needs refuses it up front, not in a round."""

    #: The run's local-training settings every task starts from (`task_config`).
    train: LocalTraining
    #: A server side (split learning's per-batch exchange) or a round-level server phase.
    needs_server_program: bool
    #: A round-level server phase (FedGKT), whose answers wait as pending downloads.
    server_phase: bool
    #: Judged on its clients' own splits, pooled (`pooled_task`: FedGKT's `pooled_acc`).
    scores_pooled: bool
    #: The question each client answers before set-up, which the engine asks (or None).
    setup_query: SetupQuery | None
    #: `(clients, the generator setup gets) -> {id: told}` for the clients to ask (the
    #: others' answers would never be read), each with the attributes it is told before it
    #: answers (`SetupQueryClients`).
    setup_query_clients: SetupQueryClients


@runtime_checkable
class Stateful(Protocol):
    """A part that keeps something across rounds; it is the strategy's `extra_state`."""

    def extra_state(self) -> dict[str, Any]: ...

    def load_extra_state(self, state: Mapping[str, Any]) -> None: ...


@final
class Strategy:
    """A federated method's server side, composed from parts (see the module docstring).
    Takes explicit parts and settings; never sees the whole config or the engine."""

    def __init__(
        self,
        family: ModelFamily,
        *,
        train: LocalTraining,
        sampler: Sampler,
        assignment: Assignment,
        aggregation: Aggregation,
        evaluation: Evaluation | None = None,
        extras: Extras | None = None,
    ) -> None:
        """`train`: the run's local-training settings, with their lr schedule; whom to
        ask (`sampler`), what each trains (`assignment`), and the three records of parts:
        how results are combined, how the method is judged, and what it adds."""
        if not isinstance(train, LocalTraining):
            raise TypeError(
                f"train must be a LocalTraining record (hetfl.core.training), got "
                f"{type(train).__name__}"
            )
        self.family = family
        self.sampler, self.assignment = sampler, assignment
        self.aggregation = aggregation
        self.evaluation = evaluation or Evaluation()
        self.extras = extras or Extras()
        self.capabilities = Capabilities(
            train=train,
            needs_server_program=self.extras.server_side is not None
            or self.extras.server_phase is not None,
            server_phase=self.extras.server_phase is not None,
            scores_pooled=self.evaluation.pooled_eval is not None,
            setup_query=self.extras.setup_query,
            setup_query_clients=self._setup_query_clients,
        )
        #: The lr's plateau rule (`train.lr_plateau`), whatever the method; its state is
        #: extra state.
        self._plateau = None if train.lr_plateau is None else PlateauLr(train.lr_plateau)
        self.rounds: int | None = None
        self._decided: Layout | None = None
        self._parameters_cache: list[str] | None = None
        self._state_names: list[str] = []

    # -- set-up -----------------------------------------------------------------------
    def _setup_query_clients(
        self, clients: Sequence[ClientInfo], generator: torch.Generator
    ) -> Mapping[int, Mapping[str, Any]]:
        select = self.extras.setup_query_clients
        if select is None:
            return {c.cid: {} for c in clients}
        return select(clients, sibling_generator(generator, "assignment"))

    def setup(
        self,
        clients: Sequence[ClientInfo],
        generator: torch.Generator,
        rounds: int | None = None,
    ) -> State:
        """Assign specs to all clients, derive the global spec; returns the initial global
        state. `rounds` is the planned length of the run, for schedules by fraction of
        training."""
        self.rounds = rounds
        self.sampler.setup(clients)
        if isinstance(self.assignment, SeededAssignment):
            self.assignment.setup_seeded(clients, sibling_generator(generator, "assignment"))
        else:
            self.assignment.setup(clients)
        self._decided = Layout(
            self.family,
            self.family.global_spec(self.assignment.possible_specs()),
            self.assignment.spec_of,
            self._index_map_for,
        )
        self._parameters_cache = None
        state = self._init_global_state(generator)
        self._state_names = list(state)
        return state

    @property
    def _layout(self) -> Layout:
        if self._decided is None:
            raise RuntimeError("strategy.setup(...) has not been called")
        return self._decided

    @property
    def global_spec(self) -> Spec:
        return self._layout.global_spec

    def _declared_tensors(self) -> list[DeclaredTensor]:
        """Global tensors that are not slices of the global model, built at their own shape
        (`hetfl.core.declared`): the family's (`family.declared_tensors(specs)` over the
        possible specs, when the family has that method), then the strategy's own."""
        declare = getattr(self.family, "declared_tensors", None)
        specs = self.assignment.possible_specs()
        return [*(declare(specs) if declare is not None else []), *self.extras.declared]

    def _init_global_state(self, generator: torch.Generator) -> State:
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
        declared = build_declared(self._declared_tensors(), generator)
        clash = sorted(set(declared) & set(tensors))
        if clash:
            raise ValueError(
                f"declared tensors {clash[:5]} are tensors of the global model already; "
                "declare only new names (e.g. group-qualified '<group>/<name>')"
            )
        shared = {e.global_name for spec in self._all_specs() for e in self._index_map_for(spec)}
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

    def _all_specs(self) -> set[Spec]:
        return {*self.assignment.possible_specs(), self.global_spec}

    def _parameter_names(self) -> list[str]:
        """Global tensors that are trainable parameters, as opposed to buffers (BatchNorm's
        running statistics and counters), which server optimisers leave to plain averaging.
        A declared tensor is what its `role` says. In the global state's order."""
        if self._parameters_cache is None:
            found: set[str] = set()
            for spec in self._all_specs():
                params = dict(build_model(self.family, spec).named_parameters())
                found.update(e.global_name for e in self._index_map_for(spec) if e.local in params)
            roles = {d.name: d.role for d in self._declared_tensors()}
            found = {n for n in found if n not in roles}
            found.update(n for n, role in roles.items() if role == "parameter")
            self._parameters_cache = [k for k in self._state_names if k in found]
        return self._parameters_cache

    def _index_map_for(self, spec: Spec) -> IndexMap:
        """Which local tensors of a `spec` model are shared, and where they sit in the global
        state, where no client is given (each transform's `shared`)."""
        imap = self.family.index_map(spec)
        for t in self.aggregation.transforms:
            imap = t.shared(imap, spec)
        return imap

    def _index_map_in_round(
        self, info: ClientInfo, spec: Spec, state: Mapping[str, torch.Tensor]
    ) -> IndexMap:
        """The map of one client's task (each transform's `for_client`)."""
        imap = self.family.index_map(spec)
        for t in self.aggregation.transforms:
            imap = t.for_client(imap, spec, info, state)
        return imap

    # -- round verbs --------------------------------------------------------------------
    def _task_config(self, round: int, info: ClientInfo) -> LocalTraining:
        """Local training settings sent with the task, with this round's lr from the run's
        schedule and, with `train.lr_plateau`, the plateau rule's factor
        (`LocalTraining.for_round`)."""
        factor = 1.0 if self._plateau is None else self._plateau.factor
        return self.capabilities.train.for_round(round, self.rounds, factor)

    def plan(
        self,
        round: int,
        state: Mapping[str, torch.Tensor],
        available: Sequence[ClientInfo],
        rng: torch.Generator,
    ) -> list[ClientTask]:
        """Tasks for the sampled clients. The engine hands each back to `aggregate` with its
        client's result, which is written through exactly the map the task carries."""
        tasks = []
        phase = self.extras.server_phase
        sampled = self.sampler.sample(round, available, rng)
        for info, spec in zip(
            sampled, round_specs(self.assignment, round, sampled, rng), strict=True
        ):
            imap = self._index_map_in_round(info, spec, state)
            tasks.append(
                ClientTask(
                    cid=info.cid,
                    spec=spec,
                    payload=extract(state, imap),
                    index_map=imap,
                    config=self._task_config(round, info),
                    uploads={} if phase is None else phase.uploads(info, spec),
                )
            )
        return tasks

    def aggregate(self, round: int, state: State, trained: TrainedRound) -> Aggregated:
        """The new global state: each result reduced through its task's map with its weight
        (fill "keep"), with its server session's tensors in split learning, then the server
        update (unchanged without results); with what a defence among the reducers decided
        (kept, clipped, dropped per trained client, the median fallback), which every
        reduction of the round records (`DecisionRecorder`)."""
        if not trained.trained:
            return Aggregated(dict(state), None)
        results = trained.results
        maps = [t.task.index_map for t in trained.trained]
        weights = [self.aggregation.weighting(r) for r in results]
        served: Sequence[ServerResult | None] = (
            [None] * len(results) if trained.server_results is None else trained.server_results
        )
        scales: Sequence[Mapping[str, float] | None] = (
            [None] * len(results)
            if self.aggregation.scaling is None
            else self.aggregation.scaling(trained.trained)
        )
        if len(scales) != len(results):
            raise ValueError(
                f"the scaling part gave {len(scales)} scales for {len(results)} results; it "
                "must give one per trained client, in their order"
            )
        contributions, owners = [], []
        for r, imap, w, s, scale in zip(results, maps, weights, served, scales, strict=True):
            contributions.append(Contribution(r.tensors, imap, w, scale))
            owners.append(r.cid)
            if s is not None and self.extras.server_side is not None:
                contributions.append(
                    Contribution(s.tensors, self.extras.server_side.index_map(s), w)
                )
                owners.append(r.cid)
        recorder = DecisionRecorder(self.aggregation.reducer)
        average = reduce(recorder, state, contributions, fill="keep")
        done = RoundResults(results, maps, weights, self._parameter_names(), recorder)
        new = self.aggregation.server_update.step(state, average, done)
        decided = recorder.decided(owners, [r.cid for r in results])
        return Aggregated(new, decided, recorder.beyond())

    def server_program(
        self, round: int, state: Mapping[str, torch.Tensor], tasks: Sequence[ClientTask]
    ) -> ServerProgram | None:
        """The server side of this round's split learning, or None (no per-batch exchange)."""
        return (
            None
            if self.extras.server_side is None
            else self.extras.server_side.program(round, state, tasks)
        )

    def run_phase(
        self, round: int, state: State, trained: TrainedRound, generator: torch.Generator
    ) -> PhaseResult | None:
        """The round's server phase on the valid clients' uploads (client-id order), after
        `aggregate`; None without one. `generator` is the round's (seed, round, SERVER,
        "server-phase") generator."""
        if self.extras.server_phase is None:
            return None
        uploads = [Upload(r.cid, r.uploads, r.num_examples) for r in trained.results]
        return self.extras.server_phase.run(round, state, uploads, generator)

    # -- evaluation ---------------------------------------------------------------------
    def eval_models(self, state: Mapping[str, torch.Tensor]) -> list[EvalModel]:
        """The models to test on the global test set (the `global_eval` part)."""
        return self.evaluation.global_eval.eval_models(self._layout, state)

    def eval_task(
        self,
        info: ClientInfo,
        state: Mapping[str, torch.Tensor],
        evaluated: Mapping[str, State],
    ) -> EvalTask:
        """How client `info` is judged on its local test split (the `local_eval` part).
        `evaluated` holds this round's `eval_models` as the engine tested them (complete
        tensors after any statistics pass), by name."""
        return self.evaluation.local_eval.eval_task(self._layout, info, state, evaluated)

    def pooled_task(self, info: ClientInfo, state: Mapping[str, torch.Tensor]) -> EvalTask | None:
        """The task that judges client `info`'s joined model (`pooled_eval`): on its own
        splits for `pooled_acc`, on the global test set for `global_acc` with
        `eval.pooled_global`; None when the method has a global model of its own."""
        if self.evaluation.pooled_eval is None:
            return None
        return self.evaluation.pooled_eval.eval_task(self._layout, info, state, {})

    def describe(self) -> dict[str, Any]:
        """What set-up decided that a reader of the run should see (JSON-serialisable),
        written to `summary.json` under "strategy": ScalableFL's per-group models and the
        parameter gap of its HeteroFL comparison. Default: nothing."""
        return {} if self.extras.describe is None else self.extras.describe()

    def observe(self, round: int, row: Mapping[str, Any]) -> None:
        """Called after each evaluation with the metrics row: the lr's plateau rule
        (`train.lr_plateau`), then the method's observer; anything an observer changes must
        be part of a part's `extra_state`."""
        if self._plateau is not None:
            self._plateau.observe(round, row)
        if self.extras.observer is not None:
            self.extras.observer(round, row)

    def trace_fields(self, info: ClientInfo, task: ClientTask | None) -> Mapping[str, Any]:
        """What this method declares about client `info` for its row of the per-client
        trace (`clients.jsonl`, `hetfl.engine.trace`): scalars by name, e.g. a tier. `task`
        is its task this round, or None when it is only evaluated. Default: nothing."""
        return {} if self.extras.trace_fields is None else self.extras.trace_fields(info, task)

    # -- checkpoints --------------------------------------------------------------------
    def _stateful_parts(self) -> list[Stateful]:
        parts = (
            self.sampler,
            self.assignment,
            self.aggregation.server_update,
            self._plateau,
            self.extras.server_phase,
        )
        return [p for p in parts if isinstance(p, Stateful)]

    def extra_state(self) -> dict[str, Any]:
        """What the parts keep across rounds (server optimiser moments), by part entry."""
        out: dict[str, Any] = {}
        for part in self._stateful_parts():
            entries = part.extra_state()
            clash = sorted(set(entries) & set(out))
            if clash:
                raise ValueError(f"two strategy parts keep extra state under {clash}")
            out.update(entries)
        return out

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        for part in self._stateful_parts():
            part.load_extra_state(state)
