"""The robust reducers (coordinate-wise median and trimmed mean) against hand-computed tensors
and a slow per-element NumPy loop.

Expected values are written out literally or computed in the test with plain float64
arithmetic over the values that cover each element; nothing asks the code under test for its
own expectations.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from hetfl.core.kinds import choose
from hetfl.core.server.reducers import REDUCERS
from hetfl.core.server.robust import CoordinateReducer, median, trimmed_mean
from hetfl.core.spec import MapEntry, prefix_index
from hetfl.core.state import Accumulator


def _vec(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def _prefix(n: int, name: str = "v") -> list[MapEntry]:
    return [MapEntry(name, name, prefix_index(n))]


def _reduce(statistic, clients, reference, fill="keep"):
    """Add `(local, index_map, weight)` triples in order and return the result."""
    reducer = CoordinateReducer(reference, statistic)
    for local, imap, weight in clients:
        reducer.add(local, imap, weight=weight)
    return reducer.result(reference, fill=fill)


def _prefix_clients() -> list:
    """Slices [:2], [:3], [:4] of a 4-vector: coverage 3, 3, 2, 1 from the left."""
    return [
        ({"v": _vec(1, 2)}, _prefix(2), 1.0),
        ({"v": _vec(30, 40, 50)}, _prefix(3), 1.0),
        ({"v": _vec(6, 7, 8, 9)}, _prefix(4), 1.0),
    ]


# -- median -----------------------------------------------------------------------------------
def test_median_over_overlapping_prefixes_odd_and_even_coverage():
    out = _reduce(median, _prefix_clients(), {"v": torch.zeros(4)})
    # element 0: {1, 30, 6} -> 6; 1: {2, 40, 7} -> 7; 2: {50, 8} -> 29 (mean of the two);
    # 3: {9} -> 9
    assert torch.equal(out["v"], _vec(6, 7, 29, 9))


def test_median_of_an_even_count_is_the_mean_of_the_two_middle_values():
    clients = [({"v": _vec(x)}, _prefix(1), 1.0) for x in (10.0, 1.0, 4.0, 2.0)]
    assert torch.equal(_reduce(median, clients, {"v": torch.zeros(1)})["v"], _vec(3))


def test_repeated_local_name_counts_once_with_the_mean_of_its_values():
    # The client's tensor [10, 20] lands on v[0:2] and on v[1:3]: in global coordinates it is
    # [10, mean(20, 10), 20] = [10, 15, 20], one value per element.
    repeat = (
        {"a": _vec(10, 20)},
        [MapEntry("a", "v", (slice(0, 2),)), MapEntry("a", "v", (slice(1, 3),))],
        1.0,
    )
    alone = _reduce(median, [repeat], {"v": torch.zeros(3)})
    assert torch.equal(alone["v"], _vec(10, 15, 20))
    others = [({"v": _vec(1, 1, 1)}, _prefix(3), 1.0), ({"v": _vec(2, 2, 2)}, _prefix(3), 1.0)]
    # element 1: {15, 1, 2} -> 2 (counted twice, {10, 20, 1, 2} would give 6)
    out = _reduce(median, [repeat, *others], {"v": torch.zeros(3)})
    assert torch.equal(out["v"], _vec(2, 2, 2))


def test_masked_elements_do_not_cover():
    masked = (
        {"v": _vec(100, 100, 100)},
        [MapEntry("v", "v", mask=torch.tensor([1.0, 0.0, 1.0]))],
        1.0,
    )
    others = [({"v": _vec(1, 1, 1)}, _prefix(3), 1.0), ({"v": _vec(2, 2, 2)}, _prefix(3), 1.0)]
    out = _reduce(median, [masked, *others], {"v": torch.zeros(3)})
    # element 1 sees {1, 2} -> 1.5; elements 0 and 2 see {100, 1, 2} -> 2
    assert torch.equal(out["v"], _vec(2, 1.5, 2))


def test_zero_weight_does_not_cover_and_other_weights_are_ignored():
    ref = {"v": torch.zeros(2), "u": torch.zeros(1)}
    clients = [
        ({"v": _vec(100, 100), "u": _vec(100)}, [MapEntry("v", "v"), MapEntry("u", "u")], 0.0),
        ({"v": _vec(1, 1)}, [MapEntry("v", "v")], 1.0),
        ({"v": _vec(2, 3)}, [MapEntry("v", "v")], 1000.0),
    ]
    out = _reduce(median, clients, ref)
    assert torch.equal(out["v"], _vec(1.5, 2))  # the weight-0 client is out, 1000 counts as 1
    assert torch.equal(out["u"], _vec(0))  # nobody covered u: kept
    # a per-name mapping without the name weighs 0 too
    per_name = [({"v": _vec(100, 100)}, [MapEntry("v", "v")], {"other": 1.0}), *clients[1:]]
    assert torch.equal(_reduce(median, per_name, ref)["v"], _vec(1.5, 2))


def test_two_dim_tensor_with_an_index_tensor_entry():
    ref = {"w": torch.zeros(3, 2)}
    rows = MapEntry("w", "w", (torch.tensor([2, 0]), slice(0, 1)))  # w[[2, 0], :1]
    clients = [
        ({"w": torch.tensor([[50.0], [70.0]])}, [rows], 1.0),
        ({"w": torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])}, [MapEntry("w", "w")], 1.0),
        ({"w": torch.tensor([[9.0, 8.0], [7.0, 6.0], [4.0, 3.0]])}, [MapEntry("w", "w")], 1.0),
    ]
    out = _reduce(median, clients, ref)
    # w[0,0]: {70, 1, 9} -> 9; w[2,0]: {50, 5, 4} -> 5; the rest have the two full clients
    expected = torch.tensor([[9.0, 5.0], [5.0, 5.0], [5.0, 4.5]])
    assert torch.equal(out["w"], expected)


@pytest.mark.parametrize(
    ("fill", "expected_v", "expected_u"),
    [("keep", [5.0, 7.0, 8.0, 9.0], [3.0]), ("zero", [5.0, 7.0, 0.0, 0.0], [0.0])],
)
def test_fill_keep_or_zero_for_uncovered_elements_and_tensors(fill, expected_v, expected_u):
    ref = {"v": _vec(0, 0, 8, 9), "u": _vec(3)}
    clients = [({"v": _vec(4, 6)}, _prefix(2), 1.0), ({"v": _vec(6, 8)}, _prefix(2), 1.0)]
    out = _reduce(median, clients, ref, fill=fill)
    assert torch.equal(out["v"], torch.tensor(expected_v))
    assert torch.equal(out["u"], torch.tensor(expected_u))


def test_integer_tensor_is_reduced_in_float64_and_rounded_once():
    ref = {"n": torch.tensor([0, 0, 0], dtype=torch.int64)}
    # The repeated name gives [2, mean(3, 2), 3] = [2, 2.5, 3] before any rounding.
    repeat = (
        {"c": torch.tensor([2, 3])},
        [MapEntry("c", "n", (slice(0, 2),)), MapEntry("c", "n", (slice(1, 3),))],
        1.0,
    )
    other = ({"n": torch.tensor([5, 3, 4])}, [MapEntry("n", "n")], 1.0)
    out = _reduce(median, [repeat, other], ref)
    # [(2+5)/2, (2.5+3)/2, (3+4)/2] = [3.5, 2.75, 3.5] rounded half to even -> [4, 3, 4]
    # (rounding 2.5 to 2 first would give 2.5 -> 2 in the middle)
    assert out["n"].dtype == torch.int64
    assert torch.equal(out["n"], torch.tensor([4, 3, 4]))


def test_scale_multiplies_the_clients_values():
    reducer = CoordinateReducer({"v": torch.zeros(1)}, median)
    reducer.add({"v": _vec(1)}, _prefix(1), scale={"v": 10.0})
    reducer.add({"v": _vec(3)}, _prefix(1), scale={"other": 10.0})
    assert torch.equal(reducer.result({"v": torch.zeros(1)})["v"], _vec(6.5))  # (10 + 3) / 2


# -- trimmed mean -----------------------------------------------------------------------------
def test_trimmed_mean_drops_floor_of_trim_times_k_at_each_end():
    ref = {"v": torch.zeros(2)}
    four = [({"v": _vec(a, b)}, _prefix(2), 1.0) for a, b in ((1, 1), (2, 2), (3, 4), (10, 8))]
    only_second = [
        ({"v": _vec(0, b)}, [MapEntry("v", "v", mask=_vec(0, 1))], 1.0) for b in (16, 100)
    ]
    out = _reduce(trimmed_mean(0.3), [*four, *only_second], ref)
    # element 0: {1, 2, 3, 10}, t = floor(1.2) = 1 -> mean(2, 3) = 2.5;
    # element 1: {1, 2, 4, 8, 16, 100}, t = floor(1.8) = 1 -> mean(2, 4, 8, 16) = 7.5
    assert torch.equal(out["v"], _vec(2.5, 7.5))


def test_trimmed_mean_without_a_value_left_falls_back_to_the_median():
    ref = {"v": torch.zeros(2)}
    four = [({"v": _vec(x, x)}, _prefix(2), 1.0) for x in (1, 2, 3, 10)]
    fifth = ({"v": _vec(0, 7)}, [MapEntry("v", "v", mask=_vec(0, 1))], 1.0)
    out = _reduce(trimmed_mean(0.5), [*four, fifth], ref)
    # element 0: k = 4, t = 2, k - 2t = 0 -> median 2.5; element 1: k = 5, t = 2 -> 3
    assert torch.equal(out["v"], _vec(2.5, 3))


def test_trimmed_mean_with_trim_zero_is_the_unweighted_mean():
    ref = {"v": torch.zeros(4)}
    out = _reduce(trimmed_mean(0.0), _prefix_clients(), ref)
    acc = Accumulator(ref)
    for local, imap, _ in _prefix_clients():
        acc.add(local, imap, weight=1.0)
    assert torch.equal(out["v"], acc.result(ref)["v"])
    assert torch.equal(out["v"], _vec(37 / 3, 49 / 3, 29, 9))


# -- both -------------------------------------------------------------------------------------
def test_an_outlier_moves_the_mean_but_not_the_median_or_trimmed_mean():
    ref = {"v": torch.zeros(1)}
    clients = [({"v": _vec(x)}, _prefix(1), 1.0) for x in (1.0, 1.5, 2.0, 2.5, 1e6)]
    acc = Accumulator(ref)
    for local, imap, w in clients:
        acc.add(local, imap, weight=w)
    assert acc.result(ref)["v"].item() > 1e5
    assert torch.equal(_reduce(median, clients, ref)["v"], _vec(2))
    assert torch.equal(_reduce(trimmed_mean(0.2), clients, ref)["v"], _vec(2))  # mean(1.5, 2, 2.5)


def _random_clients(seed: int, n: int) -> list:
    """Clients with random prefixes and masks of a (5, 3) tensor and random values."""
    gen = torch.Generator().manual_seed(seed)
    clients = []
    for _ in range(n):
        rows, cols = (int(torch.randint(1, s + 1, (1,), generator=gen)) for s in (5, 3))
        mask = (torch.rand(rows, cols, generator=gen) > 0.2).float()
        value = torch.randn(rows, cols, generator=gen)
        clients.append(({"w": value}, [MapEntry("w", "w", prefix_index(rows, cols), mask)], 1.0))
    return clients


def _numpy_reference(clients, reference, trim):
    """Per element: sort the covering values, drop floor(trim k) at each end, average in
    float64 (median where nothing is left); uncovered elements keep the reference."""
    out = reference.to(torch.float64).numpy().copy()
    for i, j in itertools.product(range(out.shape[0]), range(out.shape[1])):
        values = []
        for local, imap, _ in clients:
            entry = imap[0]
            rows, cols = local["w"].shape
            if i < rows and j < cols and entry.mask[i, j] != 0:
                values.append(float(local["w"][i, j]))
        if not values:
            continue
        values.sort()
        t = int(np.floor(trim * len(values)))
        kept = values[t : len(values) - t]
        out[i, j] = np.mean(kept) if kept else np.median(values)
    return torch.from_numpy(out).to(reference.dtype)


@pytest.mark.parametrize("trim", [0.0, 0.2, 0.5])
def test_trimmed_mean_equals_a_per_element_numpy_loop(trim):
    ref = {"w": torch.full((5, 3), -1.0)}
    clients = _random_clients(0, 7)
    expected = _numpy_reference(clients, ref["w"], trim)
    assert torch.equal(_reduce(trimmed_mean(trim), clients, ref)["w"], expected)


def test_median_equals_numpy_median_per_element():
    ref = {"w": torch.full((5, 3), -1.0)}
    clients = _random_clients(1, 6)
    expected = _numpy_reference(clients, ref["w"], 0.5)  # trim 0.5 leaves the median
    assert torch.equal(_reduce(median, clients, ref)["w"], expected)


@pytest.mark.parametrize("statistic", [median, trimmed_mean(0.25)], ids=["median", "trimmed"])
def test_client_order_does_not_change_the_result_bit_for_bit(statistic):
    ref = {"w": torch.zeros(5, 3)}
    clients = _random_clients(2, 4)
    first = _reduce(statistic, clients, ref)["w"]
    for order in itertools.permutations(clients):
        assert torch.equal(_reduce(statistic, list(order), ref)["w"], first)


# -- errors -----------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_bad_weight_raises(bad):
    reducer = CoordinateReducer({"v": torch.zeros(2)}, median)
    with pytest.raises(ValueError, match="aggregation weight for 'v'"):
        reducer.add({"v": _vec(1, 2)}, _prefix(2), weight=bad)


def test_unknown_names_and_shapes_raise_as_in_the_accumulator():
    reducer = CoordinateReducer({"v": torch.zeros(2)}, median)
    with pytest.raises(KeyError, match="global tensor 'x' is not in the global state"):
        reducer.add({"v": _vec(1)}, [MapEntry("v", "x")], weight=0.0)
    with pytest.raises(KeyError, match="client result has no tensor 'u'"):
        reducer.add({"v": _vec(1)}, [MapEntry("u", "v")])
    with pytest.raises(ValueError, match="has shape"):
        reducer.add({"v": _vec(1, 2, 3)}, _prefix(2))
    with pytest.raises(ValueError, match="fill must be 'keep' or 'zero', got 'none'"):
        reducer.result({"v": torch.zeros(2)}, fill="none")  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [-0.1, 0.51, float("nan")])
def test_trim_outside_zero_to_half_raises(bad):
    with pytest.raises(ValueError, match=r"trim must be a fraction in \[0, 0.5\], got"):
        trimmed_mean(bad)
    with pytest.raises(ValueError, match=r"reducer 'trimmed-mean': trim = .*: Input should be"):
        choose(REDUCERS, {"kind": "trimmed-mean", "trim": bad})


def test_registered_reducers_reduce_as_named():
    ref = {"v": torch.zeros(1)}
    clients = [({"v": _vec(x)}, _prefix(1), w) for x, w in ((1.0, 1.0), (2.0, 1.0), (9.0, 2.0))]

    def run(value: object) -> float:
        reducer = choose(REDUCERS, value).build()(ref)
        for local, imap, w in clients:
            reducer.add(local, imap, weight=w)
        return reducer.result(ref)["v"].item()

    assert run("mean") == 21.0 / 4  # weighted: (1 + 2 + 18) / 4
    assert run({"kind": "median"}) == 2.0
    assert run({"kind": "trimmed-mean", "trim": 0.34}) == 2.0  # t = 1 of 3
    assert run({"kind": "trimmed-mean", "trim": 0.0}) == 4.0  # unweighted: 12 / 3
