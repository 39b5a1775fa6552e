"""The coverage-aware coordinate-wise rules (issue 50, item 1): `coverage-trimmed-mean` and
`coverage-median` by hand beside their naive baselines, on a federation where the widest
elements are covered by fewer clients; the breakdown warning, once, naming the share of
elements where attackers can be half or more of the coverage."""

from __future__ import annotations

import warnings

import pytest
import torch

from hetfl.config import ConfigError, validate
from hetfl.core.kinds import choose
from hetfl.core.server.reducers import REDUCERS
from hetfl.core.spec import MapEntry, prefix_index

REFERENCE = {"w": torch.zeros(2)}
#: Five clients: element 0 covered by all, element 1 by the three wide ones (0, 1, 2).
UPLOADS = [
    ([1.0, 10.0], 2),
    ([2.0, 20.0], 2),
    ([100.0, 90.0], 2),
    ([3.0], 1),
    ([4.0], 1),
]


def _reduce(factory) -> torch.Tensor:
    reducer = factory(REFERENCE)
    for values, width in UPLOADS:
        imap = [MapEntry("w", "w", prefix_index(width))]
        reducer.add({"w": torch.tensor(values)}, imap, 1.0)
    return reducer.result(REFERENCE)["w"]


def _factory(kind: str, **options):
    return choose(REDUCERS, {"kind": kind, **options}).build()


def test_the_trim_follows_each_elements_coverage_where_the_naive_one_trims_nothing():
    """Fraction 0.2 of n = 5: A = ceil(1.0) = 1 attacker may be anywhere. Element 0 (k = 5,
    values 1 2 3 4 100): drop 1 at each end, mean(2, 3, 4) = 3, as the naive 0.2-trimmed
    mean (floor(0.2·5) = 1). Element 1 (k = 3, values 10 20 90): the coverage-aware rule
    drops min(1, 3) = 1 at each end, 20; the naive one floor(0.2·3) = 0, the mean 40."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # k = 3 > 2A = 2 everywhere: no breakdown
        aware = _reduce(_factory("coverage-trimmed-mean", fraction=0.2))
    assert torch.equal(aware, torch.tensor([3.0, 20.0]))
    naive = _reduce(_factory("trimmed-mean", trim=0.2))
    assert torch.equal(naive, torch.tensor([3.0, 40.0]))


def test_beyond_the_breakdown_point_the_median_is_taken_and_a_warning_given_once():
    """Fraction 0.4 of n = 5: A = 2. Element 0 (k = 5 > 4): drop 2 at each end, 3. Element
    1 (k = 3 <= 2A): attackers may be half or more of it: the median, 20, and a warning
    naming 50.0 % of the reduced elements (1 of 2); the run's next reduction warns no more."""
    factory = _factory("coverage-trimmed-mean", fraction=0.4)
    with pytest.warns(UserWarning, match=r"50\.0% of the model's reduced elements .* 2 "):
        assert torch.equal(_reduce(factory), torch.tensor([3.0, 20.0]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _reduce(factory)


def test_the_coverage_median_is_the_median_with_the_breakdown_warning():
    """Element 0: median(1, 2, 3, 4, 100) = 3; element 1: median(10, 20, 90) = 20."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(
            _reduce(_factory("coverage-median", fraction=0.2)), torch.tensor([3.0, 20.0])
        )
    with pytest.warns(UserWarning, match=r"50\.0%"):
        _reduce(_factory("coverage-median", fraction=0.4))


def test_a_fraction_of_zero_is_the_plain_unweighted_mean():
    assert torch.equal(
        _reduce(_factory("coverage-trimmed-mean", fraction=0.0)), torch.tensor([22.0, 40.0])
    )


@pytest.mark.parametrize("fraction", [0.5, -0.1])
def test_a_fraction_outside_0_to_one_half_is_refused(fraction: float):
    reducer = {"kind": "coverage-trimmed-mean", "fraction": fraction}
    with pytest.raises(ConfigError, match="fraction"):
        validate({"algorithm": "fedavg", "options": {"fedavg": {"reducer": reducer}}})
