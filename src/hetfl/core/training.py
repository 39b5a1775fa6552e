"""Local-training settings: one typed, frozen record, built once at the config edge.

`hetfl.config.TrainConfig.local_training()` builds the run's `LocalTraining`; a strategy
takes it as its `train` argument and sends each client a copy changed with
`dataclasses.replace` (this round's lr from the schedule, a method's own setting such as
HeteroFL's default clipping or ScalableFL's weight-decay exemption); the client program
reads the task's record as it is. The defaults live here and nowhere else: the config's
fields take theirs from this record (`default_of`).

A record is a dataclass, so a setting it does not have is an error naming it
(`LocalTraining(mu=0.1)` raises `TypeError: ... unexpected keyword argument 'mu'`), in
code, in a decoded message (`hetfl.deploy.codec`) and in the config (pydantic, extra keys
forbidden). Methods keep their own settings (FedProx's mu, FedALRC's alpha) in their own
typed options, not here.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any, Literal

from hetfl.core.plateau import PlateauSettings
from hetfl.core.schedule import LrSchedule


@dataclass(frozen=True)
class LocalTraining:
    """Local optimisation settings, carried in `ClientTask.config`.

    `steps`, when set, is the number of mini-batches and overrides `epochs`. `optimizer`
    is SGD (PyTorch's semantics for `momentum` and `weight_decay`), Adam or AMSGrad
    (`torch.optim.Adam`'s, with `betas`, `eps` and L2 `weight_decay`; DTFL trains with
    them); `hetfl.core.client.optim` runs them. `momentum` is SGD's and `betas`/`eps` Adam's:
    setting one for the other optimiser is an error. The optimiser's state is fresh each
    round; with `keep_momentum` the client keeps it between its rounds as private state
    (the names of `hetfl.core.client.optim`): HetFL's flag, since no paper says
    whether its local optimiser state survives a round (HeteroFL's, FLANC's and FedNova's
    official code reset it). `decay_norm_and_bias=False`
    exempts normalisation tensors and biases from `weight_decay`, so that in HetFL's models
    only convolution and linear weights decay (ScalableFL, Table VIII).

    `lr_schedule` scales `lr` by round (`hetfl.core.schedule`); the strategy applies it, so
    a task's record holds that round's lr and a constant schedule (`for_round`).
    `lr_plateau`, when set, also cuts the lr on a plateau of an evaluated accuracy
    (`hetfl.core.plateau`): the strategy keeps that rule's state and multiplies its factor
    in; a task's record holds the result and no plateau.
    """

    lr: float = 0.05
    lr_schedule: LrSchedule = field(default_factory=LrSchedule)
    epochs: int = 1
    steps: int | None = None
    batch_size: int = 32
    optimizer: Literal["sgd", "adam", "amsgrad"] = "sgd"
    momentum: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    keep_momentum: bool = False
    weight_decay: float = 0.0
    clip_grad_norm: float | None = None
    decay_norm_and_bias: bool = True
    lr_plateau: PlateauSettings | None = None

    def __post_init__(self) -> None:
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a positive finite number, got {self.lr}")
        if not isinstance(self.lr_schedule, LrSchedule):
            raise TypeError(
                f"lr_schedule must be an LrSchedule, got {type(self.lr_schedule).__name__}"
            )
        if self.lr_plateau is not None and not isinstance(self.lr_plateau, PlateauSettings):
            raise TypeError(
                f"lr_plateau must be PlateauSettings or None, got {type(self.lr_plateau).__name__}"
            )
        if self.epochs < 1 and self.steps is None:
            raise ValueError(f"epochs must be >= 1, got {self.epochs}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        self._check_optimizer()
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise ValueError(f"weight_decay must be a finite number >= 0, got {self.weight_decay}")
        if self.clip_grad_norm is not None and not (
            self.clip_grad_norm > 0 and math.isfinite(self.clip_grad_norm)
        ):
            raise ValueError(f"clip_grad_norm must be > 0 when set, got {self.clip_grad_norm}")

    def _check_optimizer(self) -> None:
        """The optimiser is known and given only its own settings."""
        if self.optimizer not in ("sgd", "adam", "amsgrad"):
            raise ValueError(
                f"optimizer must be 'sgd', 'adam' or 'amsgrad', got {self.optimizer!r}"
            )
        if self.optimizer == "sgd":
            adam_set = [
                f"{k}={getattr(self, k)}"
                for k in ("betas", "eps")
                if getattr(self, k) != default_of(LocalTraining, k)
            ]
            if adam_set:
                raise ValueError(
                    f"{', '.join(adam_set)} set for optimizer 'sgd': betas and eps are Adam's "
                    "settings; use optimizer 'adam' or 'amsgrad', or leave them unset"
                )
            if self.keep_momentum and self.momentum == 0:
                raise ValueError("keep_momentum needs momentum > 0 (there is no buffer to keep)")
            return
        if self.momentum != 0:
            raise ValueError(
                f"momentum={self.momentum} set for optimizer {self.optimizer!r}: momentum is "
                "SGD's setting (Adam's moments follow betas); leave it at 0"
            )
        if not (len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas)):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas}")
        if not (self.eps > 0 and math.isfinite(self.eps)):
            raise ValueError(f"eps must be a positive finite number, got {self.eps}")

    def for_round(
        self, round: int, rounds: int | None, plateau_factor: float = 1.0
    ) -> LocalTraining:
        """The settings of round `round` of `rounds`: lr times the schedule's factor (and
        times `plateau_factor`, the plateau rule's, when it is not 1), with the schedule
        and the plateau spent, so that no reader applies them twice."""
        lr = self.lr * self.lr_schedule.factor(round, rounds)
        if plateau_factor != 1.0:
            lr *= plateau_factor
        return replace(self, lr=lr, lr_schedule=LrSchedule(), lr_plateau=None)

    def num_steps(self, n_train: int) -> int:
        if self.steps is not None:
            return self.steps
        return self.epochs * math.ceil(n_train / self.batch_size)


def default_of(record: type, name: str) -> Any:
    """The default of field `name` of dataclass `record`, so that a config can take its
    defaults from the record instead of writing them a second time."""
    for f in fields(record):
        if f.name == name:
            if f.default is MISSING:
                raise KeyError(f"{record.__name__}.{name} has no default")
            return f.default
    raise KeyError(f"{record.__name__} has no field {name!r}")
