"""MobileNetV2 (`hetfl.models.mobilenet`): against torchvision's parameter count, MACs
counted by hand from Table 2, depthwise convolutions sliced with their groups, depth by
per-stage repeats, and the checks that refuse what the family cannot build.

Sandler et al., "MobileNetV2: Inverted Residuals and Linear Bottlenecks", CVPR 2018.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from hetfl.core.init import initialize
from hetfl.core.spec import prefix_index
from hetfl.core.state import extract
from hetfl.core.types import PassRecord
from hetfl.models import ScalableFamily, SpecError
from hetfl.models.slim import SlimDepthwiseConv2d
from hetfl.systems.costs import MacCounter

#: Table 2 as the paper prints it: (t, c, n, s) per bottleneck stage.
TABLE_2 = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
           (6, 160, 3, 2), (6, 320, 1, 1)]  # fmt: skip


def _family(shape=(1, 28, 28), classes=10, **base) -> ScalableFamily:
    return ScalableFamily(
        {"family": "mobilenetv2", "input_shape": shape, "num_classes": classes, **base}
    )


def _spec(family: ScalableFamily, **changes):
    return family.normalise({**family.base, **changes})


def _hand_forward_macs(side: int, channels_in: int, classes: int, stem: str, p: float) -> int:
    """Multiply-accumulates of one forward pass of one sample, layer by layer from Table 2:
    ceil(p x channels) everywhere; a 3x3 convolution of stride s (padding 1) gives side
    ceil(side / s); a 1x1 convolution costs side^2 x in x out, a depthwise 3x3 one
    side^2 x 9 per channel."""

    def ch(c: int) -> int:
        return math.ceil(p * c)

    strides = [s for *_, s in TABLE_2] if stem == "imagenet" else [1, 1, 2, 2, 1, 2, 1]
    side = math.ceil(side / (2 if stem == "imagenet" else 1))
    stem_macs = side * side * channels_in * ch(32) * 9
    macs, base_in = stem_macs, 32
    for (t, c, n, _), stride in zip(TABLE_2, strides, strict=True):
        for b in range(n):
            cin, hidden = ch(base_in), ch(base_in * t)
            if t != 1:
                macs += side * side * cin * hidden  # 1x1 expansion
            side = math.ceil(side / (stride if b == 0 else 1))
            macs += side * side * hidden * 9  # 3x3 depthwise
            macs += side * side * hidden * ch(c)  # 1x1 projection
            base_in = c
    macs += side * side * ch(320) * ch(1280) + ch(1280) * classes  # last 1x1, classifier
    return macs


def test_the_family_has_torchvisions_parameter_count() -> None:
    """Table 2's ImageNet model (stem imagenet, 224x224, 1000 classes) holds 3,504,872
    parameters, torchvision's `mobilenet_v2` count (`MobileNet_V2_Weights.IMAGENET1K_V1`
    meta, "num_params"): the same layers, BN affines included, no convolution biases."""
    family = _family((3, 224, 224), 1000, stem="imagenet")
    with torch.device("meta"):
        model = family.build(family.global_spec([]))
    assert sum(p.numel() for p in model.parameters()) == 3_504_872


def test_forward_macs_at_224_are_table_4s_300_million() -> None:
    """Table 2's ImageNet model: one forward pass of one 224x224 image equals the hand
    count, about the paper's 300 M multiply-adds (Table 4; counted on the meta device,
    so nothing is computed)."""
    family = _family((3, 224, 224), 1000, stem="imagenet")
    with torch.device("meta"):
        model = family.build(family.global_spec([])).eval()
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            model(torch.zeros(1, 3, 224, 224))
    macs = counter.get_total_flops() // 2
    assert macs == _hand_forward_macs(224, 3, 1000, "imagenet", 1.0)
    assert abs(macs / 1e6 - 300) < 3, macs


def test_the_cost_model_prices_depthwise_convolutions_by_their_groups() -> None:
    """A forward pass of one sample at width 0.5 equals the hand count; a training pass of
    two adds the weights' gradients (as many MACs again: torch's counter alone prices a
    depthwise convolution's weight gradient `channels` times too high) and the inputs'
    gradients of every layer but the stem (whose input, the data, needs none)."""
    shape = (1, 16, 16)
    family = _family(shape, 10)
    spec = _spec(family, width=0.5)
    counter = MacCounter(family)
    forward = counter.pass_macs(PassRecord(spec, "forward", 1, 1), shape)
    assert forward == _hand_forward_macs(16, 1, 10, "small", 0.5)
    stem_macs = 16 * 16 * 1 * 16 * 9  # stride 1, 16 = ceil(0.5 x 32) channels
    train = counter.pass_macs(PassRecord(spec, "train", 2, 1), shape)
    assert train == 2 * (3 * forward - stem_macs)


def test_a_depthwise_slice_is_the_depthwise_convolution_of_the_leading_channels() -> None:
    """Built for 8 channels (base 16, ratio 0.5) and run at width 0.25: the first 4
    filters, one per channel, `groups = 4`; each output channel is its own input channel
    convolved with its own 3x3 filter."""
    conv = SlimDepthwiseConv2d(8, 3, base=16, stride=2, padding=1)
    initialize(conv, torch.Generator().manual_seed(0))
    assert conv.weight.shape == (8, 1, 3, 3)
    x = torch.randn(2, 4, 6, 6, generator=torch.Generator().manual_seed(1))
    out = conv(x, width=0.25)
    assert out.shape == (2, 4, 3, 3)
    for j in range(4):
        alone = F.conv2d(x[:, j : j + 1], conv.weight[j : j + 1], None, 2, 1)
        torch.testing.assert_close(out[:, j : j + 1], alone, rtol=0, atol=1e-6)
    assert torch.equal(conv(x), out)  # without a width, the input's channels decide
    with pytest.raises(ValueError, match="needs 8 channels, the input has 4"):
        conv(x, width=0.5)
    with pytest.raises(ValueError, match="input has 9 channels, the layer holds 8"):
        conv(torch.zeros(1, 9, 6, 6))


def test_index_map_slices_depthwise_filters_and_keeps_each_stages_first_repeats() -> None:
    family = _family()
    spec = _spec(family, width=0.5, blocks=(1, 2, 2, 1, 3, 3, 1))
    imap = {e.local: e.index for e in family.index_map(spec)}
    # Stage 1 (t = 1) has no expansion: its depthwise filters take the stem's 16 channels.
    assert "stages.0.0.expand.conv.weight" not in imap
    assert imap["stages.0.0.depthwise.weight"] == prefix_index(16, 1, 3, 3)
    # Stage 2 from 16 base channels: 96 expanded (48 at 0.5), projected to 24 (12).
    assert imap["stages.1.0.expand.conv.weight"] == prefix_index(48, 8, 1, 1)
    assert imap["stages.1.0.depthwise.weight"] == prefix_index(48, 1, 3, 3)
    assert imap["stages.1.0.project.weight"] == prefix_index(12, 48, 1, 1)
    assert imap["stages.1.1.depthwise.weight"] == prefix_index(72, 1, 3, 3)  # 24 x 6 x 0.5
    assert imap["last.conv.weight"] == prefix_index(640, 160, 1, 1)
    assert imap["head.weight"] == prefix_index(10, 640)
    # Depth: the first repeats of each stage.
    assert "stages.3.0.project.weight" in imap and "stages.3.1.project.weight" not in imap
    assert "stages.2.1.project.weight" in imap and "stages.2.2.project.weight" not in imap
    state = initialize(family.build(family.global_spec([])), torch.Generator()).state_dict()
    assert state["stages.1.1.depthwise.weight"].shape == (144, 1, 3, 3)
    part = extract(state, family.index_map(spec))
    assert torch.equal(
        part["stages.1.1.depthwise.weight"], state["stages.1.1.depthwise.weight"][:72]
    )
    # The input joins the output in the repeats only (stride 1, equal base widths).
    model = family.build(spec)
    assert [b.identity for b in model.stages[1]] == [False, True]
    assert [b.identity for b in model.stages[4]] == [False, True, True]


def test_widths_may_differ_and_shrink_from_stage_to_stage() -> None:
    """A block reads its input's channels, so per-stage ratios need not grow (the
    stem shares stage 1's ratio, the last convolution stage 7's)."""
    family = _family()
    spec = _spec(family, widths=(1.0, 0.5, 0.75, 0.25, 1.0, 0.5, 0.25))
    model = initialize(family.build(spec), torch.Generator().manual_seed(0))
    assert model.stem.conv.weight.shape == (32, 1, 3, 3)
    assert model.last.conv.weight.shape == (320, 80, 1, 1)  # 1280 and 320 at 0.25
    assert model(torch.randn(2, 1, 28, 28)).shape == (2, 10)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"blocks": (2, 2, 3, 4, 3, 3, 1)}, r"stage 1 has one block .*blocks\[0\] must be 1"),
        ({"blocks": (1, 2, 3, 4, 3, 3, 2)}, r"stage 7 has one block"),
        ({"blocks": (1, 2, 3)}, "blocks needs 7 integers >= 1"),
        ({"blocks": (1, 0, 3, 4, 3, 3, 1)}, "blocks needs 7 integers >= 1"),
        ({"input_shape": (1, 4, 4)}, "each side must be at least 8"),
        ({"stem": "imagenet"}, "each side must be at least 32"),
        ({"widths": (1.0, 0.5)}, "widths needs 7 values"),
    ],
)
def test_specs_the_family_cannot_build_are_refused(changes, message) -> None:
    family = _family()
    with pytest.raises(SpecError, match=message):
        family.normalise({**family.base, **changes})
