"""The lr's plateau rule: a hand-made accuracy series, PyTorch's ReduceLROnPlateau as an
independent reference, its place in a strategy's task settings and checkpoints, and the
config errors."""

from __future__ import annotations

import math

import pytest
import torch

from hetfl.config import validate
from hetfl.core.plateau import PlateauLr, PlateauSettings
from hetfl.core.schedule import LrSchedule
from hetfl.core.training import LocalTraining
from hetfl.models import make_family
from strategies import fedavg

FAMILY = make_family("mlp", (4,), 3)


def _factors(series, **settings):
    rule = PlateauLr(PlateauSettings(monitor="global_acc", **settings))
    out = []
    for rnd, acc in enumerate(series, start=1):
        rule.observe(rnd, {"global_acc": acc, "val_acc": None})
        out.append(rule.factor)
    return out


def test_a_hand_made_series_cuts_after_more_than_patience_bad_rounds():
    # patience 2: the third round in a row without a 1 % relative gain cuts by 0.5
    series = [0.50, 0.505, 0.504, 0.60, 0.601, 0.60, 0.59, 0.58, 0.58, 0.7]
    # best:    .50   .50    .50    .60   .60    .60   .60   .60   .60  .70
    # bad:      0     1      2      0     1      2     3->0  1     2    0
    want = [1, 1, 1, 1, 1, 1, 0.5, 0.5, 0.5, 0.5]
    assert _factors(series, factor=0.5, patience=2, threshold=0.01) == want


def test_the_rule_matches_pytorchs_reduce_lr_on_plateau():
    g = torch.Generator().manual_seed(3)  # a noisy rising series with plateaus
    series = (torch.cumsum(torch.rand(60, generator=g) - 0.45, 0) / 20).clamp(0, 1).tolist()
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=1.0)
    ref = torch.optim.lr_scheduler.ReduceLROnPlateau(
        opt, mode="max", factor=0.9, patience=3, threshold=1e-4
    )
    want = []
    for acc in series:
        ref.step(acc)
        want.append(opt.param_groups[0]["lr"])
    got = _factors(series, patience=3)
    assert got == pytest.approx(want, rel=1e-12)
    assert min(got) < 0.8  # the series does cut, several times


def test_tasks_carry_the_schedule_times_the_plateau_factor_and_no_plateau():
    schedule = LrSchedule("step", milestones=(2,), gamma=0.5)
    plateau = PlateauSettings(monitor="val_acc", factor=0.5, patience=0)
    train = LocalTraining(lr=0.2, lr_schedule=schedule, lr_plateau=plateau)
    strategy = fedavg(FAMILY, clients_per_round=1, train=train)
    assert strategy._task_config(1, None).lr == pytest.approx(0.2)
    strategy.observe(1, {"val_acc": 0.5})
    strategy.observe(2, {"val_acc": 0.5})  # no gain, patience 0: cut
    task = strategy._task_config(3, None)
    assert task.lr == pytest.approx(0.2 * 0.5 * 0.5)
    assert task.lr_plateau is None and task.lr_schedule == LrSchedule()
    # the rule's state is the strategy's extra state, and a fresh strategy takes it back
    kept = strategy.extra_state()
    assert kept["lr_plateau"] == {"best": 0.5, "bad_rounds": 0, "factor": 0.5}
    again = fedavg(FAMILY, clients_per_round=1, train=train)
    again.load_extra_state(kept)
    assert again._task_config(3, None).lr == task.lr


def test_without_a_plateau_the_lr_is_the_schedules_alone():
    strategy = fedavg(FAMILY, clients_per_round=1, train=LocalTraining(lr=0.3))
    strategy.observe(1, {"val_acc": None, "global_acc": 0.1})
    assert strategy._task_config(2, None).lr == 0.3 and "lr_plateau" not in strategy.extra_state()


def test_a_metric_the_run_does_not_compute_is_an_error():
    rule = PlateauLr(PlateauSettings(monitor="val_acc"))
    with pytest.raises(ValueError, match=r"monitors val_acc.*data\.validation"):
        rule.observe(1, {"val_acc": None})
    with pytest.raises(ValueError, match="monitors val_acc"):
        rule.observe(1, {"val_acc": math.nan})


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"monitor": "loss"}, "monitor must be one of"),
        ({"factor": 1.0}, r"factor must be in \(0, 1\)"),
        ({"patience": -1}, "patience must be >= 0"),
        ({"threshold": math.inf}, "threshold must be a finite number"),
    ],
)
def test_bad_settings_name_the_field(settings, message):
    with pytest.raises(ValueError, match=message):
        PlateauSettings(**settings)


def _config(**train):
    return {"algorithm": "fedavg", "train": {"lr_plateau": train}}


def test_config_errors_name_the_fixes():
    with pytest.raises(ValueError, match=r"data.validation.*monitor to global_acc"):
        validate(_config(monitor="val_acc"))
    with pytest.raises(ValueError, match=r"eval\.every to 1"):
        validate({**_config(monitor="global_acc"), "eval": {"every": 2}})
    cfg = validate({**_config(), "data": {"validation": 0.1}})
    assert cfg.train.local_training().lr_plateau == PlateauSettings()
    assert validate(_config(monitor="global_acc")).train.lr_plateau.settings().describe() == (
        "x0.9 after 10 evaluated rounds without a 0.0001 relative gain in global_acc "
        "(test accuracy, as the DTFL paper does: the test set steers training)"
    )
