"""FLANC's composed layers and families (`hetfl.models.composed`, `hetfl.models.flanc`):
explicit and factorised composition agree, the MACs equal a hand count of every layout and
reproduce the supplement's Table 2 with the `table2` basis sizes, the index maps share
only the bases, and every global tensor is declared at its own shape with the authors'
initialisation."""

from __future__ import annotations

import math

import pytest
import torch

from hetfl.config import ModelConfig
from hetfl.core.declared import DeclaredTensor
from hetfl.core.init import build_model, initialize
from hetfl.core.spec import selected_shape
from hetfl.core.state import extract
from hetfl.core.types import PassRecord
from hetfl.models import ComposedFamily, SpecError, make_family
from hetfl.models.composed import ComposedConv2d, ComposedLinear
from hetfl.models.flanc import BASIS_GROUP, capacity_group
from hetfl.systems.costs import MacCounter

LEVELS = (0.25, 0.5, 0.75, 1.0)
#: family -> (input shape, classes) small enough for fast forward passes.
SMALL = {
    "composed-cnn": ((1, 12, 12), 10),
    "composed-resnet18": ((3, 8, 8), 10),
    "composed-rnn": ((6,), 10),
}


def _family(name: str, **options: object) -> ComposedFamily:
    shape, classes = SMALL[name]
    return ComposedFamily({"family": name, "input_shape": shape, "num_classes": classes, **options})


