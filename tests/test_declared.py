"""Declared global tensors (`hetfl.core.declared`, `Strategy._init_global_state`) and
`place`, the inverse of `extract` (`hetfl.core.state`), on hand tensors."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch import nn

from hetfl.core.declared import DeclaredTensor, build_declared, declared_generator
from hetfl.core.rng import SERVER, torch_generator
from hetfl.core.server.assign import PerClient
from hetfl.core.server.strategy import Strategy
from hetfl.core.spec import IndexMap, MapEntry, Spec, prefix_index
from hetfl.core.state import extract, place
from hetfl.core.training import LocalTraining
from hetfl.core.types import ClientInfo
from hetfl.models import PlainFamily
from strategies import fedavg


def _init_gen() -> torch.Generator:
    return torch_generator(7, 0, SERVER, "init")


# -- place: the inverse of extract ------------------------------------------------------------
def _hand_state() -> dict[str, torch.Tensor]:
    return {
        "w": torch.arange(24, dtype=torch.float32).reshape(6, 4),
        "b": torch.arange(6, dtype=torch.float32) * 10,
        "n": torch.tensor([3, 5], dtype=torch.long),
        "untouched": torch.ones(2),
    }


def _hand_map() -> IndexMap:
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 1.0]])
    return [
        MapEntry("a", "w", prefix_index(2, 3)),  # w[:2, :3]
        MapEntry("c", "w", prefix_index(3, 2)),  # w[:3, :2], overlapping a on w[:2, :2]
        MapEntry("m", "w", (torch.tensor([5, 4]),), mask),  # rows 5, 4 through a mask
        MapEntry("r", "b", (torch.tensor([0, 2]),)),  # read from b[0], b[2] ...
        MapEntry("r", "b", (torch.tensor([4, 5]),)),  # ... and grafted into b[4], b[5]
        MapEntry("t", "b", (torch.tensor([3, 3]),)),  # b[3] twice
        MapEntry("n", "n"),
    ]


def test_place_of_extract_reproduces_the_state_where_covered_and_marks_coverage() -> None:
    g = _hand_state()
    placed = place(extract(g, _hand_map()), _hand_map(), like=g)

    w_cover = torch.zeros(6, 4, dtype=torch.bool)
    w_cover[:2, :3] = True
    w_cover[:3, :2] = True
    w_cover[5] = torch.tensor([True, False, True, True])  # mask row 0 -> global row 5
    w_cover[4, 3] = True  # mask row 1 -> global row 4
    b_cover = torch.tensor([True, False, True, True, True, True])
    assert set(placed.values) == set(placed.covered) == {"w", "b", "n"}
    assert torch.equal(placed.covered["w"], w_cover)
    assert torch.equal(placed.covered["b"], b_cover)
    assert torch.equal(placed.covered["n"], torch.tensor([True, True]))

    assert torch.equal(placed.values["w"], torch.where(w_cover, g["w"], 0.0))
    # b[4], b[5] hold the grafted copies of b[0], b[2]; everything else covered is b itself
    assert placed.values["b"].tolist() == [0.0, 0.0, 20.0, 30.0, 0.0, 20.0]
    assert placed.values["n"].dtype == torch.long
    assert torch.equal(placed.values["n"], g["n"])


def test_place_averages_entries_that_land_on_one_element() -> None:
    like = {"w": torch.zeros(3, 3)}
    imap = [MapEntry("a", "w", prefix_index(2, 3)), MapEntry("c", "w", prefix_index(3, 2))]
    placed = place({"a": torch.full((2, 3), 2.0), "c": torch.full((3, 2), 4.0)}, imap, like)
    # by hand: w[:2, :2] is covered by both (mean 3), w[:2, 2] by a only, w[2, :2] by c only
    expected = torch.tensor([[3.0, 3.0, 2.0], [3.0, 3.0, 2.0], [4.0, 4.0, 0.0]])
    assert torch.equal(placed.values["w"], expected)
    assert placed.covered["w"].tolist() == [[True] * 3, [True] * 3, [True, True, False]]


def test_place_refuses_a_wrong_shape_and_an_unknown_global_name() -> None:
    like = {"w": torch.zeros(3, 3)}
    with pytest.raises(ValueError, match=r"tensor 'a' has shape \(3, 3\).*must be \(2, 3\)"):
        place({"a": torch.zeros(3, 3)}, [MapEntry("a", "w", prefix_index(2))], like)
    with pytest.raises(KeyError, match="global tensor 'v' is not in the global state"):
        place({"a": torch.zeros(3, 3)}, [MapEntry("a", "v")], like)


# -- declared tensors --------------------------------------------------------------------------
WIDE, FAN_IN = 256, 512


class _PerWidthFamily:
    """Linear(FAN_IN -> WIDE * width) without bias; each width keeps its own global weight
    `width=<w>/weight`, declared at that width's shape with a fan-out initialiser (as FLANC's
    per-capacity coefficients are)."""

    def build(self, spec: Spec) -> nn.Module:
        return nn.Linear(FAN_IN, round(WIDE * spec["width"]), bias=False)

    def index_map(self, spec: Spec) -> IndexMap:
        return [MapEntry("weight", f"width={spec['width']}/weight")]

    def global_spec(self, specs: list[Spec]) -> Spec:
        return Spec(width=max((s["width"] for s in specs), default=1.0))

    def modules(self, spec: Spec) -> list[str]:
        return []

    def declared_tensors(self, specs: Sequence[Spec]) -> list[DeclaredTensor]:
        widths = sorted({s["width"] for s in specs})
        shapes = {w: (round(WIDE * w), FAN_IN) for w in widths}
        return [
            DeclaredTensor(f"width={w}/weight", shapes[w], "kaiming_normal_fan_out") for w in widths
        ]


def _by_width() -> Strategy:
    """Each client trains the width its attributes declare."""
    family = _PerWidthFamily()
    by_attr = PerClient(lambda info: Spec(width=info.attrs["width"]))
    return fedavg(family, clients_per_round=1, train=LocalTraining(), assignment=by_attr)


def _clients(*widths: float) -> list[ClientInfo]:
    return [ClientInfo(i, 10, (FAN_IN,), (0,), {"width": w}) for i, w in enumerate(widths)]


def test_a_declared_per_group_tensor_has_the_statistics_of_its_own_shape() -> None:
    strategy = _by_width()
    state = strategy.setup(_clients(1 / 32, 1.0), _init_gen())
    small, full = state["width=0.03125/weight"], state["width=1.0/weight"]
    assert small.shape == (8, FAN_IN) and full.shape == (WIDE, FAN_IN)
    # Kaiming normal, fan out: std = sqrt(2 / rows). A slice of the full-width tensor would
    # have sqrt(2 / 256) = 0.088, not the group's own sqrt(2 / 8) = 0.5.
    assert float(small.std()) == pytest.approx(math.sqrt(2 / 8), rel=0.05)
    assert float(full.std()) == pytest.approx(math.sqrt(2 / WIDE), rel=0.05)
    assert strategy._parameter_names() == ["width=0.03125/weight", "width=1.0/weight"]


def _with_extra(declared: list[DeclaredTensor], **parts: Any) -> Strategy:
    """A plain model plus strategy-declared tensors (a per-tier head, a server buffer)."""
    family = PlainFamily("mlp", (1, 2, 2), 3)
    return fedavg(family, clients_per_round=1, train=LocalTraining(), declared=declared, **parts)


HEAD = DeclaredTensor("aux2/head.weight", (3, 5), "kaiming_uniform_default")
COUNT = DeclaredTensor("aux2/seen", (3,), "zeros", dtype=torch.long, role="buffer")


def test_declarations_leave_the_global_model_and_each_other_unchanged() -> None:
    plain, extra, reordered = (
        _with_extra([]),
        _with_extra([HEAD, COUNT]),
        _with_extra([COUNT, HEAD]),
    )
    p, e, r = (s.setup(_clients(1.0), _init_gen()) for s in (plain, extra, reordered))
    assert list(e) == [*p, "aux2/head.weight", "aux2/seen"]
    for name, tensor in p.items():
        assert torch.equal(e[name], tensor)
    assert torch.equal(e["aux2/head.weight"], r["aux2/head.weight"])
    assert e["aux2/seen"].dtype == torch.long
    assert extra._parameter_names() == [*plain._parameter_names(), "aux2/head.weight"]


def test_a_declared_name_of_the_global_model_is_refused() -> None:
    name = next(iter(_with_extra([]).setup(_clients(1.0), _init_gen())))
    strategy = _with_extra([DeclaredTensor(name, (4, 4), "zeros")])
    with pytest.raises(
        ValueError, match=rf"declared tensors \['{name}'\] are tensors of the global"
    ):
        strategy.setup(_clients(1.0), _init_gen())


class _Foreign:
    """A map transform naming a global tensor nobody declared."""

    def shared(self, imap: IndexMap, spec: Spec) -> IndexMap:
        return [*imap, MapEntry("aux.w", "aux3/aux.w")]

    def for_client(self, imap, spec, client, state):  # type: ignore[no-untyped-def]
        return self.shared(imap, spec)


def test_a_map_naming_an_undeclared_foreign_tensor_says_to_declare_it() -> None:
    with pytest.raises(KeyError, match=r"lacks: \['aux3/aux.w'\]; declare"):
        _with_extra([], transforms=[_Foreign()]).setup(_clients(1.0), _init_gen())


def test_named_initialisers_by_hand() -> None:
    g = _init_gen()
    normal = DeclaredTensor("n", (200, 100), "normal(0.02)").build(declared_generator(g, "n"))
    assert float(normal.std()) == pytest.approx(0.02, rel=0.02)
    ortho = DeclaredTensor("o", (4, 3, 2, 2), "orthogonal").build(declared_generator(g, "o"))
    rows = ortho.reshape(4, -1)
    assert torch.allclose(rows @ rows.T, torch.eye(4), atol=1e-5)
    uniform = DeclaredTensor("u", (50, 16), "kaiming_uniform_default").build(
        declared_generator(g, "u")
    )
    assert float(uniform.abs().max()) <= 1 / math.sqrt(16) and float(uniform.abs().max()) > 0.2
    assert torch.equal(DeclaredTensor("z", (2,), "ones").build(g), torch.ones(2))
    assert DeclaredTensor("d", (2,), "zeros", dtype=torch.float64).build(g).dtype == torch.float64


def test_each_declared_tensor_has_a_stream_of_its_own() -> None:
    def draw(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
        return torch.rand(shape, generator=g)

    alone = build_declared([DeclaredTensor("f", (3,), draw)], _init_gen())
    used = _init_gen()
    torch.rand(5, generator=used)  # the global model's initialisation draws first
    after_another = build_declared([HEAD, DeclaredTensor("f", (3,), draw)], used)
    assert torch.equal(alone["f"], after_another["f"])
    assert not torch.equal(alone["f"], torch.rand(3, generator=_init_gen()))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"init": "xavier"}, r"initialiser 'xavier'; allowed: zeros, ones, .*normal\(<std>\)"),
        ({"init": "normal(-1)"}, r"'normal\(-1\)'; the std must be a finite number >= 0"),
        ({"init": "normal(x)"}, r"'normal\(x\)'; the std must be"),
        ({"role": "state"}, "role 'state'; allowed: 'parameter' or 'buffer'"),
        ({"shape": (2, -1)}, r"shape \(2, -1\): need sizes >= 0"),
        ({"name": ""}, "non-empty name"),
    ],
)
def test_bad_declarations_are_refused_with_the_field(kwargs: dict, message: str) -> None:
    fields = {"name": "x", "shape": (2, 2), "init": "zeros", **kwargs}
    with pytest.raises(ValueError, match=message):
        DeclaredTensor(**fields)


def test_bad_builds_are_refused() -> None:
    with pytest.raises(ValueError, match=r"'v' of shape \(3,\) has no fan"):
        DeclaredTensor("v", (3,), "kaiming_normal_fan_in").build(_init_gen())
    wrong = DeclaredTensor("f", (3,), lambda shape, g: torch.zeros(4))
    with pytest.raises(ValueError, match=r"returned shape \(4,\), declared \(3,\)"):
        wrong.build(_init_gen())
    with pytest.raises(ValueError, match="'h' is declared twice"):
        build_declared([DeclaredTensor("h", (1,), "zeros")] * 2, _init_gen())
