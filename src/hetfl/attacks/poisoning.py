"""Model and data poisoning by a malicious client: each attack wraps the client's honest
program (`hetfl.core.client.program.Wrapper`) and knows no method.

Park and Joe-Wong, "Federated Learning with Flexible Architectures" (ECML-PKDD 2024), §5,
Eq. 1: a malicious client trains honestly from the received model w, giving w_h, and trains
again from the same w on the same data with its labels shuffled, giving w_p; it uploads

    w + (w_h − w) + λ · (w_p − w)

(`fedfa-poison`). Here the poisoned pass uses the same batch order as the honest one (a
copy of the client's training generator in its state before training) and labels permuted
by a sibling of that generator, purpose "attack" (`hetfl.core.rng.sibling_generator`), so
the attack is reproducible and does not depend on the order clients run in. Both passes are
recorded (`ClientResult.passes`), so both count in MACs and simulated time; the reported
loss, steps, extras and kept private state are the honest pass's.

- `scaled-poison`: the poisoned update alone, scaled: w + λ · (w_p − w) (the model
  replacement of Bagdasaryan et al., "How To Backdoor Federated Learning", AISTATS 2020,
  §4.2, with shuffled labels as the poison).
- `label-flip`: every training label `source` becomes `target` (Tolpegin et al., "Data
  Poisoning Attacks Against Federated Learning Systems", ESORICS 2020, §3). Both must be
  classes of every client's data: a run is refused at set-up otherwise
  (`check_named_classes`), not failed by every malicious client's training. A label mask
  (HeteroFL's label split) **follows the flipped labels**: the client trains with the
  classes its flipped data holds, so `target` is never masked out of its loss (the program
  receives its `ClientInfo` with `labels` of the flipped data).

Integer tensors (BatchNorm's `num_batches_tracked`) are uploaded as the honest pass left
them: they count steps, and a step count scaled by λ is no attack.

**Buffers.** Eq. 1 (Park and Joe-Wong, §3.1) poisons the model's *weights*, "manipulating
weights that are only updated by a few clients" (§1): a scaling attack (`fedfa-poison`,
`scaled-poison`, the backdoor's λ) scales the trainable parameters only by default, and
uploads the model's buffers (BatchNorm's running means and variances) as the honest pass
left them. `scale_buffers: true` scales them too, which can make running variances
negative: the server then refuses that client's upload (`hetfl.core.server.defences`,
`StatisticsGuard`). Which tensors are buffers is read from the structure of the model the
honest program trains (`buffer_names`), never from their names.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

import torch
from pydantic import Field, model_validator

from hetfl.attacks.malicious import Delegating, check_class
from hetfl.attacks.registry import register_attack
from hetfl.core.client.program import Program
from hetfl.core.client.trainable import trainable_names
from hetfl.core.kinds import KindOptions
from hetfl.core.model_cache import ModelCache
from hetfl.core.rng import sibling_generator
from hetfl.core.server_program import Channel
from hetfl.core.spec import Spec
from hetfl.core.types import ClientData, ClientInfo, ClientOutput, ClientTask, State

#: The purpose of the generator that shuffles a malicious client's labels.
ATTACK_PURPOSE = "attack"


#: The option of every scaling attack that says whether it scales the model's buffers.
SCALE_BUFFERS = Field(
    False,
    description="scale the model's buffers (BatchNorm running statistics) with the "
    "parameters; default: parameters only, as Eq. 1 poisons weights",
)


class PoisonOptions(KindOptions):
    """λ, the intensity of the poisoned update (FedFA §5 evaluates λ = 1 and λ = 20), and
    whether buffers are scaled too (module docstring)."""

    model_config = KindOptions.model_config | {"populate_by_name": True, "serialize_by_alias": True}

    lam: float = Field(
        alias="lambda", ge=0.0, allow_inf_nan=False, description="the poisoned update's weight"
    )
    scale_buffers: bool = SCALE_BUFFERS


class FlipOptions(KindOptions):
    source: int = Field(ge=0, description="the class whose training labels are flipped")
    target: int = Field(ge=0, description="the class they become")

    @model_validator(mode="after")
    def _distinct(self) -> FlipOptions:
        if self.source == self.target:
            raise ValueError(f"source and target are both {self.source}: nothing would flip")
        return self


def copy_generator(generator: torch.Generator) -> torch.Generator:
    """A generator in `generator`'s state, with its initial seed (hence its siblings)."""
    copy = torch.Generator(device=generator.device)
    copy.set_state(generator.get_state())
    return copy


def shuffled_labels(data: ClientData, generator: torch.Generator) -> ClientData:
    """`data` with its training labels permuted by the "attack" sibling of `generator`."""
    rng = sibling_generator(generator, ATTACK_PURPOSE)
    order = torch.randperm(data.n_train, generator=rng).to(data.y_train.device)
    return replace(data, y_train=data.y_train[order])


def buffer_names(program: Program, spec: Spec) -> frozenset[str]:
    """The state names of `spec`'s model that are not trainable parameters (BatchNorm's
    running statistics and counters), read from the model cache of the honest program (a
    `ClientProgram`), found through the programs standing in for it (their `honest`). A
    program without a model cache (a test double) names none: it has no model to read."""
    inner: object = program
    while not isinstance(models := getattr(inner, "models", None), ModelCache):
        inner = getattr(inner, "honest", None)
        if inner is None:
            return frozenset()
    template = models.model_for(spec)
    return frozenset(template.state_dict()) - trainable_names(template)


