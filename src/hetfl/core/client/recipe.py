"""The parts of local training, the context they share, and the recipe that chains them.

A method declares its local training as a `LocalRecipe`: a forward variant, loss terms,
gradient transforms, projections after the step, trackers and a backward. The loop
(`hetfl.core.client.loop`) runs, per mini-batch (x: (B, ...), y: (B,)):

    outputs, per_sample = recipe.forward(model, x, y, ctx)       # model: a `ModelCall`
    total = per_sample.mean() + Σ term(outputs, y, per_sample, ctx) for the loss terms
    recipe.backward(total, ctx)                                   # fills ctx.params' grads
    transform(grads, ctx.params, ctx) for each gradient transform, then clipping
    the optimiser's step (`hetfl.core.client.optim`)
    project(ctx.params, ctx) for each projection
    tracker.after_step(ctx) for each tracker

and after the last batch merges every tracker's `finish(ctx)` into the result's extras.
Parts are chained in the order the recipe lists them; none subclasses another. A part is
shared by every client of a run, so it keeps no state of its own: per-round scratch state
lives in `ctx.scratch(part)`. Parts never modify `ctx.received` (the payload), the global
state, the client store or another client's tensors; in-place updates of this client's
parameters, gradients and optimiser state inside the step are theirs to make.

Every part declares, in a class attribute `vectorises`, how it runs when the vectorised
executor (`hetfl.sim.vectorised`) trains clients stacked on a leading dimension (K, ...):

- `Vectorises.PER_CLIENT`: a pure function of one client's tensors (its context's `params`,
  `buffers`, `received`, `batch` and `constant`s): no draw from `ctx.generator`, no Python
  branch on a tensor's value, no write to `ctx.scratch` or `ctx.passes`, no channel. The
  executor runs it under `torch.func.vmap`, one client per row (a tracker: on each client's
  own context, after the step);
- `Vectorises.ELEMENTWISE`: besides, applied once to the whole stack as it is, it does to
  each row what it does to one client (no reduction over a tensor): the executor runs it
  so, which is cheaper than vmap and works for `foreach` kernels, which vmap cannot batch;
- a string: why it cannot (a per-batch generator draw, a data-dependent gate, a server
  channel); the executor then trains the client alone with `train_local`, and the start
  banner says why. A part that declares nothing cannot either (`vectorisation`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch
import torch.nn.functional as F

from hetfl.core.pixels import PixelNorm
from hetfl.core.server_program import Channel
from hetfl.core.spec import Spec
from hetfl.core.training import LocalTraining
from hetfl.core.types import ClientData, ClientInfo, ClientTask, PassRecord, State


class Vectorises(enum.Enum):
    """How a part runs on clients stacked on a leading dimension (the module docstring)."""

    PER_CLIENT = "per client"
    ELEMENTWISE = "elementwise"


def vectorisation(part: object) -> Vectorises | str:
    """`part`'s declared `vectorises`: a `Vectorises`, or why it cannot run on a stack of
    clients (also for a part that declares nothing, such as a bound method)."""
    declared = getattr(part, "vectorises", None)
    if isinstance(declared, Vectorises | str):
        return declared
    return "declares no `vectorises` (hetfl.core.client.recipe.Vectorises, or why not)"


def part_name(part: object) -> str:
    """A part's name for messages: its class, or a function's qualified name."""
    if callable(part) and hasattr(part, "__qualname__"):
        return str(part.__qualname__)
    return type(part).__name__


class ModelCall(Protocol):
    """The client's model as a function of its input: `model(x, **kwargs) -> outputs`,
    evaluated on the client's own parameters (`torch.func.functional_call` on the shared
    template); keyword arguments reach the model's forward (FjORD's `width=`)."""

    def __call__(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor: ...


@dataclass
class TrainContext:
    """What parts may read and record during one client's local training.

    `received` holds the tensors sent down (never modified); `params` the client's live
    parameters (leaf tensors with `.grad`) and `buffers` its buffers (BatchNorm running
    statistics, updated in place by the forward); `batch` the current (x, y), `indices` its
    samples' positions in the client's training set (aligning per-sample values that came
    down with the task, a server's logits); `step` its index. A part that runs its own
    passes (FjORD's widths, distillation) appends a `PassRecord` per pass to `passes`;
    batches for which no part recorded a pass count as one default training pass of the
    task's spec. `channel` is the link to this client's
    server program in split learning (None when the strategy has none). `info` is the
    client's `ClientInfo` as the engine holds it: what it declared in `attrs` and, under
    device profiles, its `history` (its times in the last round it trained). `roles` gives
    the role the model declares for a tensor, by local name (`hetfl.core.roles.tensor_roles`:
    FLANC's bases are "basis"), so that parts find tensors by structure, never by name.
    `constants` holds the tensors parts made with `constant`; `constants_made` is True where
    every constant must already be there (the vectorised executor's stacked step).
    """

    task: ClientTask
    received: State
    generator: torch.Generator
    settings: LocalTraining
    info: ClientInfo | None = None
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    batch: tuple[torch.Tensor, torch.Tensor] | None = None
    indices: torch.Tensor | None = None
    step: int = 0
    passes: list[PassRecord] = field(default_factory=list)
    channel: Channel | None = None
    roles: Mapping[str, str] = field(default_factory=dict)
    constants: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    constants_made: bool = False
    _scratch: dict[int, dict[str, Any]] = field(default_factory=dict)

    def constant(self, part: object, name: str, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """`part`'s tensor `name` for this client's round, made by `make` on first use: a
        tensor that depends on the client (its `info`) and on the model's shapes, never on
        a batch, the step or the parameters' values (HeteroFL's mask of the client's
        classes). Under the vectorised executor each client's is made on its own context
        before training and stacked, so a per-client part reads its row here."""
        key = (id(part), name)
        made = self.constants.get(key)
        if made is None:
            if self.constants_made:
                raise RuntimeError(
                    f"{part_name(part)} made its constant {name!r} in a stacked step: a "
                    "constant must be made on a client's first forward, which the vectorised "
                    "executor runs on each client's own context before training"
                )
            made = self.constants[key] = make()
        return made

    def scratch(self, part: object) -> dict[str, Any]:
        """`part`'s own scratch space for this client's round (keyed by the part's
        identity: equal parts of two recipes do not share it)."""
        return self._scratch.setdefault(id(part), {})

    def send(self, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """Send a batch's activations and labels to the server program; its answer (the
        gradient with respect to `z`, or None). Bytes both ways are counted by the channel."""
        if self.channel is None:
            raise RuntimeError(
                "this method exchanges activations with a server program every batch, but "
                "the engine gave no channel (the strategy's server_program returned None, or "
                "the engine cannot run server programs)"
            )
        return self.channel.send(z, y)


class Forward(Protocol):
    """`(model, x (B, ...), y (B,), ctx) -> (outputs (B, C), per-sample loss (B,))`."""

    def __call__(
        self, model: ModelCall, x: torch.Tensor, y: torch.Tensor, ctx: TrainContext
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class LossTerm(Protocol):
    """`(outputs (B, C), y (B,), per-sample loss (B,), ctx) -> scalar | None`, added to the
    batch's mean loss (None adds nothing)."""

    def __call__(
        self, outputs: torch.Tensor, y: torch.Tensor, per_sample: torch.Tensor, ctx: TrainContext
    ) -> torch.Tensor | None: ...


class Backward(Protocol):
    """`(total loss (scalar), ctx) -> None`: leaves each parameter's gradient of this batch
    in `ctx.params[name].grad` (which the loop zeroed before). A backward that declares
    `Vectorises.PER_CLIENT` promises that this gradient is the gradient of `total`: the
    vectorised executor takes that with `torch.func.grad` instead of calling it."""

    def __call__(self, total: torch.Tensor, ctx: TrainContext) -> None: ...


class GradTransform(Protocol):
    """`(grads by name, params by name, ctx) -> None`: edits the gradients in place."""

    def __call__(
        self, grads: dict[str, torch.Tensor], params: Mapping[str, torch.Tensor], ctx: TrainContext
    ) -> None: ...


class Projection(Protocol):
    """`(params by name, ctx) -> None`: edits the parameters in place after the step."""

    def __call__(self, params: Mapping[str, torch.Tensor], ctx: TrainContext) -> None: ...


class Tracker(Protocol):
    """Observes the training: `after_step(ctx)` after each step; `finish(ctx)` returns
    the extras it adds to the client's result."""

    def after_step(self, ctx: TrainContext) -> None: ...

    def finish(self, ctx: TrainContext) -> dict[str, Any]: ...


class Upload(Protocol):
    """`(model, data, ctx) -> named tensors`: after the last step, what the client sends
    besides its parameters (`ClientResult.uploads`, declared by `ClientTask.uploads`):
    FedGKT's features, logits, labels and sample indices of its whole training set. The
    model is in eval mode; a part that runs passes records them in `ctx.passes`."""

    def __call__(self, model: ModelCall, data: ClientData, ctx: TrainContext) -> State: ...


@dataclass(frozen=True)
class CrossEntropy:
    """The default forward: `model(x)` and its per-sample cross-entropy with `y`."""

    vectorises: ClassVar[Vectorises] = Vectorises.PER_CLIENT

    def __call__(
        self, model: ModelCall, x: torch.Tensor, y: torch.Tensor, ctx: TrainContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        outputs = model(x)
        return outputs, F.cross_entropy(outputs, y, reduction="none")


@dataclass(frozen=True)
class Autograd:
    """The default backward: back-propagation of the total loss through the client's
    model (split learning replaces it with an exchange with the server program)."""

    vectorises: ClassVar[Vectorises] = Vectorises.PER_CLIENT

    def __call__(self, total: torch.Tensor, ctx: TrainContext) -> None:
        total.backward()


class Scoring(Protocol):
    """How a client's model is scored on one of its splits when the task is not
    classification: (the score summed over the split, so that over `count` it is the
    split's score; the summed loss; count)."""

    def __call__(
        self,
        model: torch.nn.Module,
        x: torch.Tensor,
        y: torch.Tensor,
        spec: Spec,
        num_classes: int,
        pixels: PixelNorm | None,
    ) -> tuple[float, float, int]: ...


@dataclass(frozen=True)
class LocalRecipe:
    """A method's local training, as parts run in the order listed (see the module
    docstring for where each runs in a step). The default recipe is plain local training:
    cross-entropy, back-propagation and the settings' optimiser. `scoring`, when set, is
    how the task the recipe trains for is scored (a detector's mAP,
    `hetfl.core.client.detection_scoring`); without it a client is scored by accuracy."""

    forward: Forward = CrossEntropy()
    loss_terms: tuple[LossTerm, ...] = ()
    grad_transforms: tuple[GradTransform, ...] = ()
    projections: tuple[Projection, ...] = ()
    trackers: tuple[Tracker, ...] = ()
    backward: Backward = Autograd()
    upload: Upload | None = None
    scoring: Scoring | None = None

    def parts(self) -> tuple[tuple[str, object], ...]:
        """Every part with its place in the recipe ("forward", "loss term", ...), in the
        order a step runs them; the upload, which runs once after the last step, last."""
        return (
            ("forward", self.forward),
            *(("loss term", t) for t in self.loss_terms),
            ("backward", self.backward),
            *(("gradient transform", t) for t in self.grad_transforms),
            *(("projection", p) for p in self.projections),
            *(("tracker", t) for t in self.trackers),
            *((("upload", self.upload),) if self.upload is not None else ()),
        )
