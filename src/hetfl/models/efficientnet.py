"""EfficientNetV2 as a scalable family: a width ratio per stage, depth by per-stage repeats.

Tan and Le, "EfficientNetV2: Smaller Models and Faster Training", ICML 2021, Table 4
(EfficientNetV2-S): a 3x3 convolution to 24 channels, six stages of blocks (the block kind,
its expansion, output channels, repeats and the stride of the first block), a 1x1
convolution to 1280 channels, global average pooling and a linear classifier:

    stage 1  Fused-MBConv1  k3x3             24 channels   2 layers  stride 1
    stage 2  Fused-MBConv4  k3x3             48 channels   4 layers  stride 2
    stage 3  Fused-MBConv4  k3x3             64 channels   4 layers  stride 2
    stage 4  MBConv4        k3x3  SE 0.25   128 channels   6 layers  stride 2
    stage 5  MBConv6        k3x3  SE 0.25   160 channels   9 layers  stride 1
    stage 6  MBConv6        k3x3  SE 0.25   256 channels  15 layers  stride 2

The blocks (§3.2 and Fig. 2): **MBConv** is a 1x1 expansion to `e x` the input's channels,
a 3x3 depthwise convolution, squeeze-and-excitation and a linear 1x1 projection;
**Fused-MBConv** replaces the expansion and the depthwise convolution by one 3x3
convolution (with e = 1 it is that convolution alone, to the output channels). Every
convolution but a projection is followed by the model's normalisation (the factory it is
given, `hetfl.models.norms`) and SiLU (swish, the activation of the EfficientNets: Tan and
Le, "EfficientNet", ICML 2019, §4); a projection by the normalisation only. A block adds
its input to its output where its stride is 1 and its input and output channels are equal
(the repeats after a stage's first block, and every block of stage 1).
Squeeze-and-excitation (Hu et al., "Squeeze-and-Excitation Networks", CVPR 2018, §3) pools
the block's hidden features, maps them through a 1x1 convolution to 0.25 x the *block
input's* channels, SiLU, a 1x1 convolution back, and a sigmoid that scales each hidden
channel; its two convolutions have biases (no normalisation follows them). The layers
are those of torchvision's `efficientnet_v2_s` (`torchvision/models/efficientnet.py`), so
the ImageNet model has its parameter count (the tests check it).

FedFA (Park and Joe-Wong, "Federated Learning with Flexible Architectures", ECML-PKDD
2024, §5.1) trains EfficientNetV2 on Fashion-MNIST; its Table 4 (the architectures) and
Table 5 (the width and depth candidates) are images our copy lacks, so how it is scaled
is read from the text: "depth d_k determining the number of residual blocks in each
convolutional layer section" (App. 0.B.3) and widths as multipliers of every layer.
Choices of this family:

- **Presets.** `efficientnetv2-s` is Table 4; `efficientnetv2-tiny`, for CPU tests and
  runs here, is the same six stages at a quarter of the channels (stem 6, stages 6, 12,
  16, 32, 40, 64, last convolution 320) with at most 3 repeats per stage (2, 3, 3, 3, 3,
  3).
- **Strides.** `stem: small` (the default) puts the stem and stage 2 at stride 1, as
  HetFL's MobileNetV2 does for CIFAR-size inputs (`hetfl.models.mobilenet`), so the model
  halves its input three times (28x28 -> 4x4); `stem: imagenet` is Table 4's strides, five
  halvings (384 -> 12).
- **Width.** One ratio per stage (six slots, relative to the preset's channels); the stem
  takes stage 1's ratio (stage 1's blocks add their input, so the stem's output has stage
  1's width), the last 1x1 convolution stage 6's. Every layer of a block is at the
  block's ratio, its squeeze-and-excitation included (ceil(p x input channels / 4)).
  Depthwise convolutions slice with their groups (`hetfl.models.slim.SlimDepthwiseConv2d`).
- **Depth.** `blocks` are the per-stage repeats, by default the preset's; a sub-model
  keeps each stage's first blocks. A depth candidate d of FedFA and its baselines puts
  min(d, n) blocks in a stage of n repeats (`hetfl.models.scalable.depth_blocks`, as for
  MobileNetV2), so depths above the deepest stage's repeats (15; tiny: 3) are refused;
  every stage repeats, so a depth of at least 2 leaves an identity block in each for
  FedFA's grafting.
- **Step sizes** (`step_size`, NeFL's, `hetfl.models.blocks.StepSize`): a learnable scalar
  multiplies the residual branch of every block that adds its input (`x + s f(x)`, Kang et
  al., NeFL, §3); a block that strides or changes channels has no input to add, and no
  step size. NeFL skips only later blocks of a stage, which are always of the first kind.
- No dropout before the classifier and no stochastic depth (torchvision's have p = 0.2
  and a survival rate; CPU-sized runs train deterministically), BatchNorm with the
  factory's epsilon (torchvision's is 1e-3), and no convolution biases outside
  squeeze-and-excitation, as in the residual families (`hetfl.models.blocks`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hetfl.core.spec import Spec
from hetfl.models.blocks import ConvNormAct, StepSize, run_stages, slim_conv, stage_pipeline
from hetfl.models.norms import NormFactory
from hetfl.models.scalable import ARCHITECTURES, Architecture
from hetfl.models.slim import SlimConv2d, SlimDepthwiseConv2d, SlimLinear, channels


@dataclass(frozen=True)
class Stage:
    """A row of Table 4: Fused-MBConv or MBConv (with SE), its expansion, output channels,
    repeats and the stride of its first block in the ImageNet layout."""

    fused: bool
    expansion: int
    channels: int
    repeats: int
    stride: int


@dataclass(frozen=True)
class Layout:
    """A preset: the stem's channels, the six stages, the last 1x1 convolution's channels."""

    stem: int
    stages: tuple[Stage, ...]
    last: int

    @property
    def base_widths(self) -> tuple[int, ...]:
        return tuple(s.channels for s in self.stages)

    @property
    def repeats(self) -> tuple[int, ...]:
        return tuple(s.repeats for s in self.stages)


#: Table 4 (EfficientNetV2-S): stages 1-3 Fused-MBConv, 4-6 MBConv with SE 0.25.
S = Layout(
    stem=24,
    stages=(Stage(True, 1, 24, 2, 1), Stage(True, 4, 48, 4, 2), Stage(True, 4, 64, 4, 2),
            Stage(False, 4, 128, 6, 2), Stage(False, 6, 160, 9, 1),
            Stage(False, 6, 256, 15, 2)),
    last=1280,
)  # fmt: skip
#: The same stages at a quarter of the channels, at most 3 repeats each (CPU-sized).
TINY = Layout(
    stem=S.stem // 4,
    stages=tuple(
        Stage(s.fused, s.expansion, s.channels // 4, min(s.repeats, 3), s.stride) for s in S.stages
    ),
    last=S.last // 4,
)
LAYOUTS = {"efficientnetv2-s": S, "efficientnetv2-tiny": TINY}
#: Squeeze-and-excitation's bottleneck, a fraction of the block input's channels (SE 0.25).
SE_RATIO = 0.25
#: The stride of the stem and of each stage's first block, per `stem` layout.
STRIDES = {
    "imagenet": (2, tuple(s.stride for s in S.stages)),
    "small": (1, (1, 1, 2, 2, 1, 2)),
}


class SqueezeExcite(nn.Module):
    """Squeeze-and-excitation on `base` hidden channels through a bottleneck of
    `base_squeeze` (at the block's ratio): pool, 1x1 conv, SiLU, 1x1 conv, sigmoid, scale."""

    def __init__(self, base: int, base_squeeze: int, ratio: float) -> None:
        super().__init__()
        hidden, squeeze = channels(ratio, base), channels(ratio, base_squeeze)
        self.reduce = SlimConv2d(hidden, squeeze, 1, base_out=base_squeeze)
        self.expand = SlimConv2d(squeeze, hidden, 1, base_out=base)

    def forward(self, x: torch.Tensor, width: float | None = None) -> torch.Tensor:
        s = x.mean(dim=(2, 3), keepdim=True)  # (B, C, 1, 1)
        s = F.silu(self.reduce(s, width))  # (B, C_se, 1, 1)
        return x * torch.sigmoid(self.expand(s, width))  # (B, C, H, W)


class Residual(nn.Module):
    """What both block kinds share: the input added where the block has the shape to (an
    identity block), times NeFL's step size where asked."""

    def __init__(self, identity: bool, step_size: bool) -> None:
        super().__init__()
        self.identity = identity
        self.step = StepSize() if step_size and identity else None

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        if not self.identity:
            return h
        return x + (h if self.step is None else self.step(h))


class FusedMBConv(nn.Module):
    """Fused-MBConv (Fig. 2, right): a 3x3 convolution at `stride` to `e x base_in` base
    channels, norm, SiLU, then a linear 1x1 projection to `base_out`, norm; with e = 1 the
    3x3 convolution goes to `base_out` itself, with its norm and SiLU, and nothing else."""

    def __init__(
        self,
        cin: int,
        base_in: int,
        base_out: int,
        ratio: float,
        stride: int,
        expansion: int,
        norm: NormFactory,
        step_size: bool = False,
    ) -> None:
        super().__init__()
        base_hidden = base_out if expansion == 1 else base_in * expansion
        self.fused = ConvNormAct(cin, base_hidden, ratio, norm, 3, stride, F.silu)
        self.project: SlimConv2d | None = None
        self.norm: nn.Module | None = None
        if expansion != 1:
            self.project = slim_conv(channels(ratio, base_hidden), base_out, ratio, 1, 1)
            self.norm = norm(base_out, ratio)
        self.residual = Residual(stride == 1 and base_in == base_out, step_size)
        self.identity = self.residual.identity

    def forward(self, x: torch.Tensor, width: float | None = None) -> torch.Tensor:
        h = self.fused(x, width)  # (B, e C_in or C_out, H/s, W/s)
        if self.project is not None and self.norm is not None:
            h = self.norm(self.project(h, width), width)  # (B, C_out, H/s, W/s)
        return self.residual(x, h)


class MBConv(nn.Module):
    """MBConv (Fig. 2, left): a 1x1 expansion to `e x base_in` base channels, norm, SiLU; a
    3x3 depthwise convolution at `stride`, norm, SiLU; squeeze-and-excitation to
    `SE_RATIO x base_in`; a linear 1x1 projection to `base_out`, norm."""

    def __init__(
        self,
        cin: int,
        base_in: int,
        base_out: int,
        ratio: float,
        stride: int,
        expansion: int,
        norm: NormFactory,
        step_size: bool = False,
    ) -> None:
        super().__init__()
        base_hidden = base_in * expansion
        hidden = channels(ratio, base_hidden)
        self.expand = ConvNormAct(cin, base_hidden, ratio, norm, 1, 1, F.silu)
        self.depthwise = SlimDepthwiseConv2d(hidden, 3, base=base_hidden, stride=stride, padding=1)
        self.norm1 = norm(base_hidden, ratio)
        self.se = SqueezeExcite(base_hidden, max(1, int(base_in * SE_RATIO)), ratio)
        self.project = slim_conv(hidden, base_out, ratio, 1, 1)
        self.norm2 = norm(base_out, ratio)
        self.residual = Residual(stride == 1 and base_in == base_out, step_size)
        self.identity = self.residual.identity

    def forward(self, x: torch.Tensor, width: float | None = None) -> torch.Tensor:
        h = self.expand(x, width)  # (B, e C_in, H, W)
        h = F.silu(self.norm1(self.depthwise(h, width), width))  # (B, e C_in, H/s, W/s)
        h = self.se(h, width)
        h = self.norm2(self.project(h, width), width)  # (B, C_out, H/s, W/s)
        return self.residual(x, h)


class EfficientNetV2(nn.Module):
    """The network of the module docstring for a checked spec (`widths` and `blocks` per
    stage, `stages`, `stem`, `step_size`) of a `Layout`."""

    def __init__(self, spec: Spec, norm: NormFactory, layout: Layout) -> None:
        super().__init__()
        widths = spec["widths"]
        stem_stride, strides = STRIDES[spec["stem"]]
        step_size = bool(spec.get("step_size"))
        self.stem = ConvNormAct(
            spec["input_shape"][0], layout.stem, widths[0], norm, 3, stem_stride, F.silu
        )
        self.stages = nn.ModuleList()
        c, base_in = channels(widths[0], layout.stem), layout.stem
        for i in range(spec["stages"]):
            stage = layout.stages[i]
            block = FusedMBConv if stage.fused else MBConv
            blocks = nn.ModuleList()
            for b in range(spec["blocks"][i]):
                stride = strides[i] if b == 0 else 1
                blocks.append(
                    block(c, base_in, stage.channels, widths[i], stride, stage.expansion, norm,
                          step_size)
                )  # fmt: skip
                c, base_in = channels(widths[i], stage.channels), stage.channels
            self.stages.append(blocks)
        last = spec["stages"] - 1
        self.last = ConvNormAct(c, layout.last, widths[last], norm, 1, 1, F.silu)
        self.head = SlimLinear(
            channels(widths[last], layout.last), spec["num_classes"], base_out=None
        )
        self.pipeline = stage_pipeline(self.stages)

    def forward(self, x: torch.Tensor, width: float | None = None) -> torch.Tensor:
        return run_stages(
            self.stem, self.stages, self.last, self.head, x, width
        )  # (B, num_classes)


@dataclass(frozen=True)
class Preset:
    """Builds a preset's model from a checked spec and the normalisation factory."""

    layout: Layout

    def __call__(self, spec: Spec, norm: NormFactory) -> nn.Module:
        return EfficientNetV2(spec, norm, self.layout)


def min_side(spec: Spec) -> int:
    """The smallest input side the model for `spec` takes: 2 to the number of halvings."""
    stem_stride, strides = STRIDES[spec["stem"]]
    return 2 ** [stem_stride, *strides[: spec["stages"]]].count(2)


#: What `hetfl list` says of each preset (`hetfl.catalogue` repeats it).
SUMMARIES = {
    "efficientnetv2-s": (
        "EfficientNetV2-S (Tan and Le 2021, Table 4): widths per stage, depth by repeats (FedFA)"
    ),
    "efficientnetv2-tiny": (
        "EfficientNetV2-S's stages at 1/4 of the channels, at most 3 repeats (CPU-sized)"
    ),
}
for _name, _layout in LAYOUTS.items():
    ARCHITECTURES.register(
        _name,
        Architecture(
            Preset(_layout),
            _layout.base_widths,
            len(_layout.stages),
            _layout.repeats,
            min_side,
            SUMMARIES[_name],
            step_sizes=True,
            max_repeats=_layout.repeats,
        ),
    )