def poisoned_upload(
    received: Mapping[str, torch.Tensor],
    honest: Mapping[str, torch.Tensor],
    poisoned: Mapping[str, torch.Tensor],
    lam: float,
    *,
    keep_honest: bool,
    unscaled: Collection[str] = frozenset(),
) -> State:
    """Per uploaded tensor, r + (h − r) + λ·(p − r) (`keep_honest`, Eq. 1) or r + λ·(p − r);
    integer tensors and those named in `unscaled` (buffers) as `honest` has them. A tensor
    the client uploads without having received it is an error (there is no update to
    scale)."""
    out: State = {}
    for name, h in honest.items():
        if not h.is_floating_point() or name in unscaled:
            out[name] = h
            continue
        if name not in received:
            raise KeyError(
                f"the attack scales updates from the received model; {name!r} was not received"
            )
        r = received[name].to(h.device, h.dtype)
        step = lam * (poisoned[name] - r)
        out[name] = (r + (h - r) + step) if keep_honest else (r + step)
    return out


@dataclass
class PoisonedProgram(Delegating):
    """Eq. 1 (`keep_honest`) or the scaled poisoned update alone (module docstring)."""

    lam: float = 1.0
    keep_honest: bool = True
    scale_buffers: bool = False

    def fit(
        self,
        task: ClientTask,
        data: ClientData,
        private: Mapping[str, torch.Tensor],
        generator: torch.Generator,
        *,
        info: ClientInfo,
        channel: Channel | None = None,
    ) -> ClientOutput:
        same_order = copy_generator(generator)
        honest = self.honest.fit(task, data, private, generator, info=info, channel=channel)
        shuffled = shuffled_labels(data, same_order)
        poisoned = self.honest.fit(task, shuffled, private, same_order, info=info, channel=channel)
        tensors = poisoned_upload(
            task.payload,
            honest.result.tensors,
            poisoned.result.tensors,
            self.lam,
            keep_honest=self.keep_honest,
            unscaled=frozenset() if self.scale_buffers else buffer_names(self.honest, task.spec),
        )
        result = replace(
            honest.result, tensors=tensors, passes=honest.result.passes + poisoned.result.passes
        )
        return replace(honest, result=result)


@dataclass
class FlippedProgram(Delegating):
    """Label flipping, `source` -> `target` (module docstring)."""

    source: int = 0
    target: int = 1

    def fit(
        self,
        task: ClientTask,
        data: ClientData,
        private: Mapping[str, torch.Tensor],
        generator: torch.Generator,
        *,
        info: ClientInfo,
        channel: Channel | None = None,
    ) -> ClientOutput:
        for name, c in (("source", self.source), ("target", self.target)):
            check_class("label-flip", name, c, data)
        y = torch.where(data.y_train == self.source, self.target, data.y_train)
        flipped = replace(data, y_train=y)
        return self.honest.fit(
            task,
            flipped,
            private,
            generator,
            info=replace(info, labels=flipped.labels),
            channel=channel,
        )


@dataclass(frozen=True)
class Poison:
    """The wrapper of `fedfa-poison` and `scaled-poison`."""

    lam: float
    keep_honest: bool
    scale_buffers: bool = False

    def __call__(self, program: Program) -> Program:
        return PoisonedProgram(program, self.lam, self.keep_honest, self.scale_buffers)


@runtime_checkable
class NamesClasses(Protocol):
    """An attack whose options name classes of the data (`label-flip`'s `source` and
    `target`): `check_named_classes` refuses one the data lacks before the run starts."""

    def named_classes(self) -> dict[str, int]: ...


def check_named_classes(attack: NamesClasses, num_classes: Sequence[int], *, dataset: str) -> None:
    """ValueError, naming the option and the classes there are, unless every class the
    attack names is a class of every client's data (`num_classes`: the dataset's and each
    client's, whose view may hold fewer classes, relabelled 0..K-1)."""
    fewest = min(num_classes)
    for option, value in attack.named_classes().items():
        if value >= fewest:
            raise ValueError(
                f"attack.{option} = {value} is not a class of dataset {dataset!r} as every "
                f"client holds it (classes 0..{fewest - 1}); set attack.{option} to one of them"
            )


@dataclass(frozen=True)
class Flip:
    """The wrapper of `label-flip`."""

    source: int
    target: int

    def named_classes(self) -> dict[str, int]:
        return {"source": self.source, "target": self.target}

    def __call__(self, program: Program) -> Program:
        return FlippedProgram(program, self.source, self.target)


@register_attack("fedfa-poison", PoisonOptions)
def _fedfa_poison(options: PoisonOptions) -> Poison:
    return Poison(options.lam, keep_honest=True, scale_buffers=options.scale_buffers)


@register_attack("scaled-poison", PoisonOptions)
def _scaled_poison(options: PoisonOptions) -> Poison:
    return Poison(options.lam, keep_honest=False, scale_buffers=options.scale_buffers)


@register_attack("label-flip", FlipOptions)
def _label_flip(options: FlipOptions) -> Flip:
    return Flip(options.source, options.target)
