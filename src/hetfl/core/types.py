"""One job: the plain data that crosses between engine, strategy and client program.

These are the words of the round protocol (see `hetfl.core.server.strategy`):

    engine -> [ClientInfo] -> strategy.plan -> [ClientTask] -> client program -> ClientResult
    engine -> strategy.aggregate(round, state, TrainedRound) -> (new global state, defence, beyond)
    engine -> strategy.eval_models(state) -> [EvalModel]

Everything here is a plain dataclass of tensors, numbers and strings, so that an engine
can serialise it (Flower) or batch it (a vectorised executor).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal, NamedTuple, Protocol

import torch
from torch import nn

from hetfl.core.augment import Augmentation
from hetfl.core.boxes import PAD_LABEL
from hetfl.core.pixels import PixelNorm, model_inputs
from hetfl.core.spec import IndexMap, Spec
from hetfl.core.state import State
from hetfl.core.training import LocalTraining


@dataclass(frozen=True)
class DeviceRates:
    """A client's device in a round, as the engine's device profiles rate it: `rate` in
    MAC/s, links in Mbit/s (10^6 bits per second). A scheduler that plans from a device's
    capacity before it has observed the client (DTFL's tier profiling) reads it."""

    name: str
    rate: float
    down_mbps: float
    up_mbps: float


@dataclass(frozen=True)
class ClientInfo:
    """What the server may know about a client before asking it to train.

    `attrs` holds what the client declared (a chosen architecture, a device capacity).
    `history` is what the engine measured: under device profiles, the client's simulated
    times in the last round it trained (None before it has trained, and without profiles).
    `device` is the client's device profile in the round being planned (None without
    profiles, and in engines that have none).
    """

    cid: int
    n_train: int
    input_shape: tuple[int, ...]
    labels: tuple[int, ...]
    attrs: Mapping[str, Any] = field(default_factory=dict)
    history: ClientTimes | None = None
    device: DeviceRates | None = None


@dataclass
class ClientTask:
    """One client's work for one round.

    `payload` holds the tensors sent down (already extracted through `index_map`, whose
    local names they carry); their bytes are counted as `bytes_down`. The client uploads the
    tensors named by `index_map` (a map entry's `mask` narrows what counts in aggregation)
    and keeps every other tensor of its local model private. `config` carries the local
    training settings of this client and round (`LocalTraining`: lr, epochs or steps,
    batch size, ...); `kind` is `"fit"` or `"evaluate"` (local evaluation with private
    layers).

    `download` holds per-client tensors that are not a slice of the global state (a
    server phase's answer for this client's samples, `hetfl.core.server.phase`): the engine
    delivers them with the client's next task and counts them in `bytes_down` then.
    `uploads` declares the shape of each non-parameter tensor the client must send back in
    `ClientResult.uploads` (features, logits, labels, sample indices); the result is
    checked against it as its tensors are against the map.
    """

    cid: int
    spec: Spec
    payload: State
    index_map: IndexMap
    config: LocalTraining = field(default_factory=LocalTraining)
    kind: Literal["fit", "evaluate"] = "fit"
    download: State = field(default_factory=dict)
    uploads: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.config, LocalTraining):
            raise TypeError(
                f"client {self.cid}'s task config must be a LocalTraining record, got "
                f"{type(self.config).__name__}; build one (hetfl.core.training.LocalTraining) "
                "instead of passing a dict"
            )


@dataclass(frozen=True)
class PassRecord:
    """`count` passes of `kind` ("train" = forward+backward, "forward", "train+input" =
    forward+backward that also computes the input's gradient, as a split model's server
    side does to answer its client) over batches of `batch` samples through the model built
    for `spec` at `width` (None = the full spec)."""

    spec: Spec
    kind: str
    batch: int
    count: int
    width: float | None = None


