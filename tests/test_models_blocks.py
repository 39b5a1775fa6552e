"""Injected blocks and norms (`hetfl.models.blocks`, `hetfl.models.norms`).

Each normalisation kind, given to a small scalable family, is checked tensor for tensor and
output for output against a module built by hand from plain torch layers with the same
weights; the per-capacity kind's map and aggregation against a hand computation; the
residual blocks (the bottleneck DTFL needs among them) against hand-built blocks and their
own wider copies; bad kinds against their messages; and `models/` for string switches.
"""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hetfl.models
from hetfl.config import ConfigError, ModelConfig, validate
from hetfl.core.init import initialize
from hetfl.core.server.assign import PerClient, UniformSampling
from hetfl.core.server.strategy import Aggregation, Strategy
from hetfl.core.server.weighting import weighting
from hetfl.core.spec import prefix_index
from hetfl.core.training import LocalTraining
from hetfl.core.types import ClientInfo, ClientResult
from hetfl.models import ARCHITECTURES, ScalableFamily, SpecError
from hetfl.models.blocks import BasicBlock, Bottleneck, PreActBlock, ResidualBlock
from hetfl.models.norms import NORMS, BatchNorm
from hetfl.models.scalable import ResNet
from strategies import trained

SHAPE = (1, 8, 8)  # stage-cnn, 2 stages: 8x8 -> 4x4 -> 2x2
CLASSES = 3
X = torch.randn(6, *SHAPE, generator=torch.Generator().manual_seed(7))


def _family(bn: str, **base: object) -> ScalableFamily:
    spec = {"family": "stage-cnn", "input_shape": SHAPE, "num_classes": CLASSES, "stages": 2}
    return ScalableFamily({**spec, "bn": bn, **base})


def _model(fam: ScalableFamily, width: float) -> nn.Module:
    spec = fam.normalise({**fam.base, "width": width})
    return initialize(fam.build(spec), torch.Generator().manual_seed(0))


class HandCNN(nn.Module):
    """The 2-stage stage CNN from plain layers: conv3x3/2 -> [x / scale in training] ->
    norm -> ReLU, twice, global average pooling, a linear head."""

    def __init__(self, chans: tuple[int, int], norm, *, bias: bool, scale: float | None) -> None:
        super().__init__()
        self.conv0 = nn.Conv2d(SHAPE[0], chans[0], 3, 2, 1, bias=bias)
        self.norm0 = norm(chans[0])
        self.conv1 = nn.Conv2d(chans[0], chans[1], 3, 2, 1, bias=bias)
        self.norm1 = norm(chans[1])
        self.head = nn.Linear(chans[1], CLASSES)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv, norm in ((self.conv0, self.norm0), (self.conv1, self.norm1)):
            h = conv(x)
            if self.training and self.scale is not None:
                h = h / self.scale
            x = torch.relu(norm(h))
        return self.head(x.mean(dim=(2, 3)))


def _hand_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The family's tensors under the hand-built module's names (`stages.1.norm.x` ->
    `norm1.x`)."""
    return {re.sub(r"^stages\.(\d)\.(conv|norm)\.", r"\2\1.", k): v for k, v in state.items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# (bn, scaler, the hand-built norm, conv bias, the scale dividing pre-norm activations)
KINDS = [
    ("batch", False, nn.BatchNorm2d, False, None),
    ("batch", True, nn.BatchNorm2d, False, 0.5),
    ("static", False, lambda c: nn.BatchNorm2d(c, track_running_stats=False), False, None),
    ("static", True, lambda c: nn.BatchNorm2d(c, track_running_stats=False), False, 0.5),
    ("per-capacity", False, nn.BatchNorm2d, False, None),
    ("none", False, lambda c: nn.Identity(), True, None),
]


@pytest.mark.parametrize(("bn", "scaler", "norm", "bias", "scale"), KINDS)
def test_each_norm_kind_equals_a_hand_built_module(bn, scaler, norm, bias, scale) -> None:
    """Width 0.5 (16 and 32 channels): the same tensors under the same shapes (a strict
    load), the same outputs in training (twice, so the running statistics the first pass
    moved are used by none but eval) and in evaluation, the same state after training."""
    model = _model(_family(bn, scaler=scaler), 0.5)
    hand = HandCNN((16, 32), norm, bias=bias, scale=scale)
    hand.load_state_dict(_hand_names(model.state_dict()), strict=True)
    for training in (True, True, False):
        model.train(training)
        hand.train(training)
        assert torch.equal(model(X), hand(X)), (bn, training)
    assert _same(_hand_names(model.state_dict()), hand.state_dict())


def _per_width_source(
    state: dict[str, torch.Tensor], key: str, hand_name: str, hand_tensor: torch.Tensor
) -> torch.Tensor:
    """The per-width model's tensor behind a hand-built one at the width of level `key`:
    its leading part, and for the running statistics the level's own."""
    found = re.fullmatch(r"(conv|norm)(\d)\.(\w+)", hand_name)
    name = hand_name
    if found is not None:
        kind, i, t = found.groups()
        own = t in ("running_mean", "running_var")
        name = f"stages.{i}.{kind}.{t}_{key}" if own else f"stages.{i}.{kind}.{t}"
    if name.endswith("num_batches_tracked"):  # per-width norms keep no counter
        return hand_tensor
    return state[name][tuple(slice(0, n) for n in hand_tensor.shape)]


