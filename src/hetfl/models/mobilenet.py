"""MobileNetV2 as a scalable family: a width ratio per stage, depth by per-stage repeats.

Sandler et al., "MobileNetV2: Inverted Residuals and Linear Bottlenecks", CVPR 2018, Table 2:
a 3x3 convolution to 32 channels, seven stages of inverted residual blocks (expansion t,
output channels c, repeats n, stride s of the first block), a 1x1 convolution to 1280
channels, global average pooling and a linear classifier. Every convolution is followed by
the model's normalisation (the factory it is given, `hetfl.models.norms`) and ReLU6, except
each block's projection, which is linear (§3.2). A block adds its input to its output where
its stride is 1 and its base input and output channels are equal (§3.3, Fig. 4): the
repeats after each stage's first block.

Choices of this family (the paper describes ImageNet at 224x224; FedFA, Park and Joe-Wong,
ECML-PKDD 2024, trains MobileNetV2 on CIFAR-100 and its Table 4 could not be read):

- **Strides.** `stem: small` (the default) is the CIFAR layout of the common CIFAR ports
  (kuangliu/pytorch-cifar `models/mobilenetv2.py`): the stem and stage 2 at stride 1, so the
  model halves its input three times (32x32 -> 4x4, Fashion-MNIST's 28x28 -> 4x4).
  `stem: imagenet` is Table 2's strides, five halvings (224 -> 7).
- **Width.** One ratio per stage (seven slots, base channels 16, 24, 32, 64, 96, 160, 320);
  the stem takes stage 1's ratio (its output is stage 1's input, which stage 1's
  unexpanded depthwise convolution keeps) and the last 1x1 convolution the last stage's.
  The paper keeps that convolution at 1280 channels for multipliers below 1 (§6.1); a
  sub-model sliced from one global model narrows it with its ratio, as HeteroFL narrows
  every hidden layer. Depthwise convolutions slice with their groups
  (`hetfl.models.slim.SlimDepthwiseConv2d`).
- **Depth.** `blocks` are the per-stage repeats, by default Table 2's n = (1, 2, 3, 4, 3,
  3, 1); a sub-model keeps each stage's first blocks. Stages 1 and 7 have one block (n = 1)
  and keep it: depth varies by the repeats of the stages with at least two. `stages`
  below 7 ends the model early, as for the other scalable families.
- **Depth candidates** (FedFA and its baselines, one depth d for the whole model:
  `hetfl.models.scalable.depth_blocks`): a stage of n repeats gets min(d, n) blocks, so
  d = 2, 3, 4 are (1, 2, 2, 2, 2, 2, 1), (1, 2, 3, 3, 3, 3, 1) and Table 2's own
  (1, 2, 3, 4, 3, 3, 1); the one-block stages keep their block, a depth of at least 2
  keeps at least 2 where a stage repeats (FedFA grafts a stage's last block, an identity
  block only from its second), and depths above 4 are refused. A HetFL choice: the
  paper's candidate table (Park and Joe-Wong, Table 5) is an image, and per-stage repeat
  counts of at least 2 are all its §5.1 text says.
- No dropout before the classifier (torchvision's has p = 0.2; the CIFAR ports have none),
  and no convolution biases, as in the residual families (`hetfl.models.blocks`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hetfl.core.spec import Spec
from hetfl.models.blocks import ConvNormAct, run_stages, slim_conv, stage_pipeline
from hetfl.models.norms import NormFactory
from hetfl.models.scalable import ARCHITECTURES, Architecture, SpecError
from hetfl.models.slim import SlimDepthwiseConv2d, SlimLinear, channels

#: Table 2's bottleneck stages: (expansion t, base output channels c, repeats n, stride s).
STAGES = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
          (6, 160, 3, 2), (6, 320, 1, 1))  # fmt: skip
#: Base channels of the stem and of the last 1x1 convolution.
STEM, LAST = 32, 1280
#: The stride of the stem and of each stage's first block, per `stem` layout.
STRIDES = {
    "imagenet": (2, tuple(s for *_, s in STAGES)),
    "small": (1, (1, 1, 2, 2, 1, 2, 1)),
}


class InvertedResidual(nn.Module):
    """MobileNetV2's block (§3.3, Table 1): a 1x1 expansion to `t * base_in` base channels
    (absent when t = 1), norm, ReLU6; a 3x3 depthwise convolution at `stride`, norm, ReLU6;
    a linear 1x1 projection to `base_out`, norm; plus the input where the stride is 1 and
    the base widths are equal. `cin` is the input's channels as built; every layer is built
    at the block's `ratio` (without expansion the depthwise convolution takes the input as
    it is, so the input must have that ratio: stage 1's is the stem's)."""

    def __init__(
        self,
        cin: int,
        base_in: int,
        base_out: int,
        ratio: float,
        stride: int,
        expansion: int,
        norm: NormFactory,
    ) -> None:
        super().__init__()
        base_hidden = base_in * expansion
        hidden = channels(ratio, base_hidden)
        self.expand: ConvNormAct | None = None
        if expansion != 1:
            self.expand = ConvNormAct(cin, base_hidden, ratio, norm, 1, 1, F.relu6)
        self.depthwise = SlimDepthwiseConv2d(hidden, 3, base=base_hidden, stride=stride, padding=1)
        self.norm1 = norm(base_hidden, ratio)
        self.project = slim_conv(hidden, base_out, ratio, 1, 1)
        self.norm2 = norm(base_out, ratio)
        # An identity block (stride 1, equal base widths) adds its input, as the residual
        # families' blocks without a shortcut do (`hetfl.models.blocks`).
        self.identity = stride == 1 and base_in == base_out

    def forward(self, x: torch.Tensor, width: float | None = None) -> torch.Tensor:
        h = x if self.expand is None else self.expand(x, width)  # (B, t C_in, H, W)
        h = F.relu6(self.norm1(self.depthwise(h, width), width))  # (B, t C_in, H/s, W/s)
        h = self.norm2(self.project(h, width), width)  # (B, C_out, H/s, W/s)
        return x + h if self.identity else h


class MobileNetV2(nn.Module):
    """The network of the module docstring for a checked spec (`widths` and `blocks` per
    stage, `stages`, `stem`)."""

    BASE = tuple(c for _, c, _, _ in STAGES)
    REPEATS = tuple(n for _, _, n, _ in STAGES)

    def __init__(self, spec: Spec, norm: NormFactory) -> None:
        super().__init__()
        widths = spec["widths"]
        stem_stride, strides = STRIDES[spec["stem"]]
        self.stem = ConvNormAct(
            spec["input_shape"][0], STEM, widths[0], norm, 3, stem_stride, F.relu6
        )
        self.stages = nn.ModuleList()
        c, base_in = channels(widths[0], STEM), STEM
        for i in range(spec["stages"]):
            t, base_out, _, _ = STAGES[i]
            blocks = nn.ModuleList()
            for b in range(spec["blocks"][i]):
                stride = strides[i] if b == 0 else 1
                blocks.append(InvertedResidual(c, base_in, base_out, widths[i], stride, t, norm))
                c, base_in = channels(widths[i], base_out), base_out
            self.stages.append(blocks)
        last = spec["stages"] - 1
        self.last = ConvNormAct(c, LAST, widths[last], norm, 1, 1, F.relu6)
        self.head = SlimLinear(channels(widths[last], LAST), spec["num_classes"], base_out=None)
        self.pipeline = stage_pipeline(self.stages)

    def forward(self, x: torch.Tensor, width: float | None = None) -> torch.Tensor:
        return run_stages(
            self.stem, self.stages, self.last, self.head, x, width
        )  # (B, num_classes)


def halvings(spec: Spec) -> int:
    """How many times the model for `spec` halves its input side."""
    stem_stride, strides = STRIDES[spec["stem"]]
    return [stem_stride, *strides[: spec["stages"]]].count(2)


def check_repeats(spec: Spec) -> None:
    """Stages whose Table 2 repeat count is 1 (the first and the last) keep one block."""
    fixed = [i for i, n in enumerate(MobileNetV2.REPEATS) if n == 1 and spec["blocks"][i] != 1]
    if fixed:
        i = fixed[0]
        raise SpecError(
            f"mobilenetv2: stage {i + 1} has one block (Sandler et al., Table 2, n = 1) and "
            f"cannot be repeated, got blocks {spec['blocks']}; depth varies by the repeats "
            f"of stages 2-6 (blocks[{i}] must be 1)"
        )


ARCHITECTURES.register(
    "mobilenetv2",
    Architecture(
        MobileNetV2,
        MobileNetV2.BASE,
        len(STAGES),
        MobileNetV2.REPEATS,
        lambda s: 2 ** halvings(s),
        "MobileNetV2 (Sandler et al. 2018): widths per stage, depth by repeats (FedFA)",
        check=check_repeats,
        max_repeats=MobileNetV2.REPEATS,
    ),
)
