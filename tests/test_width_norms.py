"""The comparator options of the width-sliced methods (`hetfl.algorithms.parts.width_norms`,
HeteroFL's and FjORD's `norm`, HeteroFL's `scaler` and `default_clipping`): each norm
trains and evaluates the spec it names, the defaults are the methods' own, the scaler
divides by the width in training only (also without normalisation), per-capacity norms
evaluate only the levels some client trains, and settings that do not fit are refused."""

from __future__ import annotations

import pytest
import torch

from hetfl.algorithms import ALGORITHMS
from hetfl.config import ConfigError, validate
from hetfl.core.rng import torch_generator
from hetfl.core.training import LocalTraining
from hetfl.core.types import ClientInfo
from hetfl.models import ScalableFamily
from hetfl.models.slim import NoNorm

TRAIN = LocalTraining(lr=0.05, epochs=1, batch_size=16)


def _family() -> ScalableFamily:
    spec = {"family": "stage-cnn", "input_shape": (1, 8, 8), "num_classes": 4, "stages": 1}
    return ScalableFamily(spec)


def _infos(n: int, **attrs: float) -> list[ClientInfo]:
    return [ClientInfo(cid, 10, (1, 8, 8), (0, 1, 2, 3), attrs=dict(attrs)) for cid in range(n)]


def _built(algorithm: str, infos: list[ClientInfo], train: LocalTraining = TRAIN, **opts):
    strategy, _ = ALGORITHMS.get(algorithm).build(
        _family(), opts, clients_per_round=len(infos), train=train
    )
    state = strategy.setup(infos, torch_generator(0, 0, -1, "init"))
    tasks = strategy.plan(1, state, infos, torch_generator(0, 1, -1, "sample"))
    return strategy, state, tasks


@pytest.mark.parametrize(
    ("algorithm", "opts", "bn", "scaler", "evaluated_bn", "stats_pass"),
    [
        ("heterofl", {}, "static", True, "batch", True),  # the defaults: sBN, the scaler
        ("heterofl", {"norm": "none"}, "none", True, "none", False),
        ("heterofl", {"norm": "none", "scaler": False}, "none", False, "none", False),
        ("heterofl", {"norm": "per-capacity", "scaler": False}, "per-capacity", False, None, False),
        ("heterofl", {"norm": "per-width", "scaler": False}, "per-width", False, None, False),
        ("fjord", {}, "per-width", False, "per-width", False),  # the default
        ("fjord", {"norm": "static"}, "static", False, "batch", True),
        ("fjord", {"norm": "none"}, "none", False, "none", False),
    ],
)
def test_each_norm_trains_and_evaluates_the_spec_it_names(
    algorithm, opts, bn, scaler, evaluated_bn, stats_pass
) -> None:
    strategy, state, tasks = _built(algorithm, _infos(4), levels=(1.0, 0.5), **opts)
    assert {t.spec["bn"] for t in tasks} == {bn}
    assert {bool(t.spec["scaler"]) for t in tasks} == {scaler}
    conv_bias = "stages.0.conv.bias" in tasks[0].payload
    assert conv_bias == (bn == "none")  # no affine after the convolution: it keeps a bias
    models = strategy.eval_models(state)
    assert [m.name for m in models] == ["width=1", "width=0.5"]
    for m in models:
        assert m.spec["bn"] == (evaluated_bn or bn)
        assert m.stats_pass is stats_pass
        assert not m.spec["scaler"]  # the scaler acts in training only


def test_without_normalisation_the_scaler_divides_by_the_width_in_training_only() -> None:
    """HeteroFL's code keeps its scaler under `norm: none` (`models/conv.py`)."""
    x = torch.randn(2, 3, 4, 4)
    scaled = NoNorm(0.25, scaler=True)
    assert torch.equal(scaled.train()(x), x / 0.25)
    assert torch.equal(scaled.eval()(x), x)
    assert torch.equal(NoNorm(0.25).train()(x), x)
    _, _, tasks = _built("heterofl", _infos(2), levels=(1.0, 0.5), norm="none")
    model = _family().build(tasks[0].spec)
    norms = [m for m in model.modules() if isinstance(m, NoNorm)]
    assert norms and all(m.scaler and m.ratio == 0.5 for m in norms)


def test_per_capacity_norms_evaluate_only_the_levels_some_client_trains() -> None:
    """Declared capacities 0.5 and 1 among levels 1/4, 1/2, 1: level 1/4 has no
    normalisation tensors, so it is not evaluated (static BN evaluates every level)."""
    infos = _infos(2)
    options = {"levels": (0.25, 0.5, 1.0), "assignment": "declared", "capacities": (0.5, 1.0)}
    strategy, state, tasks = _built("heterofl", infos, norm="per-capacity", **options)
    assert [m.name for m in strategy.eval_models(state)] == ["width=1", "width=0.5"]
    norm_entries = {e.global_name for e in tasks[0].index_map if ".norm." in e.local}
    assert norm_entries and all(n.startswith("cap0.5/") for n in norm_entries)
    static, state, _ = _built("heterofl", infos, **options)
    assert [m.name for m in static.eval_models(state)] == ["width=1", "width=0.5", "width=0.25"]


@pytest.mark.parametrize(("default_clipping", "set_by_train", "runs"), [
    (True, None, 1.0), (False, None, None), (False, 0.5, 0.5), (True, 0.5, 0.5),
])  # fmt: skip
def test_heterofl_default_clipping_can_be_switched_off(default_clipping, set_by_train, runs):
    train = LocalTraining(lr=0.05, clip_grad_norm=set_by_train)
    strategy, _, tasks = _built(
        "heterofl", _infos(2), train, levels=(1.0,), default_clipping=default_clipping
    )
    assert [t.config.clip_grad_norm for t in tasks] == [runs, runs]
    assert strategy.describe()["clip_grad_norm"] == runs


def test_settings_that_do_not_fit_are_refused_at_the_config_edge() -> None:
    raw = {"algorithm": "heterofl", "model": {"name": "stage-cnn"}}
    with pytest.raises(ConfigError, match=r"norm 'per-width' .* takes no scaler; set scaler: fa"):
        validate({**raw, "options": {"heterofl": {"norm": "per-width"}}})
    validate({**raw, "options": {"heterofl": {"norm": "per-width", "scaler": False}}})
    with pytest.raises(ConfigError, match=r"options\.fjord\.norm.*'static', 'per-width', 'per-c"):
        validate({**raw, "algorithm": "fjord", "options": {"fjord": {"norm": "group"}}})
    with pytest.raises(ConfigError, match=r"options\.fjord\.scaler: unknown key \(allowed: "):
        validate({**raw, "algorithm": "fjord", "options": {"fjord": {"scaler": False}}})


def test_declared_capacities_give_a_client_unknown_at_set_up_no_level() -> None:
    """Under `declared`, only a declared capacity sets a level: a client that joins after
    set-up is an error naming it (the other modes give it the widest level)."""
    options = {"levels": (0.5, 1.0), "assignment": "declared"}
    strategy, _, _ = _built("heterofl", _infos(2, capacity=0.5), **options)
    stranger = ClientInfo(7, 10, (1, 8, 8), (0, 1), attrs={"capacity": 1.0})
    with pytest.raises(ValueError, match=r"assignment 'declared': client 7 was not among the"):
        strategy.assignment.spec_of(stranger)
    fixed, _, _ = _built("heterofl", _infos(2), levels=(0.5, 1.0))
    assert fixed.assignment.spec_of(stranger)["widths"][0] == 1.0
