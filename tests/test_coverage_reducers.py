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
    naming 1 of the 2 reduced elements (50 %, in w); the run's next reduction warns no more."""
    factory = _factory("coverage-trimmed-mean", fraction=0.4)
    with pytest.warns(UserWarning, match=r"1 of the model's 2 reduced elements \(50 %, in w\)"):
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
    with pytest.warns(UserWarning, match=r"\(50 %, in w\)"):
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


# -- coverage-aware Krum -------------------------------------------------------------------------
#: Clients 0, 1, 2 cover both elements of w, clients 3 and 4 element 0 only: two cells.
KRUM_UPLOADS = [
    ([0.0, 10.0], 2),
    ([1.0, 11.0], 2),
    ([2.0, 12.0], 2),
    ([0.5], 1),
    ([1.5], 1),
]


def _krum(kind: str, uploads, **options):
    reducer = _factory(kind, **options)(REFERENCE)
    for values, width in uploads:
        imap = [MapEntry("w", "w", prefix_index(width))]
        reducer.add({"w": torch.tensor(values)}, imap, 1.0)
    out = reducer.result(REFERENCE)["w"]
    return out, reducer.decisions.per_client


def test_coverage_krum_scores_each_cell_then_combines_by_hand():
    """f = 0: a client's cell score sums the squared distances to its k − 2 nearest.
    Cell {0..4} (element 0, values 0 1 2 .5 1.5): scores 3.5 1.5 3.5 1.5 1.5, median 1.5,
    normalised 7/3 1 7/3 1 1. Cell {0, 1, 2} (element 1, values 10 11 12, 1 nearest): 1 1 1,
    median 1. Combined over one element each: 5/3 1 5/3 (wide), 1 1 (narrow). Krum keeps
    client 1 (the earliest of the lowest); Multi-Krum m = 3 keeps 1, 3 and 4."""
    from hetfl.core.server.cell_krum import cell_scores
    from hetfl.core.server.robust import HeldClients

    held = HeldClients(REFERENCE)
    for values, width in KRUM_UPLOADS:
        held.add({"w": torch.tensor(values)}, [MapEntry("w", "w", prefix_index(width))])
    expected = torch.tensor([5 / 3, 1.0, 5 / 3, 1.0, 1.0], dtype=torch.float64)
    assert torch.allclose(cell_scores(held, 0), expected, rtol=0, atol=1e-15)
    out, kept = _krum("coverage-krum", KRUM_UPLOADS, f=0)
    assert kept == ["dropped", "kept", "dropped", "dropped", "dropped"]
    assert torch.equal(out, torch.tensor([1.0, 11.0]))
    out, kept = _krum("coverage-multi-krum", KRUM_UPLOADS, f=0, m=3)
    assert kept == ["dropped", "kept", "dropped", "kept", "kept"]
    assert torch.equal(out, torch.tensor([1.0, 11.0]))  # element 0: mean(1, .5, 1.5)


def test_coverage_krum_does_not_pick_by_width_where_the_naive_one_does():
    """A clean federation of a 10-element w: on element 0, which all cover, the narrow
    clients 3 and 4 sit among the wide ones (0.5 and 1.5 between 0, 1, 2); the wide clients
    cover 9 more elements, where they agree closely (10, 10.25, 10.5). The naive mean
    squared difference over shared elements shrinks the wide pairs' distances (0.15625,
    0.625 against 0.25 from a narrow client to its neighbours): its scores 1.03 0.56 1.03
    1.5 1.5 keep the three wide clients (m = 3) and drop both narrow ones. Within cells the
    narrow ones score 1, as the middle wide client does (1, against 34/30 for the outer
    ones), and are kept."""
    reference = {"w": torch.zeros(10)}
    wide = [[0.0, *[10.0] * 9], [1.0, *[10.25] * 9], [2.0, *[10.5] * 9]]
    uploads = [*((w, 10) for w in wide), ([0.5], 1), ([1.5], 1)]
    decided = {}
    for kind in ("multi-krum", "coverage-multi-krum"):
        reducer = _factory(kind, f=0, m=3)(reference)
        for values, width in uploads:
            imap = [MapEntry("w", "w", prefix_index(width))]
            reducer.add({"w": torch.tensor(values)}, imap, 1.0)
        reducer.result(reference)
        decided[kind] = reducer.decisions.per_client
    assert decided["multi-krum"] == ["kept", "kept", "kept", "dropped", "dropped"]
    assert decided["coverage-multi-krum"] == ["dropped", "kept", "dropped", "kept", "kept"]


# -- the breakdown count -------------------------------------------------------------------------
def _label_split(factory, body: int):
    """Ten clients: all cover `body` (k = 10); `head` (10 rows of 4) is label-split: rows 0-4
    by every client, row 5 + c % 5 by client c only (k = 2 each); `edge`'s element 0 by
    clients 0-3 (k = 4), its element 1 by clients 0-4 (k = 5); `unused` by none."""
    zeros = {"body": torch.zeros(body), "head": torch.zeros(10, 4), "edge": torch.zeros(2)}
    reference = {**zeros, "unused": torch.zeros(3)}
    reducer = factory(reference)
    for c in range(10):
        rows = torch.zeros(10, 4)
        rows[:5] = 1
        rows[5 + c % 5] = 1
        edge = torch.tensor([float(c < 4), float(c < 5)])
        imap = [
            MapEntry("body", "body"),
            MapEntry("head", "head", mask=rows),
            MapEntry("edge", "edge", mask=edge),
        ]
        reducer.add(zeros, imap, 1.0)
    return reducer, reference


@pytest.mark.parametrize(
    "kind, options",
    [
        ("coverage-trimmed-mean", {"fraction": 0.2}),
        ("coverage-median", {"fraction": 0.2}),
        ("coverage-krum", {"f": 2}),
    ],
)
def test_the_breakdown_count_and_its_warning_are_a_hand_count(kind: str, options: dict):
    """A = ceil(0.2 · 10) = 2 (or f = 2): an element is beyond where k <= 4. By hand: the 5
    label-split rows x 4 columns = 20 elements and `edge`'s element 0 (k = 4, at the bound;
    element 1, k = 5, is not), 21 of the 100,000 + 40 + 2 covered (`unused` is covered by no
    one: not reduced), a share of 21 / 100,042 = 0.020991 %, printed with three significant
    digits (the one-decimal "0.0%" said nothing), with its count and tensors."""
    from hetfl.core.server.robust import Beyond

    reducer, reference = _label_split(_factory(kind, **options), 100_000)
    with pytest.warns(UserWarning) as caught:
        reducer.result(reference)
    (message,) = [str(w.message) for w in caught]
    assert "21 of the model's 100,042 reduced elements (0.021 %, in edge, head)" in message
    expected = Beyond(elements=21, covered=100_042, attackers=2, tensors=("edge", "head"))
    assert reducer.beyond == expected
    assert reducer.beyond.share == 21 / 100_042


def test_without_elements_beyond_the_count_is_zero_and_nothing_warns():
    """Fraction 0: A = 0, and every covered element has k >= 1 > 2A: none of the 10 + 40 + 2
    covered elements is beyond, and nothing warns."""
    reducer, reference = _label_split(_factory("coverage-median", fraction=0.0), 10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reducer.result(reference)
    assert reducer.beyond is not None
    assert (reducer.beyond.elements, reducer.beyond.covered) == (0, 52)
