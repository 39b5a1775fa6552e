"""Parts chosen by kind: the reducer a method reduces with (`options.<method>.reducer`) and the
client-program wrappers (`wrappers:`), each an open registry of kinds with typed options
(`hetfl.core.kinds`). The syntax at the config edge (new form, bare name, the earlier
`trim:` refused, unknown kinds, bad options), a kind registered from outside, what the run's
outputs record, and the rule that a wrapper pickles."""

from __future__ import annotations

import pickle
from dataclasses import dataclass

import pytest
import torch
from pydantic import Field, ValidationError

from hetfl.algorithms import ALGORITHMS
from hetfl.assembly import chosen_parts
from hetfl.attacks.registry import ATTACKS
from hetfl.config import ConfigError, validate
from hetfl.core.client.program import Programs, check_picklable
from hetfl.core.client.wrappers import WRAPPERS, register_wrapper
from hetfl.core.kinds import Chosen, KindOptions, choose
from hetfl.core.server.reducers import REDUCERS, register_reducer
from hetfl.core.server.robust import CoordinateReducer
from hetfl.core.spec import MapEntry, prefix_index
from hetfl.core.state import Accumulator
from hetfl.models import make_family
from hetfl.runner import _chosen

ONE = [MapEntry("v", "v", prefix_index(1))]


def _reduced(chosen: Chosen, values: list[float], weights: list[float]) -> float:
    """One element reduced by the chosen reducer from clients sending `values`."""
    ref = {"v": torch.zeros(1)}
    reducer = chosen.build()(ref)
    for x, w in zip(values, weights, strict=True):
        reducer.add({"v": torch.tensor([x])}, ONE, weight=w)
    return reducer.result(ref)["v"].item()


def _options(reducer: object) -> object:
    return ALGORITHMS.get("fedavg").options(reducer=reducer)


def _config_error(options: dict) -> str:
    with pytest.raises(ConfigError) as err:
        validate({"algorithm": "fedavg", "options": {"fedavg": options}})
    return str(err.value)


# -- the reducer option -----------------------------------------------------------------------
def test_the_new_form_the_bare_name_and_the_default():
    """Five clients send 1, 2, 4, 8, 100 with weights 1, 1, 1, 1, 4: the weighted mean is
    415 / 8, the median 4, the 0.2-trimmed mean (2 + 4 + 8) / 3."""
    values, weights = [1.0, 2.0, 4.0, 8.0, 100.0], [1.0, 1.0, 1.0, 1.0, 4.0]
    trimmed = _options({"kind": "trimmed-mean", "trim": 0.2}).reducer
    assert trimmed.describe() == {"kind": "trimmed-mean", "trim": 0.2}
    assert _reduced(trimmed, values, weights) == pytest.approx(14 / 3, abs=1e-6)
    for form in ("median", {"kind": "median"}):
        median = _options(form).reducer
        assert median.describe() == {"kind": "median"}
        assert _reduced(median, values, weights) == 4.0
    mean = ALGORITHMS.get("fedavg").options().reducer
    assert mean.describe() == {"kind": "mean"} and mean.build() is Accumulator
    assert _reduced(mean, values, weights) == pytest.approx(415 / 8, abs=1e-5)


def test_the_earlier_trim_key_is_refused_with_the_new_form():
    message = _config_error({"reducer": "trimmed-mean", "trim": 0.1})
    assert "options.fedavg: trim is an option of the trimmed-mean reducer" in message
    assert "write reducer: {kind: trimmed-mean, trim: 0.1}" in message


def test_an_unknown_kind_lists_the_known_ones():
    message = _config_error({"reducer": {"kind": "bulyan", "f": 2}})
    assert "options.fedavg.reducer: unknown reducer 'bulyan'" in message
    assert (
        "(allowed: coverage-krum, coverage-median, coverage-multi-krum, "
        "coverage-trimmed-mean, krum, mean, median, multi-krum, norm-clip, trained-norm-clip, "
        "trimmed-mean)"
    ) in message


@pytest.mark.parametrize(
    ("reducer", "expected"),
    [
        (
            {"kind": "trimmed-mean", "trim": 0.6},
            "reducer 'trimmed-mean': trim = 0.6: Input should be less than or equal to 0.5",
        ),
        (
            {"kind": "trimmed-mean", "trim": -0.1},
            "trim = -0.1: Input should be greater than or equal to 0",
        ),
        ({"kind": "trimmed-mean"}, "reducer 'trimmed-mean': trim is required (options: trim)"),
        (
            {"kind": "median", "trim": 0.1},
            "reducer 'median': trim is not one of its options (options: none)",
        ),
        (3, "a reducer is chosen by its kind, as {kind: <name>, ...its options}"),
        (
            {"trim": 0.1},
            "(kinds: coverage-krum, coverage-median, coverage-multi-krum, coverage-trimmed-mean, "
            "krum, mean, median, multi-krum, norm-clip, trained-norm-clip, trimmed-mean); "
            "got {'trim': 0.1}",
        ),
    ],
)
def test_bad_reducer_options_name_the_option_the_value_and_the_rule(reducer, expected):
    message = _config_error({"reducer": reducer})
    assert "options.fedavg.reducer: " in message and expected in message