def _state(fam: ComposedFamily, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every declared global tensor, drawn from one generator."""
    g = torch.Generator().manual_seed(seed)
    specs = [fam.spec_at(p) for p in LEVELS]
    return {d.name: d.build(g) for d in fam.declared_tensors(specs)}


def _declared(fam: ComposedFamily) -> dict[str, DeclaredTensor]:
    return {d.name: d for d in fam.declared_tensors([fam.spec_at(p) for p in LEVELS])}


def _inputs(name: str, batch: int = 3) -> torch.Tensor:
    shape, classes = SMALL[name]
    g = torch.Generator().manual_seed(5)
    if name == "composed-rnn":
        return torch.randint(0, classes, (batch, *shape), generator=g)
    return torch.randn(batch, *shape, generator=g)


def _randomised(layer: ComposedConv2d | ComposedLinear) -> torch.nn.Module:
    """The layer drawn afresh at its own scale (outputs of order 1)."""
    layer.reset_parameters_with(torch.Generator().manual_seed(1))
    return layer


# -- the composed layers -------------------------------------------------------------------------
@pytest.mark.parametrize("stride", [1, 2])
def test_composed_conv_explicit_and_factorised_give_the_same_output(stride: int) -> None:
    factorised = _randomised(ComposedConv2d(32, 24, 8, 6, 3, stride=stride, padding=1))
    explicit = ComposedConv2d(32, 24, 8, 6, 3, stride=stride, padding=1, mode="explicit")
    explicit.load_state_dict(factorised.state_dict())
    x = torch.randn(2, 32, 9, 9, generator=torch.Generator().manual_seed(2))
    out = factorised(x)
    assert out.shape == (2, 24, 5 if stride == 2 else 9, 5 if stride == 2 else 9)
    torch.testing.assert_close(explicit(x), out, atol=1e-5, rtol=1e-5)


def test_composed_linear_explicit_and_factorised_give_the_same_output() -> None:
    factorised = _randomised(ComposedLinear(48, 20, 16, 5))
    explicit = ComposedLinear(48, 20, 16, 5, mode="explicit")
    explicit.load_state_dict(factorised.state_dict())
    x = torch.randn(4, 7, 48, generator=torch.Generator().manual_seed(2))  # (B, L, S)
    torch.testing.assert_close(explicit(x), factorised(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(factorised(x), x @ factorised.kernel().T, atol=1e-5, rtol=1e-5)


def test_explicit_kernel_is_the_sum_over_bases_of_coefficient_times_basis() -> None:
    """W[t, g·R1 + i] = sum_r U[t, g·R2 + r] · V[r, i] (supplementary §2), by loops."""
    layer = _randomised(ComposedConv2d(24, 5, 8, 3, 3))
    u, v = layer.coef.detach()[:, :, 0, 0], layer.basis.detach()
    expected = torch.zeros(5, 24, 3, 3)
    for t in range(5):
        for g in range(3):
            for r in range(3):
                expected[t, g * 8 : (g + 1) * 8] += u[t, g * 3 + r] * v[r]
    torch.testing.assert_close(layer.kernel(), expected, atol=1e-5, rtol=1e-5)


def test_a_layer_whose_input_is_not_whole_chunks_is_refused() -> None:
    with pytest.raises(ValueError, match=r"S_p/R1 must be an integer: in_channels S_p = 30, "):
        ComposedConv2d(30, 8, 16, 4, 3)
    with pytest.raises(ValueError, match="mode must be one of factorised, explicit"):
        ComposedLinear(32, 8, 16, 4, mode="implicit")


@pytest.mark.parametrize("name", sorted(SMALL))
def test_whole_models_are_equal_in_both_modes(name: str) -> None:
    factorised, explicit = _family(name), _family(name, compose="explicit")
    state = _state(factorised)
    for p in (0.25, 1.0):
        outs = []
        for fam in (factorised, explicit):
            spec = fam.spec_at(p)
            model = fam.build(spec).eval()
            model.load_state_dict(extract(state, fam.index_map(spec)))
            with torch.no_grad():
                outs.append(model(_inputs(name)))
        assert outs[0].shape == (3, SMALL[name][1])
        # to 1e-5 of the logits' scale (a fresh ResNet's logits reach ~20 in eval mode)
        scale = max(1.0, outs[0].abs().max().item())
        torch.testing.assert_close(outs[1], outs[0], atol=1e-5 * scale, rtol=0)


# -- MACs ----------------------------------------------------------------------------------------
def _composed_macs(s: int, t: int, r1: int, r2: int, k: int, positions: int) -> int:
    """Factorised: S/R1 chunks convolved with R2 filters of R1·k² MACs, then the 1x1 mix."""
    groups = s // r1
    return positions * (groups * r2 * r1 * k * k + t * groups * r2)


def _cnn_hand_macs(p: float, r1_first: int) -> int:
    t = math.ceil(128 * p)
    return (
        28 * 28 * 64 * 9  # stem, 1 -> 64
        + _composed_macs(64, t, r1_first, 32, 3, 28 * 28)
        + _composed_macs(t, t, 16, 32, 3, 14 * 14)
        + t * 7 * 7 * 10  # head
    )


def _macs(fam: ComposedFamily, shape: tuple[int, ...]) -> list[int]:
    counter = MacCounter(fam)
    return [counter.pass_macs(PassRecord(fam.spec_at(p), "forward", 1, 1), shape) for p in LEVELS]


def _full_family(name: str, shape: tuple[int, ...], classes: int, **options: object):
    return ComposedFamily({"family": name, "input_shape": shape, "num_classes": classes, **options})


def test_cnn_macs_reproduce_table_2_with_the_table2_basis_sizes() -> None:
    """Supplementary Table 2, FLANC's CNN: 20/26/33/41 M at p = 0.25..1 (within 5 %); the
    hand counts 20.3/26.6/33.6/41.5 M (R1 = 16) and, for the code's R1 = 8 in the first
    composed layer, 23.5/33.0/43.2/54.3 M."""
    paper = _macs(_full_family("composed-cnn", (1, 28, 28), 10), (1, 28, 28))
    code = _macs(_full_family("composed-cnn", (1, 28, 28), 10, basis="code"), (1, 28, 28))
    for mine, table in zip(paper, (20e6, 26e6, 33e6, 41e6), strict=True):
        assert abs(mine - table) / table < 0.05, paper
    assert paper == [_cnn_hand_macs(p, 16) for p in LEVELS]
    assert code == [_cnn_hand_macs(p, 8) for p in LEVELS]
    assert [round(m / 1e6, 1) for m in paper] == [20.3, 26.6, 33.6, 41.5]
    assert [round(m / 1e6, 1) for m in code] == [23.5, 33.0, 43.2, 54.3]


def test_explicit_mode_is_priced_as_it_runs() -> None:
    """Explicit: the p-width convolutions (Table 2's 88 M at p = 1) plus composing each
    kernel once (T·S·R2·k² MACs, supplementary §3): more than the factorised 41.5 M."""
    fam = _full_family("composed-cnn", (1, 28, 28), 10, compose="explicit")
    full = _macs(fam, (1, 28, 28))[-1]
    p_width = 28 * 28 * 64 * 9 + 28 * 28 * 128 * 64 * 9 + 14 * 14 * 128 * 128 * 9 + 128 * 49 * 10
    composing = 128 * 64 * 32 * 9 + 128 * 128 * 32 * 9
    assert full == p_width + composing
    assert full > _cnn_hand_macs(1.0, 16)


def _resnet_hand_macs(p: float, basis: str = "code", side: int = 32, classes: int = 10) -> int:
    """Our ResNet-18 layouts counted by hand: `code`, the official code's per-block
    (R2, R1) for both convolutions; `table2`, the same R2 with each convolution's R1 an
    eighth of its full-width input (64·2^i, or half that for a stage's first conv1)."""
    banks = (((16, 8), (16, 8)), ((32, 8), (32, 16)), ((64, 16), (64, 32)), ((128, 32), (128, 64)))
    hw, cin = side * side, 64
    macs = hw * 64 * 3 * 9  # stem
    for i, blocks in enumerate(banks):
        full = 64 * 2**i
        planes = math.ceil(full * p)
        for b, (r2, r1) in enumerate(blocks):
            stride = 2 if i > 0 and b == 0 else 1
            hw //= stride * stride
            r1_in, r1_out = (r1, r1) if basis == "code" else ((full // stride) // 8, full // 8)
            macs += _composed_macs(cin, planes, r1_in, r2, 3, hw)
            macs += _composed_macs(planes, planes, r1_out, r2, 3, hw)
            if stride != 1 or cin != planes:
                macs += hw * cin * planes  # 1x1 shortcut
            cin = planes
    return macs + cin * classes


def _rnn_hand_macs(p: float, length: int = 80, classes: int = 80) -> int:
    """Three composed H x H matrices (R1 = 32, R2 = 30) and the decoder at every step."""
    h = math.ceil(512 * p)
    return length * (3 * _composed_macs(h, h, 32, 30, 1, 1) + h * classes)


def test_resnet18_and_rnn_macs_equal_the_hand_count_and_table_2() -> None:
    """Supplementary Table 2, FLANC's rows: ResNet-18 55/112/186/275 M, RNN 5/16/34/59 M.
    The ResNet-18's `table2` basis sizes (R1 = 12.5 % of each convolution's full-width
    input, §3's "R1 = 0.125c") reproduce it within 2.5 %; the authors' `code` layout is
    11 % above at p = 1. The RNN's stated sizes (R1 = 32, R2 = 30) are 8-14 % above its
    FLANC row, about its p-width row (5/17/38/66 M): 5.4/18.2/38.4/65.9 M."""
    resnet = _macs(_full_family("composed-resnet18", (3, 32, 32), 10), (3, 32, 32))
    table2 = _macs(_full_family("composed-resnet18", (3, 32, 32), 10, basis="table2"), (3, 32, 32))
    rnn = _macs(_full_family("composed-rnn", (80,), 80), (80,))
    assert resnet == [_resnet_hand_macs(p) for p in LEVELS]
    assert table2 == [_resnet_hand_macs(p, "table2") for p in LEVELS]
    assert rnn == [_rnn_hand_macs(p) for p in LEVELS]
    for mine, table in zip(table2, (55e6, 112e6, 186e6, 275e6), strict=True):
        assert abs(mine - table) / table < 0.025, table2
    assert 1.10 < resnet[-1] / 275e6 < 1.12
    for mine, flanc, p_width in zip(
        rnn, (5e6, 16e6, 34e6, 59e6), (5e6, 17e6, 38e6, 66e6), strict=True
    ):
        assert 1.08 < mine / flanc < 1.14 and abs(mine / p_width - 1) < 0.09, rnn


# -- specs ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "layer", "widths"),
    [
        ("composed-cnn", "conv3.conv", "S_p = 39, R1 = 16"),
        ("composed-resnet18", "layer1.0.conv2", "S_p = 20, R1 = 8"),
        ("composed-rnn", "rnn.ih", "S_p = 154, R1 = 32"),
    ],
)
def test_a_capacity_whose_width_is_not_whole_chunks_is_refused(name, layer, widths) -> None:
    with pytest.raises(
        SpecError,
        match=rf"{name}: layer {layer} at capacity 0.3: S_p/R1 must be an integer, got {widths}",
    ):
        _family(name).spec_at(0.3)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"capacity": 0.0}, r"capacity must be a number in \(0, 1\], got 0.0"),
        ({"capacity": 1.5}, r"capacity must be a number in \(0, 1\], got 1.5"),
        ({"compose": "implicit"}, "compose must be one of factorised, explicit, got 'implicit'"),
        ({"basis": "code", "family": "composed-rnn", "input_shape": (6,)}, "basis must be one"),
        ({"input_shape": (1, 3, 12)}, r"input_shape \(1, 3, 12\) is too small: each side"),
        ({"input_shape": (12, 12)}, r"input_shape must be \(C, H, W\), got \(12, 12\)"),
    ],
)
def test_bad_specs_are_refused_naming_the_field(change, message) -> None:
    base = {"family": "composed-cnn", "input_shape": (1, 12, 12), "num_classes": 10}
    with pytest.raises(SpecError, match=message):
        ComposedFamily({**base, **change})


