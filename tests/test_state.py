"""Extraction and aggregation through index maps against hand-computed tensors.

Expected values are written out literally or computed with plain float64 arithmetic in the
test itself; nothing here asks the code under test for its own expectations.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from hetfl.core.spec import MapEntry, Spec, full_map, prefix_index, selected_shape
from hetfl.core.state import Accumulator, clone_state, extract, state_bytes


def _gen(seed: int) -> torch.Generator:
    """A private generator for the test's own random literals (never the global RNG)."""
    return torch.Generator().manual_seed(seed)


def _grid() -> torch.Tensor:
    """The 4x3 global tensor [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]."""
    return torch.arange(12, dtype=torch.float32).reshape(4, 3)


# -- extract ----------------------------------------------------------------------------------
def test_extract_prefix_slices():
    g = {"w": _grid(), "b": torch.tensor([1.0, 2.0, 3.0, 4.0])}
    imap = [MapEntry("w", "w", prefix_index(2, 2)), MapEntry("b", "b", prefix_index(3))]
    out = extract(g, imap)
    assert set(out) == {"w", "b"}
    assert torch.equal(out["w"], torch.tensor([[0.0, 1.0], [3.0, 4.0]]))
    assert torch.equal(out["b"], torch.tensor([1.0, 2.0, 3.0]))


def test_extract_none_keeps_dimension_whole():
    out = extract({"w": _grid()}, [MapEntry("w", "w", prefix_index(None, 1))])
    assert torch.equal(out["w"], torch.tensor([[0.0], [3.0], [6.0], [9.0]]))


def test_extract_index_tensor_on_dim0():
    out = extract({"w": _grid()}, [MapEntry("w", "w", (torch.tensor([0, 2]),))])
    assert torch.equal(out["w"], torch.tensor([[0.0, 1.0, 2.0], [6.0, 7.0, 8.0]]))


def test_extract_index_tensors_on_two_dims_select_a_mesh():
    # rows {1, 3} x columns {0, 2}: an open mesh, not pointwise pairs
    out = extract(
        {"w": _grid()}, [MapEntry("w", "w", (torch.tensor([1, 3]), torch.tensor([0, 2])))]
    )
    assert torch.equal(out["w"], torch.tensor([[3.0, 5.0], [9.0, 11.0]]))


def test_extract_index_tensor_mixed_with_slice():
    out = extract({"w": _grid()}, [MapEntry("w", "w", (slice(1, 3), torch.tensor([2, 0])))])
    assert torch.equal(out["w"], torch.tensor([[5.0, 3.0], [8.0, 6.0]]))


@pytest.mark.parametrize(
    "index",
    [(), prefix_index(2, 2), (torch.tensor([0, 2]),)],
    ids=["whole", "prefix", "index-tensor"],
)
def test_extract_returns_copies(index):
    g = {"w": _grid()}
    out = extract(g, [MapEntry("w", "w", index)])
    out["w"].fill_(-100.0)
    assert torch.equal(g["w"], _grid())


def test_extract_repeated_local_name_reads_its_first_entry():
    g = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([7.0, 8.0])}
    imap = [MapEntry("x", "b"), MapEntry("x", "a")]
    out = extract(g, imap)
    assert list(out) == ["x"]
    assert torch.equal(out["x"], torch.tensor([7.0, 8.0]))


def test_extract_missing_global_name_is_key_error():
    with pytest.raises(KeyError, match="nope"):
        extract({"w": _grid()}, [MapEntry("w", "nope")])


# -- accumulator: overlapping prefix slices -------------------------------------------------------
def _overlap_clients():
    a = torch.tensor([[10.0, 20.0], [30.0, 40.0]])
    b = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    acc = Accumulator({"w": _grid()})
    acc.add({"w": a}, [MapEntry("w", "w", prefix_index(2, 2))], weight=3)
    acc.add({"w": b}, [MapEntry("w", "w", prefix_index(3, 3))], weight=7)
    return acc, a, b


