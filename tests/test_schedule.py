"""Learning-rate schedules by round, against hand-computed factors, and how a strategy
puts them into its tasks."""

from __future__ import annotations

import math

import pytest
import yaml

from hetfl.algorithms import ALGORITHMS
from hetfl.config import ConfigError, validate
from hetfl.core.rng import torch_generator
from hetfl.core.schedule import LrSchedule
from hetfl.core.training import LocalTraining
from hetfl.core.types import ClientInfo
from hetfl.models import PlainFamily


def factors(schedule: LrSchedule, rounds: int | None, at: list[int]) -> list[float]:
    return [schedule.factor(r, rounds) for r in at]


def test_cosine_runs_from_one_towards_zero_over_the_run():
    assert factors(LrSchedule("cosine"), 10, [1, 6, 10]) == pytest.approx(
        [1.0, 0.5, (1 + math.cos(math.pi * 0.9)) / 2]
    )


def test_steps_at_fractions_of_the_run_fedalrc():
    """FedALRC: x0.1 from just past 50 % of the rounds, x0.01 from just past 75 %."""
    s = LrSchedule("step", milestones=(0.5, 0.75), gamma=0.1)
    assert factors(s, 100, [1, 50, 51, 75, 76, 100]) == pytest.approx([1, 1, 0.1, 0.1, 0.01, 0.01])


def test_steps_at_rounds_need_no_run_length_heterofl():
    s = LrSchedule("step", milestones=(150, 250), gamma=0.1)
    assert factors(s, None, [150, 151, 250, 251]) == pytest.approx([1, 0.1, 0.1, 0.01])


def test_exponential_decays_once_per_round():
    assert factors(LrSchedule("exponential", gamma=0.998), None, [1, 3]) == pytest.approx(
        [1.0, 0.998**2]
    )


def test_warmup_ramps_linearly_then_the_schedule_applies():
    """ScalableFL's detection schedule: warm-up over 4 % of the rounds, then steps."""
    s = LrSchedule("step", milestones=(0.7, 0.9), gamma=0.1, warmup=0.04)
    assert factors(s, 100, [1, 2, 4, 5, 70, 71, 91]) == pytest.approx(
        [0.25, 0.5, 1, 1, 1, 0.1, 0.01]
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "step"}, "needs milestones"),
        ({"kind": "step", "milestones": (0.5, 10)}, "either all rounds"),
        ({"kind": "step", "milestones": (10.5,)}, "either all rounds"),
        ({"kind": "step", "milestones": (0.75, 0.5)}, "increasing"),
        ({"kind": "cosine", "milestones": (0.5,)}, "for a step schedule"),
        ({"kind": "cosine", "gamma": 0}, "gamma"),
        ({"kind": "cosine", "warmup": 1.0}, "warmup"),
        ({"kind": "linear"}, "unknown lr schedule"),
    ],
)
def test_bad_schedules_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LrSchedule(**kwargs)


def test_a_schedule_by_fraction_needs_the_run_length():
    with pytest.raises(ValueError, match="needs the planned number of rounds"):
        LrSchedule("cosine").factor(3, None)


def test_every_task_of_a_round_carries_that_rounds_lr():
    family = PlainFamily("mlp", (1, 2, 2), 3)
    train = LocalTraining(lr=0.2, steps=1, lr_schedule=LrSchedule("step", (0.5,)))
    strategy, _ = ALGORITHMS.get("fedprox").build(
        family, {"mu": 0.1}, clients_per_round=2, train=train
    )
    infos = [ClientInfo(c, 10, (1, 2, 2), (0, 1, 2)) for c in range(2)]
    state = strategy.setup(infos, torch_generator(0, 0, -1, "init"), rounds=4)
    lrs = [
        [t.config.lr for t in strategy.plan(r, state, infos, torch_generator(0, r, -1, "s"))]
        for r in (2, 3)
    ]
    assert lrs == [[0.2, 0.2], pytest.approx([0.02, 0.02])]
    assert all(
        t.config.lr_schedule == LrSchedule()
        for t in strategy.plan(3, state, infos, torch_generator(0, 3, -1, "s"))
    )


def test_the_config_checks_the_schedule_at_the_edge():
    raw = yaml.safe_load("train: {lr_schedule: {kind: step, milestones: [0.5, 20]}}")
    with pytest.raises(ConfigError, match="either all rounds"):
        validate(raw)
    ok = validate(yaml.safe_load("train: {lr_schedule: {kind: cosine, warmup: 0.1}}"))
    assert ok.train.local_training().lr_schedule == LrSchedule("cosine", warmup=0.1)
