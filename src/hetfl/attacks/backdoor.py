"""The trigger backdoor: a malicious client teaches the model to classify any image carrying
a small pixel patch as the attacker's `target` class, while it keeps classifying clean images
as before.

Gu, Dolan-Gavitt and Garg, "BadNets: Identifying Vulnerabilities in the Machine Learning
Model Supply Chain" (2017), §4: training images stamped with a pattern of bright pixels at
the bottom-right corner and relabelled to the target class (the trigger,
`hetfl.attacks.trigger`). Bagdasaryan et al., "How To Backdoor Federated Learning" (AISTATS
2020), §4: in FL the attacker mixes backdoored samples into every batch of its local
training, beside correctly labelled ones (here `poison_fraction` of each batch, default 0.5),
and may boost its update by a factor (§4.2, model replacement, γ = n/η there): the upload is

    received + λ · (backdoored − received)

with λ (`lambda`) = 1, the default, plain backdoored training (the trained tensors are sent
as they are). The boost scales the trainable parameters only, the buffers (BatchNorm's
running statistics) uploaded as trained, unless `scale_buffers: true`
(`hetfl.attacks.poisoning`, "Buffers").

Per mini-batch, round(poison_fraction · B) samples, halves rounded up (0.5 of a batch of 5
is 3), are chosen by a permutation drawn from a sibling of the client's training generator
(purpose "attack", `hetfl.core.rng.sibling_generator`), one draw per batch in step order: the
choice is reproducible and does not depend on the order clients run in. The chosen samples
get the trigger stamped on their stored pixels (after the geometric augmentation, before
standardisation, `hetfl.core.types.ClientData.train_batch`) and the label `target`; the
other samples train honestly. The batches themselves, their order and the augmentation draws
are the honest client's. A label mask (HeteroFL's label split) **follows the poisoned
labels**: the program gets its `ClientInfo` with `target` among its labels, so the target
logit is never masked out of the loss, whether or not a batch poisoned any sample.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from pydantic import Field, model_validator

from hetfl.attacks.malicious import Delegating, check_class
from hetfl.attacks.poisoning import ATTACK_PURPOSE, SCALE_BUFFERS, buffer_names, poisoned_upload
from hetfl.attacks.registry import register_attack
from hetfl.attacks.trigger import Trigger
from hetfl.core.client.program import Program
from hetfl.core.kinds import KindOptions
from hetfl.core.rng import sibling_generator
from hetfl.core.server_program import Channel
from hetfl.core.types import ClientData, ClientInfo, ClientOutput, ClientTask


class BackdoorOptions(KindOptions):
    """The trigger (`patch`, `target`), the share of each batch it is planted in and λ."""

    model_config = KindOptions.model_config | {"populate_by_name": True, "serialize_by_alias": True}

    target: int = Field(ge=0, description="the class triggered images should be classified as")
    poison_fraction: float = Field(
        0.5,
        gt=0.0,
        le=1.0,
        allow_inf_nan=False,
        description="the share of each batch stamped and relabelled (rounded half up)",
    )
    patch: int = Field(3, ge=1, description="the side, in pixels, of the bottom-right patch")
    lam: float = Field(
        1.0,
        alias="lambda",
        ge=0.0,
        allow_inf_nan=False,
        description="the boost of the backdoored update (1: plain backdoored training)",
    )
    scale_buffers: bool = SCALE_BUFFERS

    @model_validator(mode="before")
    @classmethod
    def _target_given(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and "target" not in data:
            raise ValueError(
                "attack.target is required: the class that images carrying the trigger should "
                "be classified as (e.g. target: 0)"
            )
        return data


def poisoned_count(batch: int, fraction: float) -> int:
    """round(fraction · batch), halves up: 0.5 of 5 samples is 3, 0.3 of 5 is 2."""
    return min(batch, math.floor(fraction * batch + 0.5))


@dataclass(frozen=True)
class TriggerStamp:
    """A malicious client's `BatchPoison` (`hetfl.core.types`): in each batch,
    `poisoned_count` samples drawn from `generator` get `trigger` and its target label."""

    trigger: Trigger
    fraction: float
    generator: torch.Generator

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = int(y.shape[0])
        chosen = torch.randperm(n, generator=self.generator)[: poisoned_count(n, self.fraction)]
        chosen = chosen.to(y.device)
        x, y = x.clone(), y.clone()
        x[chosen] = self.trigger.stamp(x[chosen])
        y[chosen] = self.trigger.target
        return x, y


@dataclass
class BackdooredProgram(Delegating):
    """Backdoored local training, its update boosted by `lam` (module docstring)."""

    trigger: Trigger
    fraction: float
    lam: float
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
        target = self.trigger.target
        check_class("backdoor", "target", target, data)
        stamp = TriggerStamp(
            self.trigger, self.fraction, sibling_generator(generator, ATTACK_PURPOSE)
        )
        labels = tuple(sorted({*info.labels, target}))
        out = self.honest.fit(
            task,
            replace(data, poison=stamp),
            private,
            generator,
            info=replace(info, labels=labels),
            channel=channel,
        )
        if self.lam == 1.0:
            return out
        trained = out.result.tensors
        unscaled = frozenset() if self.scale_buffers else buffer_names(self.honest, task.spec)
        boosted = poisoned_upload(
            task.payload, trained, trained, self.lam, keep_honest=False, unscaled=unscaled
        )
        return replace(out, result=replace(out.result, tensors=boosted))


@dataclass(frozen=True)
class Backdoor:
    """The wrapper of `backdoor`; its `trigger` is what `attack_success` is measured with
    (`hetfl.attacks.trigger.PlantsTrigger`)."""

    trigger: Trigger
    fraction: float
    lam: float
    scale_buffers: bool = False

    def __call__(self, program: Program) -> Program:
        return BackdooredProgram(program, self.trigger, self.fraction, self.lam, self.scale_buffers)


@register_attack("backdoor", BackdoorOptions)
def _backdoor(options: BackdoorOptions) -> Backdoor:
    trigger = Trigger(options.patch, options.target)
    return Backdoor(trigger, options.poison_fraction, options.lam, options.scale_buffers)