def test_overlapping_slices_fill_keep_every_element():
    acc, _, _ = _overlap_clients()
    out = acc.result({"w": _grid()}, fill="keep")["w"]
    # overlap [:2, :2] = (3a + 7b) / 10; B-only = b; row 3 untouched = previous (9, 10, 11)
    expected = torch.tensor(
        [
            [(3 * 10 + 7 * 1) / 10, (3 * 20 + 7 * 2) / 10, 3.0],
            [(3 * 30 + 7 * 4) / 10, (3 * 40 + 7 * 5) / 10, 6.0],
            [7.0, 8.0, 9.0],
            [9.0, 10.0, 11.0],
        ],
        dtype=torch.float32,
    )
    assert out.dtype == torch.float32
    assert torch.equal(out, expected)


def test_overlapping_slices_fill_zero_every_element():
    acc, _, _ = _overlap_clients()
    out = acc.result({"w": _grid()}, fill="zero")["w"]
    expected = torch.tensor(
        [[3.7, 7.4, 3.0], [11.8, 15.5, 6.0], [7.0, 8.0, 9.0], [0.0, 0.0, 0.0]],
        dtype=torch.float32,
    )
    assert torch.equal(out, expected)


def test_covered_reports_total_weight_per_element():
    acc, _, _ = _overlap_clients()
    cov = acc.covered("w")
    expected = torch.tensor(
        [[10.0, 10.0, 7.0], [10.0, 10.0, 7.0], [7.0, 7.0, 7.0], [0.0, 0.0, 0.0]],
        dtype=torch.float64,
    )
    assert torch.equal(cov, expected)
    assert acc.covered("other") is None


def test_untouched_tensor_keep_or_zero():
    prev = {"w": _grid(), "v": torch.tensor([5.0, 6.0])}
    acc = Accumulator(prev)
    acc.add({"w": torch.ones(4, 3)}, [MapEntry("w", "w")], weight=1.0)
    keep = acc.result(prev, fill="keep")
    zero = acc.result(prev, fill="zero")
    assert torch.equal(keep["v"], torch.tensor([5.0, 6.0]))
    assert torch.equal(zero["v"], torch.tensor([0.0, 0.0]))
    assert torch.equal(keep["w"], torch.ones(4, 3))
    # the kept tensor is a copy, not the previous tensor itself
    keep["v"].fill_(0.0)
    assert torch.equal(prev["v"], torch.tensor([5.0, 6.0]))


def test_index_tensor_selector_aggregates_into_the_selected_rows():
    prev = {"w": _grid()}
    acc = Accumulator(prev)
    rows = torch.tensor([[100.0, 101.0, 102.0], [200.0, 201.0, 202.0]])
    acc.add({"w": rows}, [MapEntry("w", "w", (torch.tensor([3, 1]),))], weight=2.0)
    acc.add({"w": torch.full((2, 3), 1.0)}, [MapEntry("w", "w", prefix_index(2))], weight=2.0)
    out = acc.result(prev)["w"]
    expected = torch.tensor(
        [
            [1.0, 1.0, 1.0],  # client 2 only
            [100.5, 101.0, 101.5],  # (200, 201, 202) and 1, equal weights
            [6.0, 7.0, 8.0],  # nobody: previous
            [100.0, 101.0, 102.0],  # client 1 only
        ]
    )
    assert torch.equal(out, expected)


# -- per-name weights and scales -------------------------------------------------------------------
def _numpy_reference(shape, previous, entries):
    """Per-element weighted averages by a plain loop over every local element in float64:
    `entries` are (local values, per-dimension positions, weight, scale, mask or None)."""
    total, count = np.zeros(shape), np.zeros(shape)
    for x, positions, w, s, mask in entries:
        x = x.double().numpy()
        for local in np.ndindex(x.shape):
            g = tuple(int(positions[d][i]) for d, i in enumerate(local))
            m = w * (1.0 if mask is None else float(mask[local]))
            total[g] += x[local] * m * s
            count[g] += m
    return np.where(count > 0, total / np.where(count > 0, count, 1.0), previous.double().numpy())


