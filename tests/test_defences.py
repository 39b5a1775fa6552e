"""Defences as reducer kinds (`hetfl.core.server.defences`) on hand tensors: Krum's distances and
choice over partially covered elements (grafted repeats once per element), Multi-Krum, norm
clipping by a bound and by the round's median norm, the run-time fallback to the median,
and Krum's n > 2f + 2 checked at set-up."""

from __future__ import annotations

import pytest
import torch

from hetfl.config import ConfigError, validate
from hetfl.core.kinds import choose
from hetfl.core.server.defences import ClippingReducer, KrumReducer, krum_scores, pairwise_distances
from hetfl.core.server.reducers import REDUCERS
from hetfl.core.server.robust import CoordinateReducer, HeldClients, median
from hetfl.core.spec import MapEntry, prefix_index

HALF = [MapEntry("v", "w", prefix_index(2))]
WHOLE = [MapEntry("v", "w", prefix_index(4))]
REF = {"w": torch.zeros(4)}


def _clients():
    """A and D cover w[:2], B, C and the attacker E all of w."""
    return [
        ({"v": torch.tensor([1.0, 1.0])}, HALF),  # A
        ({"v": torch.tensor([1.0, 1.0, 1.0, 1.0])}, WHOLE),  # B
        ({"v": torch.tensor([1.5, 1.5, 1.5, 1.5])}, WHOLE),  # C
        ({"v": torch.tensor([1.0, 2.0])}, HALF),  # D
        ({"v": torch.tensor([9.0, 9.0, 9.0, 9.0])}, WHOLE),  # E
    ]


def _added(reducer, clients):
    for local, imap in clients:
        reducer.add(local, imap)
    return reducer


def test_krum_distances_over_shared_elements_and_its_choice() -> None:
    """Mean squared differences over the elements both cover: A-D (0 + 1) / 2 = 0.5, B-C
    4·0.25 / 4 = 0.25, D-E (64 + 49) / 2 = 56.5. With f = 1 each score sums the 2 nearest:
    A 0 + 0.25, B 0 + 0.25, C 0.25 + 0.25, D 0.25 + 0.5, E 56.25 + 56.5; Krum takes A (the
    earlier of a tie), whose w[:2] replaces the global one, w[2:] kept."""
    held = _added(HeldClients(REF), _clients())
    d = pairwise_distances(held)
    assert d[0, 3] == 0.5 and d[1, 2] == 0.25 and d[3, 4] == 56.5 and d[0, 1] == 0
    assert krum_scores(d, 1).tolist() == [0.25, 0.25, 0.5, 0.75, 112.75]
    krum = _added(KrumReducer(REF, f=1, m=1), _clients())
    assert krum.result({"w": torch.full((4,), 7.0)})["w"].tolist() == [1.0, 1.0, 7.0, 7.0]
    assert krum.decisions.per_client == ["kept", "dropped", "dropped", "dropped", "dropped"]


def test_multi_krum_drops_the_attacker_and_averages_the_rest() -> None:
    """m = n - f = 4 keeps A..D: w = [(1+1+1.5+1)/4, (1+1+1.5+2)/4, (1+1.5)/2, (1+1.5)/2]."""
    multi = _added(KrumReducer(REF, f=1, m=None), _clients())
    assert multi.result(REF)["w"].tolist() == [1.125, 1.375, 1.25, 1.25]
    assert multi.decisions.per_client == ["kept"] * 4 + ["dropped"]
    assert not multi.decisions.fallback


def test_grafted_repeats_count_once_per_global_element() -> None:
    """A client whose two local tensors both land on w[:2] counts there once, with their mean
    (2, 2): its distance to B is (1 + 1) / 2 elements = 1, not over 4 entries."""
    grafted = [MapEntry("x", "w", prefix_index(2)), MapEntry("y", "w", prefix_index(2))]
    held = HeldClients(REF)
    held.add({"x": torch.tensor([1.0, 1.0]), "y": torch.tensor([3.0, 3.0])}, grafted, 1.0, None)
    held.add({"v": torch.ones(4)}, WHOLE, 1.0, None)
    assert pairwise_distances(held)[0, 1] == 1.0


def test_a_round_with_too_few_results_falls_back_to_the_median() -> None:
    """f = 1 needs n > 4: four results take the coordinate-wise median, and say so."""
    clients = _clients()[:4]
    krum = _added(KrumReducer(REF, f=1, m=1), clients)
    expected = _added(CoordinateReducer(REF, median), clients).result(REF)
    assert torch.equal(krum.result(REF)["w"], expected["w"])
    assert krum.decisions.fallback and krum.decisions.per_client == ["kept"] * 4


def _clip_clients():
    return [
        ({"v": torch.tensor([3.0, 4.0])}, HALF),  # norm 5
        ({"v": torch.tensor([1.0, 0.0, 0.0, 0.0])}, WHOLE),  # norm 1
        ({"v": torch.tensor([0.0, 0.0, 0.0, 2.0])}, WHOLE),  # norm 2
    ]