def test_models_of_one_family_differ_only_in_capacity() -> None:
    fam = _family("composed-cnn")
    with pytest.raises(SpecError, match="a spec with compose = 'explicit', but the family's"):
        fam.build(fam.spec_at(0.5).replace(compose="explicit"))
    assert fam.global_spec([fam.spec_at(0.5), fam.spec_at(0.25)]) == fam.spec_at(0.5)
    assert fam.global_spec([]) == fam.base == fam.spec_at(1.0)


# -- index maps and declared tensors -------------------------------------------------------------
def test_bases_map_to_the_same_bank_rows_at_every_capacity_and_the_rest_per_capacity() -> None:
    fam = _family("composed-resnet18")
    bases = []
    for p in LEVELS:
        imap = fam.index_map(fam.spec_at(p))
        basis = {e.local: (e.global_name, e.index) for e in imap if e.local.endswith(".basis")}
        bases.append(basis)
        for e in imap:
            assert e.global_name != e.local
            if not e.local.endswith(".basis"):
                assert (e.global_name, e.index) == (f"{capacity_group(p)}/{e.local}", ())
    assert all(b == bases[0] for b in bases)
    assert len(bases[0]) == 16  # conv1 and conv2 of 8 blocks
    assert bases[0]["layer1.0.conv1.basis"] == (f"{BASIS_GROUP}/layer1.0", (slice(0, 16),))
    assert bases[0]["layer4.1.conv2.basis"] == ("basis/layer4.1", (slice(128, 256),))
    assert capacity_group(0.25) == "cap0.25" and capacity_group(1.0) == "cap1"
    # layer1.0 needs a shortcut below p = 1 only, as the code's `downsample`
    locals_ = {p: {e.local for e in fam.index_map(fam.spec_at(p))} for p in (0.5, 1.0)}
    assert "layer1.0.shortcut.weight" in locals_[0.5] - locals_[1.0]


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("composed-cnn", {}),
        ("composed-cnn", {"basis": "code"}),
        ("composed-resnet18", {}),
        ("composed-resnet18", {"basis": "table2"}),
        ("composed-rnn", {}),
    ],
)
def test_declared_tensors_are_exactly_the_maps_global_tensors(name, options) -> None:
    fam = _family(name, **options)
    declared = _declared(fam)
    mapped = set()
    for p in LEVELS:
        spec = fam.spec_at(p)
        with torch.device("meta"):
            local = fam.build(spec).state_dict()
        for e in fam.index_map(spec):
            mapped.add(e.global_name)
            d = declared[e.global_name]
            assert selected_shape(d.shape, e.index) == tuple(local[e.local].shape), e
            assert d.dtype == local[e.local].dtype
    assert mapped == set(declared)
    statistics = ("running_mean", "running_var", "num_batches_tracked")
    buffers = {n for n, d in declared.items() if d.role == "buffer"}
    assert buffers == {n for n in declared if n.endswith(statistics)}
    if name == "composed-resnet18":
        assert len(buffers) == 3 * (21 * 3 + 20)  # 3 statistics of 21 BNs per p; 20 at p = 1
        assert declared["cap0.5/layer1.0.bn1.num_batches_tracked"].dtype == torch.int64