def test_index_tensors_with_repeats_equal_a_float64_loop():
    """Repeated positions in two dimensions, a slice in the third, two clients, a mask and a
    scale. Values, weights and scales are multiples of 1/16 with few digits, so every float64
    sum is exact in any order and the comparison is exact."""
    shape = (5, 4, 3)
    previous = torch.randint(-9, 9, shape, generator=_gen(0)).double() / 4
    rows, cols = torch.tensor([0, 2, 0, 4, 2, 0]), torch.tensor([3, 3, 1])
    index = (rows, cols, slice(1, 3))
    positions = [rows.tolist(), cols.tolist(), [1, 2]]
    a = torch.randint(-16, 16, (6, 3, 2), generator=_gen(1)).double() / 8
    b = torch.randint(-16, 16, (6, 3, 2), generator=_gen(2)).double() / 8
    mask = (torch.rand(6, 3, 2, generator=_gen(3)) > 0.3).double()
    acc = Accumulator({"t": previous})
    acc.add({"x": a}, [MapEntry("x", "t", index)], weight=0.5)
    acc.add({"x": b}, [MapEntry("x", "t", index, mask)], weight=3.0, scale={"t": 0.25})
    got = acc.result({"t": previous})["t"]
    expected = _numpy_reference(
        shape, previous, [(a, positions, 0.5, 1.0, None), (b, positions, 3.0, 0.25, mask)]
    )
    assert torch.equal(got, torch.from_numpy(expected))
    assert not torch.equal(got, previous)  # (0, 3) takes six slices: the repeats were summed


def test_index_tensor_path_calls_no_atomic_accumulation(monkeypatch):
    """`index_put_(accumulate=True)` and `index_add_` on CUDA add repeated positions in an
    order that may change between runs; the accumulator must not call them."""
    called = []
    put, add = torch.Tensor.index_put_, torch.Tensor.index_add_

    def spy_put(self, indices, values, accumulate=False):
        called.append(f"index_put_(accumulate={accumulate})")
        return put(self, indices, values, accumulate)

    def spy_add(self, *args, **kwargs):
        called.append("index_add_")
        return add(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "index_put_", spy_put)
    monkeypatch.setattr(torch.Tensor, "index_add_", spy_add)
    acc = Accumulator({"t": torch.zeros(4, 3)})
    index = (torch.tensor([1, 1, 3]), torch.tensor([0, 2]))
    acc.add({"x": torch.ones(3, 2)}, [MapEntry("x", "t", index)])
    assert "index_add_" not in called and "index_put_(accumulate=True)" not in called
    assert acc.covered("t")[1].tolist() == [2.0, 0.0, 2.0]


def test_per_name_weights_missing_name_means_zero():
    prev = {"a": torch.tensor([0.0, 0.0]), "b": torch.tensor([-1.0, -2.0])}
    imap = full_map(["a", "b"])
    acc = Accumulator(prev)
    # client 1 weights "a" by 2 and, by omission, "b" by 0
    acc.add({"a": torch.tensor([3.0, 6.0]), "b": torch.tensor([1000.0, 1000.0])}, imap, {"a": 2.0})
    acc.add({"a": torch.tensor([9.0, 0.0]), "b": torch.tensor([4.0, 8.0])}, imap, 1.0)
    out = acc.result(prev)
    assert torch.equal(out["a"], torch.tensor([(2 * 3 + 9) / 3, (2 * 6 + 0) / 3]))
    assert torch.equal(out["b"], torch.tensor([4.0, 8.0]))