@dataclass
class ClientResult:
    """What a client sends back after a fit task.

    `tensors` carries local names from the task's index map (weights, or deltas for methods
    that say so). `uploads` are the non-parameter tensors the task declared
    (`ClientTask.uploads`: features, logits, labels, sample indices for a server phase),
    counted in `bytes_up` and checked like `tensors`. `extras` is the declared slot for
    method-specific scalars or tensors (FedNova's normaliser, per-width statistics):
    nothing is smuggled through `metrics`.
    """

    cid: int
    tensors: State
    num_examples: int
    num_steps: int
    loss: float
    passes: list[PassRecord] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    extras: dict[str, Any] = field(default_factory=dict)
    uploads: State = field(default_factory=dict)


@dataclass(frozen=True)
class ClientTimes:
    """A client's simulated times in the last round it trained, under its device profile.

    Engines with device profiles put it in `ClientInfo.history` for the next `plan` (DTFL's
    tier scheduler builds its history from it). `compute_s` is local
    training, `server_s` its server program's side (0 without one), `down_s`/`up_s` the
    transfers at the link rates `down_mbps`/`up_mbps`; `total_s` combines them as the
    server program declared (`parallel`: comm + max(compute, server), else comm + compute +
    server).
    """

    round: int
    spec: Spec
    profile: str
    compute_s: float
    server_s: float
    down_s: float
    up_s: float
    total_s: float
    parallel: bool
    macs: int
    server_macs: int
    bytes_down: int
    bytes_up: int
    down_mbps: float
    up_mbps: float

    @property
    def comm_s(self) -> float:
        return self.down_s + self.up_s


@dataclass
class ServerResult:
    """What one client's server side produced this round (split learning,
    `hetfl.core.server_program`).

    `tensors` are the trained server-side tensors (named as the strategy's server-side map
    expects); `passes` the server's training passes, priced like a client's, over inputs of
    `input_shape` (one activation, without the batch dimension); `private` what the server
    keeps for this client until its next round (optimiser state of a persistent copy).
    `metrics` are scalars by name; `metrics["loss"]`, when given, is the client's training
    loss, which the engine reports in place of the client's own (SplitFed: the loss is
    computed on the server, the client has no head). Results of clients that failed are
    dropped by the engine, like their client results.
    """

    cid: int
    tensors: State
    passes: list[PassRecord] = field(default_factory=list)
    input_shape: tuple[int, ...] = ()
    private: State = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class ClientOutput:
    """A client program's full answer: the result it sends and the private state it keeps."""

    result: ClientResult
    private: State


#: Why a client's result was excluded, in a few stable words: `summary.json` counts failures
#: by kind (the free-text reasons name clients, tensors and numbers, and would not group).
#: "raised": local training raised (simulator); "non-finite": NaN or Inf in the uploaded
#: tensors, the loss or a split server side; "invalid": a result that does not match its
#: task (client id, tensor names or shapes, `num_examples`) or a reply that does not decode;
#: "deadline": finished after the simulated clock's deadline; "timeout": no reply within
#: `deploy.round_timeout_s` (Flower); "client-error": the node answered with an error
#: (Flower: the ClientApp raised, or the node could not be reached); "lost": its device's
#: behaviour trace made it unreachable before it finished; "overcommitted": over-commitment
#: kept the first clients to finish, and it was later.
FailureKind = Literal[
    "raised",
    "non-finite",
    "invalid",
    "deadline",
    "timeout",
    "client-error",
    "lost",
    "overcommitted",
]


@dataclass(frozen=True)
class Problem:
    """Why a result cannot be aggregated: its `kind` and the `detail` for the log."""

    kind: FailureKind
    detail: str

    def __str__(self) -> str:
        return self.detail


@dataclass(frozen=True)
class Failure:
    """A client that was asked but whose result was excluded, why, and the kind of why."""

    cid: int
    reason: str
    kind: FailureKind

    @classmethod
    def of(cls, cid: int, problem: Problem) -> Failure:
        return cls(cid, problem.detail, problem.kind)


class Trained(NamedTuple):
    """A valid result with the task it answered: aggregation writes the result through the
    task's index map, the one its client was given."""

    task: ClientTask
    result: ClientResult