@pytest.mark.parametrize("name", sorted(SMALL))
def test_banks_are_orthogonal_one_draw_per_resnet_block(name: str) -> None:
    """B Bᵀ = I for every bank; a ResNet block's bank is one (2·R2, R1, 3, 3) draw, so its
    conv1 and conv2 rows together are orthonormal (the code's one `orthogonal` per block)."""
    state = _state(_family(name))
    banks = {n: t for n, t in state.items() if n.startswith(f"{BASIS_GROUP}/")}
    assert len(banks) == {"composed-cnn": 2, "composed-resnet18": 8, "composed-rnn": 3}[name]
    for bank_name, bank in banks.items():
        rows = bank.reshape(bank.shape[0], -1)
        eye = torch.eye(rows.shape[0])
        torch.testing.assert_close(rows @ rows.T, eye, atol=1e-5, rtol=0, msg=bank_name)


@pytest.mark.parametrize(
    ("name", "tensor", "std"),
    [  # ResNet-18: N(0, sqrt(2 / (k²·out))) with out = T_p, k = 1
        ("composed-resnet18", "cap0.25/layer4.1.conv2.coef", math.sqrt(2 / 128)),
        ("composed-resnet18", "cap1/layer4.1.conv2.coef", math.sqrt(2 / 512)),
        ("composed-resnet18", "cap0.5/layer3.0.shortcut.weight", math.sqrt(2 / 128)),
    ],
)
def test_resnet_coefficients_start_with_the_std_of_their_own_fan(name, tensor, std) -> None:
    fam = _full_family(name, (3, 32, 32), 10)
    value = _declared(fam)[tensor].build(torch.Generator().manual_seed(3))
    assert value.numel() >= 8192
    assert abs(value.std().item() - std) / std < 0.05