def test_per_name_zero_weight_alone_keeps_previous():
    prev = {"a": torch.tensor([0.5]), "b": torch.tensor([-1.0])}
    acc = Accumulator(prev)
    acc.add({"a": torch.tensor([3.0]), "b": torch.tensor([9.0])}, full_map(["a", "b"]), {"a": 1.0})
    out = acc.result(prev, fill="keep")
    assert torch.equal(out["a"], torch.tensor([3.0]))
    assert torch.equal(out["b"], torch.tensor([-1.0]))
    assert acc.covered("b") is None


def test_per_name_scales_multiply_value_not_count():
    prev = {"a": torch.zeros(2), "b": torch.zeros(2)}
    imap = full_map(["a", "b"])
    acc = Accumulator(prev)
    x1 = {"a": torch.tensor([4.0, 8.0]), "b": torch.tensor([1.0, 2.0])}
    x2 = {"a": torch.tensor([2.0, 1.0]), "b": torch.tensor([3.0, 5.0])}
    acc.add(x1, imap, weight=2.0, scale={"a": 0.5})  # "b" unscaled
    acc.add(x2, imap, weight=3.0)
    out = acc.result(prev)
    # result = sum w * s * x / sum w
    assert torch.equal(
        out["a"], torch.tensor([(2 * 0.5 * 4 + 3 * 2) / 5, (2 * 0.5 * 8 + 3 * 1) / 5])
    )
    assert torch.equal(out["b"], torch.tensor([(2 * 1 + 3 * 3) / 5, (2 * 2 + 3 * 5) / 5]))


def test_scale_with_single_client_is_not_normalised_away():
    prev = {"a": torch.zeros(3)}
    acc = Accumulator(prev)
    acc.add({"a": torch.tensor([1.0, -2.0, 4.0])}, full_map(["a"]), weight=5.0, scale={"a": 3.0})
    assert torch.equal(acc.result(prev)["a"], torch.tensor([3.0, -6.0, 12.0]))


# -- repeated entries ------------------------------------------------------------------------------
def test_one_local_tensor_written_into_two_global_tensors():
    prev = {"g1": torch.zeros(2), "g2": torch.full((3,), 9.0)}
    imap = [MapEntry("x", "g1"), MapEntry("x", "g2", prefix_index(2))]
    acc = Accumulator(prev)
    acc.add({"x": torch.tensor([1.0, 2.0])}, imap, weight=1.0)
    acc.add({"x": torch.tensor([4.0, 8.0])}, imap[1:], weight=3.0)
    out = acc.result(prev)
    assert torch.equal(out["g1"], torch.tensor([1.0, 2.0]))
    assert torch.equal(out["g2"], torch.tensor([(1 + 3 * 4) / 4, (2 + 3 * 8) / 4, 9.0]))


def test_one_local_tensor_written_into_two_places_of_one_global_tensor():
    prev = {"g": torch.zeros(4)}
    imap = [
        MapEntry("x", "g", (slice(0, 2),)),
        MapEntry("x", "g", (slice(1, 3),)),
    ]
    acc = Accumulator(prev)
    acc.add({"x": torch.tensor([2.0, 6.0])}, imap, weight=1.0)
    out = acc.result(prev)["g"]
    # g[0] = 2; g[1] = mean(6 from the first entry, 2 from the second) = 4; g[2] = 6; g[3] kept
    assert torch.equal(out, torch.tensor([2.0, 4.0, 6.0, 0.0]))
    assert torch.equal(acc.covered("g"), torch.tensor([1.0, 2.0, 1.0, 0.0], dtype=torch.float64))