def test_a_kind_registered_from_outside_is_chosen_like_the_built_in_ones(monkeypatch):
    """A toy `bulyan` (here: the smallest value) registers with its own options, without editing
    the registry's module; the registry is restored afterwards."""
    monkeypatch.setattr(REDUCERS, "_entries", dict(REDUCERS._entries))

    class KrumOptions(KindOptions):
        f: int = Field(ge=0)

    built = []

    @register_reducer("bulyan", KrumOptions, summaries={"bulyan": "toy"})
    def _krum(options: KrumOptions):
        built.append(options.f)
        return lambda reference: CoordinateReducer(reference, lambda v, k: v[0])

    opts = _options({"kind": "bulyan", "f": 2})
    assert opts.reducer.describe() == {"kind": "bulyan", "f": 2}
    assert _reduced(opts.reducer, [5.0, 3.0, 9.0], [1.0, 1.0, 1.0]) == 3.0  # smallest
    assert built == [2]
    assert "f = -1: Input should be greater than or equal to 0" in _config_error(
        {"reducer": {"kind": "bulyan", "f": -1}}
    )
    with pytest.raises(ValueError, match="reducer 'bulyan' is already registered"):
        register_reducer("bulyan", KrumOptions, summaries={"bulyan": "toy"})(_krum)
    with pytest.raises(KeyError, match=r"reducer 'toy-krum' has no summary in hetfl\.catalogue"):
        register_reducer("toy-krum", KrumOptions)(_krum)


def test_the_outputs_name_the_reducer_that_runs():
    opts = _options({"kind": "trimmed-mean", "trim": 0.1})
    info = chosen_parts(opts, [])
    assert info == {"reducer": {"kind": "trimmed-mean", "trim": 0.1}}
    assert _chosen(info) == ["  reducer: trimmed-mean (trim 0.1)"]
    assert _chosen(chosen_parts(_options("median"), [])) == ["  reducer: median"]
    # a method that reduces nothing names no reducer
    assert chosen_parts(ALGORITHMS.get("local-only").options(), []) == {}


# -- client-program wrappers ------------------------------------------------------------------
class ScaleOptions(KindOptions):
    factor: float = Field(gt=0)


@dataclass(frozen=True)
class ScaledSends:
    """A toy wrapper, defined at module level as the rule asks: it returns its factor with
    the program it wrapped."""

    factor: float

    def __call__(self, program):
        return (self.factor, program)


def _scaled(options: ScaleOptions) -> ScaledSends:
    return ScaledSends(options.factor)


def _local_class(options: KindOptions):
    class Local:
        def __call__(self, program):
            return program

    return Local()


@pytest.fixture
def toy_wrappers(monkeypatch):
    """`scale` and `local` registered for one test; the registry is restored after it."""
    monkeypatch.setattr(WRAPPERS, "_entries", dict(WRAPPERS._entries))
    toy = {"scale": "toy", "local": "toy"}
    register_wrapper("scale", ScaleOptions, summaries=toy)(_scaled)
    register_wrapper("local", summaries=toy)(_local_class)


def test_configured_wrappers_are_built_in_order_and_written_back(toy_wrappers):
    raw = {"wrappers": [{"kind": "scale", "factor": 3}, {"kind": "scale", "factor": 2}]}
    cfg = validate(raw)
    assert [w.build() for w in cfg.wrappers] == [ScaledSends(3.0), ScaledSends(2.0)]
    written = cfg.model_dump(mode="json")["wrappers"]
    assert written == [{"kind": "scale", "factor": 3.0}, {"kind": "scale", "factor": 2.0}]
    assert validate({"wrappers": written}).wrappers == cfg.wrappers
    assert chosen_parts(ALGORITHMS.get("local-only").options(), cfg.wrappers) == {
        "wrappers": written
    }
    family = make_family("linear", (4,), 3)
    programs = Programs(family, seed=0, wrappers=[w.build() for w in cfg.wrappers])
    # the last wrapper is applied last: it wraps what the first returned
    outer, (inner, honest) = programs.program_for(5)
    assert (outer, inner, honest.cid) == (2.0, 3.0, 5)
    with pytest.raises(ConfigError, match=r"wrappers\.0: client-program wrapper 'scale': factor"):
        validate({"wrappers": [{"kind": "scale", "factor": 0}]})


def test_an_unknown_attack_lists_the_registered_ones():
    with pytest.raises(
        ValueError, match=r"unknown attack 'flip' \(allowed: .*fedfa-poison.*label-flip"
    ):
        choose(ATTACKS, "flip")


def test_a_wrapper_that_cannot_be_pickled_is_refused_with_its_name(toy_wrappers):
    family = make_family("linear", (4,), 3)
    local = validate({"wrappers": ["local"]}).wrappers[0].build()
    for wrapper, name in [
        (local, "test_kinds._local_class.<locals>.Local"),
        (lambda p: p, "test_kinds.test_a_wrapper_that_cannot_be_pickled_is_refused_with"),
    ]:
        with pytest.raises(ValueError, match="cannot be pickled") as err:
            Programs(family, seed=0, wrappers=[ScaledSends(1.0), wrapper])
        assert f"client-program wrapper {name}" in str(err.value)
        assert "define the wrapper (and the program it returns) at module level" in str(err.value)
    check_picklable(ScaledSends(1.0))  # the module-level one passes, and round-trips
    assert pickle.loads(pickle.dumps(ScaledSends(1.0))) == ScaledSends(1.0)


def test_options_are_validated_once_at_the_edge():
    """The validated record is what methods receive: a `Chosen` passed back is kept as is,
    and the options are frozen."""
    chosen = choose(REDUCERS, {"kind": "trimmed-mean", "trim": 0.1})
    assert _options(chosen).reducer is chosen
    with pytest.raises(ValidationError):
        chosen.options.trim = 0.2  # type: ignore[attr-defined]