@pytest.mark.parametrize(
    ("name", "tensor", "fan_in"),
    [  # PyTorch's default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = (S_p/R1)·R2
        ("composed-cnn", "cap0.25/conv3.conv.coef", 2 * 32),
        ("composed-cnn", "cap1/conv3.conv.coef", 8 * 32),
        ("composed-rnn", "cap0.25/rnn.hh.coef", 4 * 30),
        ("composed-rnn", "cap0.25/rnn.bias_h", 128),  # nn.RNN's bias: 1/sqrt(H_p)
        ("composed-cnn", "cap0.5/head.bias", 64 * 3 * 3),  # the head weight's fan in
    ],
)
def test_cnn_and_rnn_tensors_start_uniform_within_their_own_fan(name, tensor, fan_in) -> None:
    value = _declared(_family(name))[tensor].build(torch.Generator().manual_seed(3))
    bound = 1 / math.sqrt(fan_in)
    assert value.abs().max().item() <= bound
    assert value.abs().max().item() > 0.8 * bound
    if value.numel() >= 2000:  # the std of U(-b, b) is b / sqrt(3)
        assert abs(value.std().item() * math.sqrt(3) - bound) / bound < 0.05


def test_every_composed_model_initialises_from_a_generator() -> None:
    """`Strategy._init_global_state` initialises the global model: every layer must take a
    generator (`hetfl.core.init`)."""
    for name in SMALL:
        fam = _family(name)
        model = initialize(build_model(fam, fam.base), torch.Generator().manual_seed(0))
        assert all(torch.isfinite(t).all() for t in model.state_dict().values())


# -- registration --------------------------------------------------------------------------------
def test_make_family_and_the_config_take_the_composed_options_only_for_composed_models() -> None:
    fam = make_family("composed-cnn", (1, 28, 28), 10, basis="code", compose="explicit")
    assert isinstance(fam, ComposedFamily)
    assert (fam.base["basis"], fam.base["compose"], fam.base["capacity"]) == ("code", "explicit", 1)
    with pytest.raises(ValueError, match=r"width apply to the scalable models only \("):
        make_family("composed-cnn", (1, 28, 28), 10, width=0.5)
    with pytest.raises(ValueError, match=r"compose apply to the composed models only \(compos"):
        make_family("flanc-cnn", (1, 28, 28), 10, compose="explicit")
    with pytest.raises(ValueError, match="basis 'code' is not a preset of 'composed-rnn'"):
        ModelConfig(name="composed-rnn", basis="code")
    with pytest.raises(ValueError, match="model 'mlp' has one fixed architecture: basis apply"):
        ModelConfig(name="mlp", basis="code")
    assert ModelConfig(name="composed-resnet18", compose="explicit").family_options()["compose"]