# -- contribution masks ---------------------------------------------------------------------------
def test_mask_excludes_elements_from_sum_and_count():
    prev = {"w": torch.tensor([[-1.0, -2.0], [-3.0, -4.0], [-5.0, -6.0]])}
    mask_a = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
    mask_b = torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]])
    a = torch.tensor([[10.0, 20.0], [30.0, 40.0], [50.0, 60.0]])
    b = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    acc = Accumulator(prev)
    acc.add({"w": a}, [MapEntry("w", "w", mask=mask_a)], weight=1.0)
    acc.add({"w": b}, [MapEntry("w", "w", mask=mask_b)], weight=4.0)
    out = acc.result(prev)["w"]
    expected = torch.tensor(
        [
            [(10 + 4 * 1) / 5, 2.0],  # both; B only
            [30.0, (40 + 4 * 4) / 5],  # A only; both
            [-5.0, -6.0],  # masked by everyone: previous value
        ]
    )
    assert torch.equal(out, expected)
    zero = acc.result(prev, fill="zero")["w"]
    assert torch.equal(zero[2], torch.tensor([0.0, 0.0]))


def test_mask_with_prefix_slice_has_local_shape():
    prev = {"w": _grid()}
    acc = Accumulator(prev)
    mask = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    acc.add({"w": torch.full((2, 2), 50.0)}, [MapEntry("w", "w", prefix_index(2, 2), mask)])
    out = acc.result(prev)["w"]
    expected = _grid()
    expected[0, 0] = 50.0
    expected[1, 1] = 50.0
    assert torch.equal(out, expected)


# -- integer buffers -------------------------------------------------------------------------------
def test_integer_buffer_is_averaged_rounded_and_keeps_dtype():
    prev = {"n": torch.tensor(5, dtype=torch.long), "m": torch.tensor([0, 0], dtype=torch.long)}
    imap = full_map(["n", "m"])
    acc = Accumulator(prev)
    acc.add({"n": torch.tensor(10), "m": torch.tensor([10, 3])}, imap, weight=1.0)
    acc.add({"n": torch.tensor(14), "m": torch.tensor([11, 7])}, imap, weight=2.0)
    out = acc.result(prev)
    # n: (10 + 28) / 3 = 12.67 -> 13;  m: (10 + 22) / 3 = 10.67 -> 11, (3 + 14) / 3 = 5.67 -> 6
    assert out["n"].dtype == torch.long
    assert out["m"].dtype == torch.long
    assert torch.equal(out["n"], torch.tensor(13))
    assert torch.equal(out["m"], torch.tensor([11, 6]))


def test_integer_buffer_rounds_down_below_half():
    prev = {"n": torch.tensor([0], dtype=torch.int32)}
    acc = Accumulator(prev)
    acc.add({"n": torch.tensor([10], dtype=torch.int32)}, full_map(["n"]), weight=2.0)
    acc.add({"n": torch.tensor([11], dtype=torch.int32)}, full_map(["n"]), weight=1.0)
    out = acc.result(prev)["n"]  # 31 / 3 = 10.33
    assert out.dtype == torch.int32
    assert torch.equal(out, torch.tensor([10], dtype=torch.int32))


# -- exactness -------------------------------------------------------------------------------------
def _random_state(seed: int) -> dict[str, torch.Tensor]:
    g = _gen(seed)
    return {
        "w": torch.randn(6, 5, generator=g) * 10.0 ** torch.randint(-3, 4, (6, 5), generator=g),
        "b": torch.randn(6, generator=g),
        "n": torch.tensor(37, dtype=torch.long),
    }


def test_unchanged_sub_models_aggregate_bit_identically():
    g = _random_state(1)
    maps = [
        [MapEntry("w", "w", prefix_index(2, 3)), MapEntry("b", "b", prefix_index(2))],
        [
            MapEntry("w", "w", prefix_index(4, 5)),
            MapEntry("b", "b", prefix_index(4)),
            MapEntry("n", "n"),
        ],
        [MapEntry("w", "w", (torch.tensor([0, 3, 5]),)), MapEntry("b", "b"), MapEntry("n", "n")],
    ]
    acc = Accumulator(g)
    for imap, w in zip(maps, [0.3, 1.7, 5], strict=True):
        acc.add(extract(g, imap), imap, weight=w)
    out = acc.result(g)
    assert set(out) == set(g)
    for k in g:
        assert out[k].dtype == g[k].dtype
        assert torch.equal(out[k], g[k]), k