def test_per_width_norm_equals_one_hand_built_batchnorm_per_width() -> None:
    """FjORD's kind, built at 0.5 with levels 0.25 and 0.5: run at width p, the model is a
    plain network of p's channels whose norms hold the leading part of the shared affine
    and p's own running statistics; training at p moves p's statistics only."""
    model = _model(_family("per-width", levels=(0.25, 0.5)), 0.5)
    for p, key, chans in ((0.25, "w0p25", (8, 16)), (0.5, "w0p5", (16, 32))):
        hand = HandCNN(chans, nn.BatchNorm2d, bias=False, scale=None)
        state = model.state_dict()
        hand.load_state_dict(
            {k: _per_width_source(state, key, k, v) for k, v in hand.state_dict().items()}
        )
        others = {
            k: v.clone() for k, v in state.items() if k.endswith("_w0p5" if p < 0.5 else "_w0p25")
        }
        for training in (True, False):
            model.train(training)
            hand.train(training)
            assert torch.equal(model(X, width=p), hand(X)), (p, training)
        for i in (0, 1):
            for stat in ("running_mean", "running_var"):
                assert torch.equal(
                    model.state_dict()[f"stages.{i}.norm.{stat}_{key}"],
                    hand.state_dict()[f"norm{i}.{stat}"],
                )
        assert _same({k: model.state_dict()[k] for k in others}, others)


def test_per_capacity_maps_every_norm_tensor_to_its_capacity_group_by_hand() -> None:
    fam = _family("per-capacity")
    spec = fam.normalise({**fam.base, "width": 0.5})
    got = {e.local: (e.global_name, e.index) for e in fam.index_map(spec)}
    norm = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")
    expected = {}
    for i, c, cin in ((0, 16, 1), (1, 32, 16)):
        expected[f"stages.{i}.conv.weight"] = (
            f"stages.{i}.conv.weight",
            prefix_index(c, cin, 3, 3),
        )
        for t in norm:
            shape = () if t == "num_batches_tracked" else (c,)
            expected[f"stages.{i}.norm.{t}"] = (f"cap0.5/stages.{i}.norm.{t}", prefix_index(*shape))
    expected["head.weight"] = ("head.weight", prefix_index(CLASSES, 32))
    expected["head.bias"] = ("head.bias", prefix_index(CLASSES))
    assert got == expected
    # Every slot at its ratio names the group; distinct slot widths name theirs.
    mixed = fam.normalise({**fam.base, "widths": (1.0, 0.5, 0.25, 0.25)})
    assert {e.global_name.split("/")[0] for e in fam.index_map(mixed) if "/" in e.global_name} == {
        "cap1-0.5"
    }
    # A fixed-width layer's norm is kept per capacity too (FLANC's CNN stem).
    flanc = ScalableFamily(
        {"family": "flanc-cnn", "input_shape": (1, 8, 8), "num_classes": 3, "bn": "per-capacity"}
    )
    stem = {e.local: e.global_name for e in flanc.index_map(flanc.normalise({**flanc.base}))}
    assert stem["stem.norm.running_var"] == "cap1/stem.norm.running_var"
    assert stem["stem.conv.weight"] == "stem.conv.weight"