def test_clipping_by_the_median_norm() -> None:
    """Norms 5, 1, 2 of updates from zero: the median, 2, scales the first to [1.2, 1.6];
    the mean over the covering clients is [(1.2+1+0)/3, 1.6/3, (0+0)/2, (0+2)/2]."""
    clip = _added(ClippingReducer(REF, bound="median"), _clip_clients())
    assert clip.norms(REF, "keep") == [5.0, 1.0, 2.0]
    got = clip.result(REF)["w"]
    assert torch.allclose(got, torch.tensor([2.2 / 3, 1.6 / 3, 0.0, 1.0]), atol=1e-7)
    assert clip.decisions.per_client == ["clipped", "kept", "kept"]


def test_clipping_by_a_bound_measures_updates_from_the_previous_state() -> None:
    """From previous [1, 1, 1, 1], the first client's update is [2, 3] (norm √13): bound 1
    scales it to [2, 3]/√13; deltas (fill zero) are measured from zero."""
    clip = _added(ClippingReducer(REF, bound=1.0), _clip_clients()[:1])
    ones = {"w": torch.ones(4)}
    got = clip.result(ones)["w"]
    s = 13**0.5
    assert torch.allclose(got, torch.tensor([1 + 2 / s, 1 + 3 / s, 1.0, 1.0]), atol=1e-7)
    assert clip.result(ones, fill="zero")["w"].tolist()[:2] == pytest.approx([0.6, 0.8])


def test_trained_norm_clip_measures_what_the_client_trained() -> None:
    """A grafted client (its block `b` repeated into the deeper global block `c`) that
    returns exactly what it received, b = [1, 1], with an α of 2 on `b`: the upload's update
    is (2·1 - 1) over `b` and 2·1 - 3 over `c`, norm √(1+1+1+1) = 2, so norm-clip at bound 1
    halves it; measured on what it trained (b, once, unscaled) the update is 0, kept. A
    client that trained b to [1, 4] measures 3 either way on `b` alone."""
    ref = {"b": torch.ones(2), "c": torch.full((2,), 3.0)}
    grafted = [MapEntry("b", "b"), MapEntry("b", "c")]
    same = {"b": torch.ones(2)}
    alpha = {"b": 2.0, "c": 2.0}
    naive = ClippingReducer(ref, bound=1.0)
    naive.add(same, grafted, 1.0, alpha)
    assert naive.norms(ref, "keep") == pytest.approx([2.0])
    trained = choose(REDUCERS, {"kind": "trained-norm-clip", "bound": 1.0}).build()(ref)
    trained.add(same, grafted, 1.0, alpha)
    assert trained.norms(ref, "keep") == [0.0]
    trained.result(ref)
    assert trained.decisions.kind == "trained-norm-clip"
    assert trained.decisions.per_client == ["kept"]
    moved = ClippingReducer(ref, bound=1.0, measure="trained")
    moved.add({"b": torch.tensor([1.0, 4.0])}, grafted, 1.0, alpha)
    assert moved.norms(ref, "keep") == pytest.approx([3.0])
    # the factor 1/3 scales the reduced update: b -> 1 + (2·[1, 4] - 1)/3,
    # c -> 3 + (2·[1, 4] - 3)/3
    got = moved.result(ref)
    assert torch.allclose(got["b"], torch.tensor([1 + 1 / 3, 1 + 7 / 3]), atol=1e-6)
    assert torch.allclose(got["c"], torch.tensor([3 - 1 / 3, 3 + 5 / 3]), atol=1e-6)


@pytest.mark.parametrize(
    ("reducer", "match"),
    [
        (
            {"kind": "krum", "f": 2},
            r"Krum with f = 2 needs more than 2f \+ 2 = 6 clients per round, got 5",
        ),
        ({"kind": "multi-krum", "f": -1}, r"f = -1: Input should be greater than or equal to 0"),
        ({"kind": "norm-clip", "bound": 0}, r"bound must be a positive number or 'median'"),
        (
            {"kind": "multi-krum", "f": 1, "m": 5},
            r"Multi-Krum keeps m = 5 clients, more than n - f = 5 - 1 = 4: .* at most 4",
        ),
        ({"kind": "multi-krum", "f": 1, "m": 0}, r"m = 0: Input should be greater than or equal"),
    ],
)
def test_bad_defence_settings_are_refused(reducer: dict, match: str) -> None:
    raw = {"algorithm": "fedavg", "options": {"fedavg": {"reducer": reducer}}}
    with pytest.raises(ConfigError, match=match):
        validate({**raw, "train": {"clients_per_round": 5}})


def test_multi_krum_keeps_at_most_n_minus_f() -> None:
    """1 <= m <= n - f: with 5 clients per round and f = 1, m = 4 and m = 1 validate."""
    for m in (1, 4):
        reducer = {"kind": "multi-krum", "f": 1, "m": m}
        validate(
            {
                "algorithm": "fedavg",
                "options": {"fedavg": {"reducer": reducer}},
                "train": {"clients_per_round": 5},
            }
        )


def test_defences_are_reducer_kinds() -> None:
    assert {"krum", "multi-krum", "norm-clip"} <= set(REDUCERS.names())
    chosen = choose(REDUCERS, {"kind": "multi-krum", "f": 1})
    assert chosen.describe() == {"kind": "multi-krum", "f": 1, "m": None}
    assert isinstance(chosen.build()(REF), KrumReducer)