def test_full_width_average_equals_float64_average_cast_once():
    names = ["w", "b"]
    g0 = {"w": torch.zeros(6, 5), "b": torch.zeros(6)}
    clients = [_random_state(s) for s in (11, 12, 13)]
    weights = [13, 29, 101]
    acc = Accumulator(g0)
    for c, w in zip(clients, weights, strict=True):
        acc.add({k: c[k] for k in names}, full_map(names), weight=w)
    out = acc.result(g0)
    for k in names:
        x = [c[k].to(torch.float64) for c in clients]
        expected = ((13 * x[0] + 29 * x[1] + 101 * x[2]) / 143).to(torch.float32)
        assert out[k].dtype == torch.float32
        assert torch.equal(out[k], expected), k
        # and it is a real average, not one of the inputs
        assert not torch.equal(out[k], clients[2][k])


def test_client_order_does_not_change_result():
    g = _random_state(20)
    g_gen = _gen(21)
    clients = []
    for rows, w in [(2, 3.0), (4, 0.7), (6, 11.0), (3, 2.5)]:
        imap = [
            MapEntry("w", "w", prefix_index(rows, rows - 1)),
            MapEntry("b", "b", prefix_index(rows)),
        ]
        local = {
            "w": torch.randn(rows, rows - 1, generator=g_gen),
            "b": torch.randn(rows, generator=g_gen),
        }
        clients.append((local, imap, w))
    results = []
    for order in itertools.permutations(range(len(clients))):
        acc = Accumulator(g)
        for i in order:
            acc.add(*clients[i])
        results.append(acc.result(g))
    for r in results[1:]:
        for k in g:
            assert torch.equal(r[k], results[0][k]), k
    assert not torch.equal(results[0]["w"], g["w"])


# -- errors ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [-1.0, -1e-12, math.nan, math.inf])
def test_bad_weight_raises(bad):
    acc = Accumulator({"w": torch.zeros(2)})
    with pytest.raises(ValueError, match="weight"):
        acc.add({"w": torch.ones(2)}, full_map(["w"]), weight=bad)


@pytest.mark.parametrize("bad", [-2.0, math.nan, -math.inf])
def test_bad_per_name_weight_raises(bad):
    acc = Accumulator({"w": torch.zeros(2)})
    with pytest.raises(ValueError, match="weight"):
        acc.add({"w": torch.ones(2)}, full_map(["w"]), weight={"w": bad})


def test_wrong_shape_names_the_tensor():
    acc = Accumulator({"layer.weight": torch.zeros(4, 3)})
    imap = [MapEntry("layer.weight", "layer.weight", prefix_index(2, 2))]
    with pytest.raises(ValueError, match=r"layer\.weight"):
        acc.add({"layer.weight": torch.ones(2, 3)}, imap)


def test_bad_fill_raises():
    acc = Accumulator({"w": torch.zeros(2)})
    acc.add({"w": torch.ones(2)}, full_map(["w"]))
    with pytest.raises(ValueError, match="fill"):
        acc.result({"w": torch.zeros(2)}, fill="bad")  # type: ignore[arg-type]


def test_map_naming_a_tensor_the_client_lacks_is_key_error():
    acc = Accumulator({"w": torch.zeros(2), "b": torch.zeros(1)})
    with pytest.raises(KeyError, match="b"):
        acc.add({"w": torch.ones(2)}, full_map(["w", "b"]))


def test_map_naming_an_unknown_global_tensor_is_key_error():
    acc = Accumulator({"w": torch.zeros(2)})
    with pytest.raises(KeyError, match="ghost"):
        acc.add({"w": torch.ones(2)}, [MapEntry("w", "ghost")])