@dataclass(frozen=True)
class TrainedRound:
    """What a round's training hands to `Strategy.aggregate`: every valid result with its
    task, in client-id order; the clients whose result was excluded (`failures`); and, in a
    round with a server program (split learning), the valid clients' `ServerResult`s in the
    same order, one per trained client (None in rounds without one).

    An engine builds it; the checks below catch an engine that pairs or orders them wrongly.
    """

    trained: tuple[Trained, ...] = ()
    failures: tuple[Failure, ...] = ()
    server_results: tuple[ServerResult, ...] | None = None

    def __post_init__(self) -> None:
        cids = [t.task.cid for t in self.trained]
        if cids != sorted(set(cids)):
            raise ValueError(f"trained clients must be distinct and in id order, got {cids}")
        paired = [(t.task.cid, t.result.cid) for t in self.trained]
        mismatched = [(task, result) for task, result in paired if task != result]
        if mismatched:
            raise ValueError(f"results paired with another client's task: {mismatched}")
        if self.server_results is not None and [s.cid for s in self.server_results] != cids:
            raise ValueError(
                f"server results for clients {[s.cid for s in self.server_results]}, "
                f"trained clients {cids}: one server result per trained client, in order"
            )

    @property
    def results(self) -> list[ClientResult]:
        """The valid results, in client-id order."""
        return [t.result for t in self.trained]


@dataclass
class EvalModel:
    """One model the engine should test on the global test set.

    `tensors` is the model's full local state for `spec`. With `stats_pass`, the engine
    first re-estimates BatchNorm statistics by a pass over the clients' training data
    (HeteroFL's static BN; `hetfl.engine.statistics`). `group` labels it in the `groups`
    metric (e.g. `"capacity=0.5"`); the models naming one `mean_group` also report the
    unweighted mean of their accuracies under it (FLANC's `"capacity=mean"`). The first
    model of the list is the main one reported as `global_acc`.
    """

    name: str
    spec: Spec
    tensors: State
    stats_pass: bool = False
    group: str | None = None
    mean_group: str | None = None


#: What an evaluation scores a client's model on (`ClientData.split`): one of the client's
#: held-out splits, or the run's global test set (`"global"`: a method without one global
#: model whose clients share one, FedGKT's joined models, scored like a global model).
EvalSplit = Literal["test", "validation", "global"]


@dataclass
class EvalTask:
    """Client-side evaluation of one client's model (with its private layers) on its local
    test split, on its validation split with `split="validation"`, or on the run's global
    test set with `split="global"` (engines set it; a strategy describes the model only).
    `payload` and `index_map` are as in `ClientTask`; `payload` may also be a complete
    model with its BatchNorm statistics (HeteroFL's full-rate model as the global
    evaluation tested it).

    With `stats_pass`, the client first re-estimates BatchNorm statistics on its own
    training data (static BN evaluated locally); with `label_mask`, logits of the classes
    not listed are set to 0 before the argmax (HeteroFL's masked local accuracy).
    """

    cid: int
    spec: Spec
    payload: State
    index_map: IndexMap
    group: str | None = None
    stats_pass: bool = False
    label_mask: tuple[int, ...] | None = None
    split: EvalSplit = "test"


class ModelFamily(Protocol):
    """What the core needs of a model family: a module per spec and the map into the global
    state. Families live in `hetfl.models`; the core never imports them.

    `modules(spec)` names, in order, the submodules of `build(spec)` that form its forward
    pipeline (possibly nested, as a ResNet's blocks `stages.1.0`); split points lie between
    them, and the cost model prices MACs and activation bytes per module. A family that
    cannot be split may leave it out: its models are then priced whole.

    A family whose global state holds tensors that are not slices of the global model
    (FLANC's per-capacity coefficients) may define `declared_tensors(specs) ->
    list[DeclaredTensor]` (`hetfl.core.declared`), called with every possible spec; without
    it, it declares none. A family whose specs may train without BatchNorm running
    statistics (static BN) may define `evaluation_spec(spec) -> Spec`, the same model with
    them, through which a trained model is evaluated after a statistics pass
    (`eval.local_trained`); without it, a trained model is evaluated through its own spec.
    """

    def build(self, spec: Spec) -> nn.Module: ...

    def index_map(self, spec: Spec) -> IndexMap: ...

    def global_spec(self, specs: list[Spec]) -> Spec: ...

    def modules(self, spec: Spec) -> list[str]: ...


