"""Parts FLANC brings to the width methods (`hetfl.algorithms.parts.widths`,
`hetfl.core.client.regularisers.OrthogonalityPenalty`) against hand computations: the
capacity assignments, the orthogonality penalty's value and gradient, and bad settings."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from hetfl.algorithms.parts.width_assignment import (
    WidthAssignment,
    check_every_level_fits,
    draw_every_level,
    quantise_capacity,
)
from hetfl.core.client.recipe import TrainContext
from hetfl.core.client.regularisers import OrthogonalityPenalty, orthogonality
from hetfl.core.roles import tensor_roles
from hetfl.core.spec import Spec
from hetfl.core.types import ClientInfo, ClientTask
from hetfl.models import ComposedFamily
from hetfl.models.composed import ComposedConv2d

LEVELS = (0.25, 0.5, 0.75, 1.0)


def _info(cid: int, **attrs: float) -> ClientInfo:
    return ClientInfo(cid=cid, n_train=10, input_shape=(1, 28, 28), labels=(0, 1), attrs=attrs)


# -- capacities ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("capacity", "level"), [(1.0, 1.0), (0.99, 0.75), (0.75, 0.75), (0.6, 0.5), (0.25, 0.25)]
)
def test_a_capacity_is_quantised_to_the_largest_level_not_above_it(
    capacity: float, level: float
) -> None:
    assert quantise_capacity(capacity, LEVELS, cid=3) == level


def test_a_capacity_below_every_level_is_an_error_naming_the_client() -> None:
    with pytest.raises(ValueError, match=r"client 7 declares capacity 0.1, below the smallest"):
        quantise_capacity(0.1, LEVELS, cid=7)


def test_declared_capacities_come_from_attrs_then_the_capacities_list() -> None:
    a = WidthAssignment(LEVELS, None, lambda p: Spec(p=p), mode="declared", capacities=(0.3, 0.8))
    a.setup([_info(2), _info(5)])
    assert a.level_of == {2: 0.25, 5: 0.75}
    a.setup([_info(2, capacity=0.55), _info(5)])  # attrs win over the list
    assert a.level_of == {2: 0.5, 5: 0.75}
    assert a.trained_levels() == [0.5, 0.75]
    assert [s["p"] for s in a.specs_in_round(1, [_info(5), _info(2)], torch.Generator())] == [
        0.75,
        0.5,
    ]
    with pytest.raises(ValueError, match=r"client 9 declares no capacity"):
        a.setup([_info(2), _info(5), _info(9)])


def test_dynamic_all_levels_redraws_until_every_level_appears() -> None:
    rng = torch.Generator().manual_seed(0)
    counts: Counter[float] = Counter()
    for _ in range(300):
        drawn = draw_every_level(LEVELS, None, 10, rng)
        assert len(drawn) == 10 and set(drawn) == set(LEVELS)
        counts.update(drawn)
    # uniform over the levels: each near 750 of 3000 (sd about 24)
    assert all(abs(c - 750) < 120 for c in counts.values()), counts
    few = draw_every_level(LEVELS, None, 2, rng)  # fewer clients than levels: all distinct
    assert len(set(few)) == 2


def test_dynamic_all_levels_needs_as_many_clients_per_round_as_levels() -> None:
    check_every_level_fits("dynamic-all-levels", LEVELS, 4)
    check_every_level_fits("dynamic", LEVELS, 1)
    with pytest.raises(ValueError, match=r"clients_per_round is 3; ask at least 4"):
        check_every_level_fits("dynamic-all-levels", LEVELS, 3)


# -- the orthogonality penalty -------------------------------------------------------------------
def _ctx(params: dict[str, torch.Tensor], roles: dict[str, str]) -> TrainContext:
    task = ClientTask(cid=0, spec=Spec(), payload={}, index_map=[])
    ctx = TrainContext(
        task=task, received={}, generator=torch.Generator(), settings=task.config, roles=roles
    )
    ctx.params.update(params)
    return ctx


def test_orthogonality_penalty_value_and_gradient_by_hand() -> None:
    # Bank 1: two bases of 1x1x2 -> B = [[1, 1], [0, 2]]; B Bᵀ - I = [[1, 2], [2, 3]].
    b1 = torch.tensor([[[[1.0]], [[1.0]]], [[[0.0]], [[2.0]]]], requires_grad=True)
    # Bank 2: already orthonormal -> adds nothing.
    b2 = torch.eye(3).reshape(3, 3, 1, 1).requires_grad_(True)
    other = torch.ones(4, requires_grad=True)  # not a bank
    term = OrthogonalityPenalty(0.5)
    # the banks are found by their declared role, not by their names
    params = {"conv2.u": b1, "conv3.v": b2, "conv2.basis": other}
    roles = {"conv2.u": "basis", "conv3.v": "basis", "conv2.basis": "coefficients"}
    value = term(torch.zeros(1, 2), torch.zeros(1), torch.zeros(1), _ctx(params, roles))
    assert value is not None
    assert value.item() == pytest.approx(0.5 * (1 + 4 + 4 + 9) / 4)
    value.backward()
    # d/dB mean((BBᵀ - I)²) = (4 / R2²) (BBᵀ - I) B for symmetric BBᵀ - I
    e = torch.tensor([[1.0, 2.0], [2.0, 3.0]])
    b = torch.tensor([[1.0, 1.0], [0.0, 2.0]])
    expected = 0.5 * 4 / 4 * (e @ b)
    assert torch.allclose(b1.grad.reshape(2, 2), expected)
    assert torch.count_nonzero(b2.grad) == 0 and other.grad is None
    assert orthogonality(torch.eye(4)).item() == 0.0


def test_orthogonality_penalty_refuses_a_model_without_banks_and_negative_lambda() -> None:
    with pytest.raises(ValueError, match=r"no parameter of role 'basis'"):
        OrthogonalityPenalty(1.0)(
            torch.zeros(1, 2), torch.zeros(1), torch.zeros(1), _ctx({"w": torch.ones(2)}, {})
        )
    zero = OrthogonalityPenalty(0.0)
    assert zero(torch.zeros(1, 2), torch.zeros(1), torch.zeros(1), _ctx({}, {})) is None
    with pytest.raises(ValueError, match=r"lambda_orth must be a finite number >= 0, got -1"):
        OrthogonalityPenalty(-1.0)


def test_composed_layers_declare_their_bases_and_nothing_else() -> None:
    """The penalty's banks are the parameters the composed layers declare in the role
    "basis": each composed layer's `basis`, never its `coef` or another layer's tensor."""
    family = ComposedFamily(
        {"family": "composed-cnn", "input_shape": (1, 28, 28), "num_classes": 10}
    )
    model = family.build(family.spec_at(0.5))
    roles = tensor_roles(model)
    composed = [n for n, m in model.named_modules() if isinstance(m, ComposedConv2d)]
    assert composed and set(roles) == {f"{n}.basis" for n in composed}
    assert set(roles.values()) == {"basis"}
    assert set(roles) < {n for n, _ in model.named_parameters()}