# -- small helpers ---------------------------------------------------------------------------------
def test_state_bytes():
    tensors = {
        "a": torch.zeros(2, 3),  # 6 * 4
        "b": torch.zeros(5, dtype=torch.long),  # 5 * 8
        "c": torch.zeros(4, dtype=torch.float16),  # 4 * 2
        "d": torch.zeros(0),
    }
    assert state_bytes(tensors) == 24 + 40 + 8
    assert state_bytes({}) == 0


def test_clone_state_is_a_deep_detached_copy():
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    src = {"p": p, "n": torch.tensor([3], dtype=torch.long)}
    out = clone_state(src)
    assert out is not src
    assert set(out) == {"p", "n"}
    assert not out["p"].requires_grad
    out["p"].add_(10.0)
    out["n"].add_(1)
    assert torch.equal(p.detach(), torch.tensor([1.0, 2.0]))
    assert torch.equal(src["n"], torch.tensor([3]))
    assert out["n"].dtype == torch.long


@pytest.mark.parametrize(
    ("shape", "index", "expected"),
    [
        ((4, 3), (), (4, 3)),
        ((4, 3), prefix_index(2), (2, 3)),
        ((4, 3), prefix_index(None, 1), (4, 1)),
        ((4, 3, 5), (torch.tensor([0, 2]), slice(1, 3)), (2, 2, 5)),
        ((5,), (slice(0, None, 2),), (3,)),
        ((5,), prefix_index(9), (5,)),
    ],
)
def test_selected_shape(shape, index, expected):
    assert selected_shape(shape, index) == expected
    # and it agrees with actually indexing a tensor of that shape with plain slices
    if all(isinstance(s, slice) for s in index):
        assert tuple(torch.zeros(shape)[index].shape) == expected


def test_selected_shape_too_many_dims():
    with pytest.raises(ValueError, match="dimensions"):
        selected_shape((4,), prefix_index(2, 2))


# -- Spec ------------------------------------------------------------------------------------------
def test_spec_equal_regardless_of_kwarg_order_and_hashable():
    a = Spec(width=0.5, depth=2, name="x")
    b = Spec(name="x", depth=2, width=0.5)
    c = Spec({"depth": 2}, width=0.5, name="x")
    assert a == b == c
    assert hash(a) == hash(b) == hash(c)
    assert {a: 1}[b] == 1
    assert len({a, b, c}) == 1
    assert a != Spec(width=0.25, depth=2, name="x")
    assert a != Spec(width=0.5, depth=2)
    assert list(a) == ["depth", "name", "width"]
    assert len(a) == 3


def test_spec_kwargs_override_mapping():
    assert Spec({"a": 1, "b": 2}, b=3)["b"] == 3


def test_spec_freezes_lists_to_tuples():
    src = [32, 32]
    s = Spec(input_shape=src, nested=[1, [2, 3]])
    assert s["input_shape"] == (32, 32)
    assert isinstance(s["input_shape"], tuple)
    assert s["nested"] == (1, (2, 3))
    hash(s)
    src.append(1)  # the spec does not alias its input
    assert s["input_shape"] == (32, 32)
    assert Spec(input_shape=[32, 32]) == Spec(input_shape=(32, 32))


def test_spec_replace():
    s = Spec(width=0.5, depth=2)
    r = s.replace(width=1.0, extra=[1, 2])
    assert r == Spec(width=1.0, depth=2, extra=(1, 2))
    assert s == Spec(width=0.5, depth=2)  # unchanged
    assert r != s


def test_spec_to_dict():
    s = Spec(input_shape=(1, 28, 28), width=0.5, name="m")
    d = s.to_dict()
    assert d == {"input_shape": [1, 28, 28], "width": 0.5, "name": "m"}
    assert isinstance(d["input_shape"], list)
    assert Spec(d) == s
    d["width"] = 2.0
    assert s["width"] == 0.5


def test_spec_is_immutable():
    s = Spec(a=1)
    with pytest.raises(TypeError):
        s["a"] = 2  # type: ignore[index]