class BatchPoison(Protocol):
    """A change to each training batch, (x (B, ...) as stored, y (B,)) -> the same shapes,
    called once per batch in step order (it may draw from a generator of its own)."""

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class ClientData:
    """One client's data, held as tensors on the device; batches are index slices.

    `x_test`/`y_test` are the client's local test split (drawn from the global test set in
    the client's class proportions). `x_val`/`y_val` are its validation split, held out of
    its training data (None without `data.validation`). `labels` are the classes present in
    its training data.

    Inputs are held as stored: with `pixels`, uint8 images (or 0..255 floats after a view's
    resize) that `model_inputs` standardises per batch (`hetfl.core.pixels`). `augment`, when
    given, is applied to training batches only (`train_batch`). `poison`, when given, changes
    each training batch (a malicious client's data, `hetfl.attacks.backdoor`); an honest
    client's data has none.

    `global_test` is never the client's own: it is the run's global test set (x, y), which
    the engine attaches to the data of a unit that scores the client's model on it
    (`EvalTask.split == "global"`; views of the data every worker already maps, so no
    sample is copied), and None everywhere else.
    """

    cid: int
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    x_val: torch.Tensor | None = None
    y_val: torch.Tensor | None = None
    pixels: PixelNorm | None = None
    augment: Augmentation | None = None
    poison: BatchPoison | None = None
    global_test: tuple[torch.Tensor, torch.Tensor] | None = None

    def train_batch(
        self, idx: torch.Tensor, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs as the model takes them, labels) of the training samples `idx`: augmented
        from `generator` (the client's round generator for augmentation, consumed batch by
        batch) when `augment` says so, and changed by `poison` when there is one, on the
        pixels as stored after the geometric augmentation and before they are standardised
        (and before Cutout), so that a stamped patch stays where it was put."""
        x, y = self.x_train[idx], self.y_train[idx]
        augment = self.augment if self.augment is not None and self.augment.active else None
        if augment is not None:
            x = augment.geometric(x, generator)
        if self.poison is not None:
            x, y = self.poison(x, y)
        if augment is not None:
            return augment.standardised(x, generator, self.pixels), y
        return model_inputs(x, self.pixels), y

    @property
    def n_train(self) -> int:
        return int(self.y_train.shape[0])

    def split(self, name: EvalSplit) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) of the local test split, of the validation split (empty without one) or
        of the global test set the engine attached (`global_test`)."""
        if name == "test":
            return self.x_test, self.y_test
        if name == "global":
            if self.global_test is None:
                raise ValueError(
                    f"client {self.cid}'s data holds no global test set: the engine attaches "
                    "the run's to the unit that scores a model on it (the simulator does; "
                    "an engine that cannot must refuse eval.pooled_global)"
                )
            return self.global_test
        if name != "validation":
            raise ValueError(
                f"no split {name!r}: a client is scored on 'test', 'validation' or 'global'"
            )
        if self.x_val is None or self.y_val is None:
            return self.x_train[:0], self.y_train[:0]
        return self.x_val, self.y_val

    @cached_property
    def labels(self) -> tuple[int, ...]:
        """The classes present: of the labels (N,), or of detection targets (N, M, 6), the
        objects' labels (`hetfl.core.boxes`: column 0, -1 for padding)."""
        y = self.y_train
        if y.dim() == 3:
            y = y[..., 0][y[..., 0] != PAD_LABEL].long()
        return tuple(int(c) for c in torch.unique(y).tolist())

    def info(self, attrs: Mapping[str, Any] | None = None) -> ClientInfo:
        return ClientInfo(
            cid=self.cid,
            n_train=self.n_train,
            input_shape=tuple(self.x_train.shape[1:]),
            labels=self.labels,
            attrs=dict(attrs or {}),
        )