def test_per_capacity_norms_average_within_their_capacity_only() -> None:
    """Clients 0 and 1 at width 0.5 and client 2 at width 1 send 1, 3 and 8 everywhere
    (uniform weights). The shared convolutions average over every client covering an
    element; each capacity's norm tensors over that capacity's clients: (1 + 3) / 2 = 2
    for cap0.5, 8 for cap1, both starting as copies of the global model's norm."""
    fam = _family("per-capacity")
    widths = {0: 0.5, 1: 0.5, 2: 1.0}
    strategy = Strategy(
        fam,
        train=LocalTraining(lr=0.1),
        sampler=UniformSampling(3),
        assignment=PerClient(lambda info: fam.normalise({**fam.base, "width": widths[info.cid]})),
        aggregation=Aggregation(weighting=weighting("uniform")),
    )
    infos = [ClientInfo(cid, 10, SHAPE, (0, 1, 2)) for cid in widths]
    state = strategy.setup(infos, torch.Generator().manual_seed(0))
    groups = {k.split("/")[0] for k in state if "/" in k}
    assert groups == {"cap0.5", "cap1"} and "stages.0.norm.weight" not in state
    assert torch.equal(state["cap0.5/stages.1.norm.running_var"], torch.ones(64))
    tasks = strategy.plan(1, state, infos, torch.Generator().manual_seed(1))
    results = [
        ClientResult(t.cid, {k: torch.full_like(v, value) for k, v in t.payload.items()}, 10, 1, 0)
        for t, value in zip(tasks, (1.0, 3.0, 8.0), strict=True)
    ]
    after = strategy.aggregate(1, state, trained(tasks, results)).state
    conv = after["stages.0.conv.weight"]  # (32, 1, 3, 3): channels 0-15 held by all three
    assert torch.all(conv[:16] == 4.0) and torch.all(conv[16:] == 8.0)
    assert torch.all(after["cap0.5/stages.0.norm.weight"][:16] == 2.0)
    assert torch.equal(after["cap0.5/stages.0.norm.weight"][16:], torch.ones(16))  # kept
    assert torch.all(after["cap1/stages.0.norm.weight"] == 8.0)
    assert int(after["cap0.5/stages.1.norm.num_batches_tracked"]) == 2


