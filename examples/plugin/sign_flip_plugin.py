"""An attack plugin: the sign flip. A malicious client trains honestly, then uploads its
update reversed and scaled,

    upload = received − λ · (trained − received),

the sign-flipping attack of the experiments of Li et al., "RSA: Byzantine-Robust Stochastic
Aggregation Methods for Distributed Learning from Heterogeneous Datasets" (AAAI 2019). It
registers one name, `sign-flip`, with its option `lambda`, through `hetfl.api`; a config
applies it to its malicious clients:

    plugins: [./sign_flip_plugin.py]
    attack: {kind: sign-flip, fraction: 0.2, lambda: 5}

Only the trainable parameters are flipped: the model's buffers (BatchNorm's running
statistics, integer counters) are uploaded as trained, as HetFL's own scaling attacks do by
default; `buffer_names` reads which they are from the model the honest program trains. The
attack is a frozen dataclass and the program it returns a module-level class: the process
executor pickles both (docs/contracts.md §1.3).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from pydantic import Field

from hetfl.api import KindOptions, buffer_names, register_attack


class SignFlipOptions(KindOptions):
    model_config = KindOptions.model_config | {"populate_by_name": True, "serialize_by_alias": True}

    lam: float = Field(alias="lambda", gt=0.0, description="how far the update is reversed")


@dataclass
class SignFlipped:
    """The honest program `honest`, its upload's trained parameters flipped about the
    received model."""

    honest: Any
    lam: float

    def __post_init__(self) -> None:
        self.cid, self.device = self.honest.cid, self.honest.device

    def fit(self, task, data, private, generator, *, info, channel=None):
        out = self.honest.fit(task, data, private, generator, info=info, channel=channel)
        buffers = buffer_names(self.honest, task.spec)
        upload = {}
        for name, trained in out.result.tensors.items():
            if trained.is_floating_point() and name not in buffers:
                received = task.payload[name].to(trained.device, trained.dtype)
                trained = received - self.lam * (trained - received)
            upload[name] = trained
        return replace(out, result=replace(out.result, tensors=upload))

    def evaluate(self, task, data, private, models):
        return self.honest.evaluate(task, data, private, models)


@dataclass(frozen=True)
class SignFlip:
    """The attack: `SignFlipped` around a malicious client's honest program."""

    lam: float

    def __call__(self, program):
        return SignFlipped(program, self.lam)


@register_attack(
    "sign-flip",
    SignFlipOptions,
    summary="the update reversed and scaled: received - lambda x update [example plugin]",
)
def _sign_flip(options: SignFlipOptions) -> SignFlip:
    return SignFlip(options.lam)