# -- the residual blocks -------------------------------------------------------------------------
class HandBottleneck(nn.Module):
    """The bottleneck from plain layers, under the block's own tensor names."""

    def __init__(self, cin: int, mid: int, out: int, stride: int, projection: bool) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, mid, 1, bias=False)
        self.norm1 = nn.BatchNorm2d(mid)
        self.conv2 = nn.Conv2d(mid, mid, 3, stride, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(mid)
        self.conv3 = nn.Conv2d(mid, out, 1, bias=False)
        self.norm3 = nn.BatchNorm2d(out)
        if projection:
            self.shortcut = nn.Conv2d(cin, out, 1, stride, bias=False)
            self.norm_sc = nn.BatchNorm2d(out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm1(self.conv1(x)))
        h = torch.relu(self.norm2(self.conv2(h)))
        h = self.norm3(self.conv3(h))
        skip = self.norm_sc(self.shortcut(x)) if hasattr(self, "shortcut") else x
        return torch.relu(h + skip)


@pytest.mark.parametrize(
    ("stride", "base_in", "projection"),
    [(2, 16, True), (1, 16, True), (1, 32, False)],  # base planes 8: 32 base channels out
)
def test_bottleneck_equals_a_hand_built_block(stride: int, base_in: int, projection: bool) -> None:
    """Planes 8 at ratio 0.5: 1x1 to 4, 3x3 (the stride) to 4, 1x1 to 16 channels; a
    projection shortcut where the stride or the base widths (in 16 or 32, out 4 x 8)
    differ, the identity otherwise."""
    cin = base_in // 2
    block = Bottleneck(cin, base_in, 8, 0.5, stride, BatchNorm())
    initialize(block, torch.Generator().manual_seed(0))
    hand = HandBottleneck(cin, 4, 16, stride, projection)
    hand.load_state_dict(block.state_dict(), strict=True)
    x = torch.randn(2, cin, 8, 8, generator=torch.Generator().manual_seed(1))
    for training in (True, False):
        block.train(training)
        hand.train(training)
        out = block(x)
        assert out.shape == (2, 16, 8 // stride, 8 // stride)
        assert torch.equal(out, hand(x))
    assert _same(block.state_dict(), hand.state_dict())


def _pre_act_by_hand(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    h = torch.relu(F.batch_norm(x, None, None, block.norm1.weight, block.norm1.bias, True))
    skip = x if block.shortcut is None else F.conv2d(h, block.shortcut.weight, None, 2)
    h = F.conv2d(h, block.conv1.weight, None, 2, 1)
    h = torch.relu(F.batch_norm(h, None, None, block.norm2.weight, block.norm2.bias, True))
    return F.conv2d(h, block.conv2.weight, None, 1, 1) + skip


def test_pre_activation_block_normalises_its_input_by_hand() -> None:
    """HeteroFL's static BN (batch statistics) in the pre-activation block, stride 2 from
    16 to 32 base channels at ratio 0.5: the projection takes the normalised input."""
    block = PreActBlock(8, 16, 32, 0.5, 2, BatchNorm(track_running_stats=False))
    initialize(block, torch.Generator().manual_seed(0))
    assert block.norm1.weight.shape == (8,) and block.conv2.weight.shape == (16, 16, 3, 3)
    x = torch.randn(2, 8, 8, 8, generator=torch.Generator().manual_seed(1))
    assert torch.equal(block(x), _pre_act_by_hand(block, x))


@pytest.mark.parametrize("block_class", [BasicBlock, PreActBlock, Bottleneck])
@pytest.mark.parametrize("stride", [1, 2])
def test_a_block_built_at_p_equals_a_wider_block_run_at_p(block_class, stride: int) -> None:
    """Width 1 and width 0.25 blocks of 16 base input and 16 base planes, the narrow one
    holding the leading part of every wide tensor: the same outputs in training and
    evaluation, through the projection (stride 2) and without (stride 1, basic blocks)."""
    block: ResidualBlock = block_class
    wide = block(16, 16, 16, 1.0, stride, BatchNorm())
    narrow = block(4, 16, 16, 0.25, stride, BatchNorm())
    initialize(wide, torch.Generator().manual_seed(0))
    wide_state = wide.state_dict()
    narrow.load_state_dict(
        {
            k: wide_state[k][tuple(slice(0, n) for n in v.shape)]
            for k, v in narrow.state_dict().items()
        }
    )
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    for training in (True, False):
        wide.train(training)
        narrow.train(training)
        assert torch.equal(wide(x, width=0.25), narrow(x))
    assert narrow(x).shape[1] == 4 * block_class.expansion


def test_a_resnet_is_given_its_block_class() -> None:
    """The registered ResNets differ only by block (post- or pre-activation, with the
    pre-activation stem without a norm and a final norm); a bottleneck ResNet widens each
    stage's output by 4 and is width-sliceable like the others."""
    spec = ScalableFamily.normalise(
        {"family": "resnet18", "input_shape": (3, 8, 8), "num_classes": 5, "stages": 2,
         "blocks": 1, "width": 0.25}
    )  # fmt: skip
    post = ResNet(spec, BatchNorm(), BasicBlock)
    pre = ResNet(spec, BatchNorm(), PreActBlock)
    assert post.stem_norm is not None and post.final_norm is None
    assert pre.stem_norm is None and pre.final_norm is not None
    assert [type(b) for s in pre.stages for b in s] == [PreActBlock, PreActBlock]
    assert ARCHITECTURES.get("preresnet").make(spec, BatchNorm()).state_dict().keys() == (
        pre.state_dict().keys()
    )
    narrow = initialize(ResNet(spec, BatchNorm(), Bottleneck), torch.Generator().manual_seed(0))
    wide = initialize(
        ResNet(spec.replace(widths=(0.5,) * 4), BatchNorm(), Bottleneck),
        torch.Generator().manual_seed(0),
    )
    assert narrow.stages[1][0].conv3.weight.shape == (128, 32, 1, 1)  # 0.25 * 4 * 128
    assert narrow.head.weight.shape == (5, 128)
    wide_state = wide.state_dict()
    narrow.load_state_dict(
        {
            k: wide_state[k][tuple(slice(0, n) for n in v.shape)]
            for k, v in narrow.state_dict().items()
        }
    )
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    for training in (True, False):
        wide.train(training)
        narrow.train(training)
        assert torch.equal(wide(x, width=0.25), narrow(x))


def _preresnet(**base: object) -> ScalableFamily:
    spec = {"family": "preresnet", "input_shape": (3, 8, 8), "num_classes": CLASSES}
    return ScalableFamily({**spec, "bn": "static", **base})


def test_a_section_narrower_than_the_one_before_takes_its_wider_input() -> None:
    """Per-section widths that shrink (1, 0.5, 0.25, 0.25): each section's first block
    normalises the previous section's output, so its first norm is built at the ratio of
    the section before (64 = 64 x 1 channels into section 2, 64 = 128 x 0.5 into section
    3, 64 = 256 x 0.25 into section 4), where its own ratio would give 64 x 0.5 = 32 and
    128 x 0.25 = 32 for sections 2 and 3; the model trains and evaluates; cut from a global
    model of the per-section maxima, its tensors are the leading slices of the global ones."""
    fam = _preresnet()
    spec = fam.normalise({**fam.base, "widths": (1.0, 0.5, 0.25, 0.25), "blocks": 2})
    model = initialize(fam.build(spec), torch.Generator().manual_seed(0))
    first = [s[0] for s in model.stages]
    assert [b.norm1.weight.shape[0] for b in first] == [64, 64, 64, 64]
    assert first[1].conv1.weight.shape == (64, 64, 3, 3)  # 128 * 0.5 out of 64 * 1 in
    assert [s[1].norm1.weight.shape[0] for s in model.stages] == [64, 64, 64, 128]
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    for training in (True, False):
        assert model.train(training)(x).shape == (2, CLASSES)
    wide = fam.normalise({**fam.base, "widths": (1.0, 1.0, 0.5, 0.5), "blocks": 2})
    state = initialize(fam.build(fam.global_spec([spec, wide])), torch.Generator()).state_dict()
    for entry in fam.index_map(spec):
        assert model.state_dict()[entry.local].shape == state[entry.global_name][entry.index].shape


def test_sections_report_each_stages_blocks_and_which_are_identity_blocks() -> None:
    """Blocks (2, 3, 1, 1): the first block of section 1 is an identity block (stride 1, 64
    into 64 base channels after the stem); every later section's first block strides and
    projects; every block after the first is an identity block."""
    fam = _preresnet()
    spec = fam.normalise({**fam.base, "blocks": (2, 3, 1, 1), "width": 0.5})
    sections = fam.sections(spec)
    assert [[b.path for b in s] for s in sections] == [
        ["stages.0.0", "stages.0.1"],
        ["stages.1.0", "stages.1.1", "stages.1.2"],
        ["stages.2.0"],
        ["stages.3.0"],
    ]
    assert [[b.identity for b in s] for s in sections] == [
        [True, True], [False, True, True], [False], [False]
    ]  # fmt: skip
    assert sections[1][1].tensors == tuple(
        f"stages.1.1.{k}" for k in ("conv1.weight", "conv2.weight", "norm1.weight",
                                    "norm1.bias", "norm2.weight", "norm2.bias")
    )  # fmt: skip
    assert "stages.1.0.shortcut.weight" in sections[1][0].tensors
    names = {e.local for e in fam.index_map(spec)}
    assert {t for s in sections for b in s for t in b.tensors} <= names
    with pytest.raises(SpecError, match="stage-cnn has no residual sections"):
        _family("batch").sections(_family("batch").base)


# -- bad kinds and the edge ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("base", "message"),
    [
        (
            {"bn": "group"},
            "stage-cnn: bn must be one of batch, none, per-capacity, per-width, static, "
            "got 'group'",
        ),
        ({"bn": "per-width"}, "bn 'per-width' needs the width levels"),
        ({"bn": "per-width", "levels": (0.5, 1.0), "scaler": True}, "does not combine"),
    ],
)
def test_a_bad_norm_kind_is_a_clear_error(base, message: str) -> None:
    with pytest.raises(SpecError, match=re.escape(message)):
        _family(**{"bn": "batch", **base})


def test_the_config_accepts_exactly_the_registered_norm_kinds() -> None:
    annotation = ModelConfig.model_fields["bn"].annotation
    (kinds,) = [a for a in typing.get_args(annotation) if a is not type(None)]
    assert sorted(typing.get_args(kinds)) == NORMS.names()
    raw = {"model": {"name": "stage-cnn", "bn": "group"}}
    with pytest.raises(ConfigError, match="per-capacity"):
        validate(raw)


MODELS = Path(hetfl.models.__file__).parent


def string_switches(folder: Path) -> list[str]:
    """Lines of `folder`'s modules that compare a string to a normalisation kind or a
    scalable family name, or compare the spec's `family` or `bn` at all."""
    names = "|".join(re.escape(n) for n in [*NORMS.names(), *ARCHITECTURES.names()])
    quoted = rf"[\"'](?:{names})[\"']"
    pattern = re.compile(
        rf"(?:==|!=)\s*{quoted}|{quoted}\s*(?:==|!=)|\bin\s*[(\[{{][^)\]}}]*{quoted}"
        r"|spec\[[\"'](?:family|bn)[\"']\]\s*(?:==|!=|in\b|not\b)"
    )
    return [
        f"{path.name}:{number}: {line.strip()}"
        for path in sorted(folder.glob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]


def test_no_string_switch_on_a_family_or_a_norm_kind_is_left_in_models() -> None:
    assert len(list(MODELS.glob("*.py"))) > 10  # the scan sees the package
    assert string_switches(MODELS) == []


def test_the_switch_scan_catches_the_forms_it_looks_for(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text(
        'a = spec["family"] == "preresnet"\nif mode == "per-width":\n'
        'bias = spec["bn"] == "none"\nif mode in ("batch", "static"):\nok = x == "imagenet"\n'
    )
    assert [s.split(":")[1] for s in string_switches(tmp_path)] == ["1", "2", "3", "4"]
