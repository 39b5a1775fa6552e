"""Width-aware building blocks of the scalable families, each given its normalisation.

Every block slices itself by width (`forward(x, width)`, `hetfl.models.slim`) and takes
its normalisation as a factory (`hetfl.models.norms.NormFactory`), so it never asks which
family or which kind of norm it belongs to. The residual blocks share one constructor
signature, as torchvision's `BasicBlock` and `Bottleneck` do (`torchvision/models/
resnet.py`), so a network is given its block class:

    block(cin, base_in, base_out, ratio, stride, norm, in_ratio=None)

- `cin`: the input's channels as built; `base_in`: the block input's *base* channels (at
  ratio 1); `base_out`: the block's base planes, its output having
  `channels(ratio, base_out * expansion)` channels;
- `ratio`: the block's width ratio; `stride`: of its first spatial convolution;
- `norm`: the normalisation factory;
- `in_ratio`: the width ratio its input was built at (None: `ratio`). A section's first
  block takes the previous section's output, whose ratio may differ from its own when
  widths vary per section; only a block that normalises its input (pre-activation) needs
  it, the others take it for the common signature.

A block has a shortcut convolution where the stride or the *base* widths differ (never
where only the built widths do), so every sub-model of a family has the same blocks and
tensor names. A block's `identity` says it has none, so its input and output have one
shape and it adds its input unchanged (what FedFA's grafting copies between blocks of a
section, `hetfl.models.scalable.sections`). `preactivation` says whether the block
normalises its input (the network then ends with a norm and a ReLU and its stem has none)
or its outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, Protocol, cast

import torch
from torch import nn

from hetfl.models.norms import NormFactory
from hetfl.models.slim import SlimConv2d, channels


def slim_conv(cin: int, base_out: int, ratio: float, kernel: int, stride: int) -> SlimConv2d:
    """A bias-free convolution to `channels(ratio, base_out)` channels, padded to keep the
    side (divided by `stride`)."""
    return SlimConv2d(
        cin,
        channels(ratio, base_out),
        kernel,
        base_out=base_out,
        stride=stride,
        padding=kernel // 2,
        bias=False,
    )


def stage_pipeline(stages: nn.ModuleList) -> list[str]:
    """The pipeline of a mobile family (stem, every block of every stage, last conv, head)."""
    blocks = [f"stages.{i}.{b}" for i, s in enumerate(stages) for b in range(len(s))]  # type: ignore[arg-type]
    return ["stem", *blocks, "last", "head"]


def run_stages(
    stem: nn.Module,
    stages: nn.ModuleList,
    last: nn.Module,
    head: nn.Module,
    x: torch.Tensor,
    width: float | None,
) -> torch.Tensor:
    """A mobile family's forward: stem, the stages' blocks, the last conv, pooled head."""
    x = stem(x, width)
    for blocks in stages:
        for block in cast(nn.ModuleList, blocks):
            x = block(x, width)
    x = last(x, width)  # (B, C_last, H', W')
    return head(x.mean(dim=(2, 3)), width)  # type: ignore[no-any-return]


class ConvNormAct(nn.Module):
    """conv (k x k, bias-free) -> norm -> `activation`, width-aware: the stems, last 1x1
    convolutions and expansions of the mobile families (MobileNetV2's ReLU6,
    EfficientNetV2's SiLU)."""

    def __init__(
        self,
        cin: int,
        base_out: int,
        ratio: float,
        norm: NormFactory,
        kernel: int,
        stride: int,
        activation: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        super().__init__()
        self.conv = slim_conv(cin, base_out, ratio, kernel, stride)
        self.norm = norm(base_out, ratio)
        self.activation = activation

    def forward(self, x: torch.Tensor, width: float | None = None) -> torch.Tensor:
        return self.activation(self.norm(self.conv(x, width), width))


class ConvUnit(nn.Module):
    """conv -> norm -> (ReLU) -> (max-pool), every part width-aware. `fixed` keeps the
    output at `base_out` channels for every width (FLANC's stem); the convolution has a
    bias only where the norm has no affine (`norm.conv_bias`)."""

    def __init__(
        self,
        cin: int,
        base_out: int,
        ratio: float,
        norm: NormFactory,
        *,
        fixed: bool = False,
        kernel: int = 3,
        stride: int = 1,
        relu: bool = True,
        pool: bool = False,
    ) -> None:
        super().__init__()
        self.conv = SlimConv2d(
            cin,
            base_out if fixed else channels(ratio, base_out),
            kernel,
            base_out=None if fixed else base_out,
            stride=stride,
            padding=kernel // 2,
            bias=norm.conv_bias,
        )
        self.norm = norm(base_out, 1.0 if fixed else ratio, fixed=fixed)
        self.relu, self.pool = relu, pool

    def forward(self, x: torch.Tensor, width: float | None = None) -> torch.Tensor:
        x = self.norm(self.conv(x, width), width)
        if self.relu:
            x = torch.relu(x)
        return nn.functional.max_pool2d(x, 2) if self.pool else x


class ResidualBlock(Protocol):
    """What a network needs of a block class (see the module docstring): its constructor,
    its `expansion` (output base channels per base plane) and `preactivation`."""

    @property
    def expansion(self) -> int: ...

    @property
    def preactivation(self) -> bool: ...

    def __call__(
        self,
        cin: int,
        base_in: int,
        base_out: int,
        ratio: float,
        stride: int,
        norm: NormFactory,
        in_ratio: float | None = None,
    ) -> nn.Module: ...


class BasicBlock(nn.Module):
    """The post-activation basic block (He et al., "Deep Residual Learning for Image
    Recognition", CVPR 2016, Fig. 2; ResNet-18, ScalableFL Table IV):
    conv3x3-norm-ReLU-conv3x3-norm, plus the shortcut, then ReLU."""

    expansion: ClassVar[int] = 1
    preactivation: ClassVar[bool] = False

    def __init__(
        self,
        cin: int,
        base_in: int,
        base_out: int,
        ratio: float,
        stride: int,
        norm: NormFactory,
        in_ratio: float | None = None,
    ) -> None:
        super().__init__()
        self.conv1 = slim_conv(cin, base_out, ratio, 3, stride)
        self.conv2 = slim_conv(channels(ratio, base_out), base_out, ratio, 3, 1)
        self.norm1 = norm(base_out, ratio)
        self.norm2 = norm(base_out, ratio)
        self.shortcut: SlimConv2d | None = None
        self.norm_sc: nn.Module | None = None
        if stride != 1 or base_in != base_out:
            self.shortcut = slim_conv(cin, base_out, ratio, 1, stride)
            self.norm_sc = norm(base_out, ratio)
        self.identity = self.shortcut is None

    def forward(self, x: torch.Tensor, width: float | None = None) -> torch.Tensor:
        h = torch.relu(self.norm1(self.conv1(x, width), width))
        h = self.norm2(self.conv2(h, width), width)
        skip = x
        if self.shortcut is not None and self.norm_sc is not None:
            skip = self.norm_sc(self.shortcut(x, width), width)
        return torch.relu(h + skip)


class StepSize(nn.Module):
    """A learnable scalar that multiplies a residual branch, starting at 1 (NeFL: Kang et
    al., "NeFL: Nested Model Scaling for Federated Learning with System Heterogeneous
    Clients", 2023, §3, the ODE view `x + s_l f_l(x)`; the authors' code
    honggkang/nested-federated-learning, `models/blocks.py`, `BasicBlockM`). Its tensor
    carries the role `step_size` (`hetfl.core.roles.tensor_roles`)."""

    hetfl_role = "step_size"

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))

    def reset_parameters_with(self, generator: torch.Generator) -> None:
        with torch.no_grad():
            self.weight.fill_(1.0)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.weight * h


class PreActBlock(nn.Module):
    """The pre-activation basic block (He et al., "Identity Mappings in Deep Residual
    Networks", ECCV 2016, Fig. 4(e); HeteroFL, FedFA and NeFL use it): norm-ReLU-conv3x3,
    norm-ReLU-conv3x3, plus the shortcut (taken after the first norm-ReLU where it is a
    convolution). The first norm normalises the block's input, of `base_in` base channels,
    so it is built at the input's ratio (`in_ratio`): a section's first block then takes the
    previous section's output whatever the two sections' widths (HeteroFL's scaler, when
    on, divides that input by the ratio it was built at). With `step_size`, a learnable
    `StepSize` multiplies the residual branch (NeFL's blocks)."""

    expansion: ClassVar[int] = 1
    preactivation: ClassVar[bool] = True

    def __init__(
        self,
        cin: int,
        base_in: int,
        base_out: int,
        ratio: float,
        stride: int,
        norm: NormFactory,
        in_ratio: float | None = None,
        *,
        step_size: bool = False,
    ) -> None:
        super().__init__()
        self.conv1 = slim_conv(cin, base_out, ratio, 3, stride)
        self.conv2 = slim_conv(channels(ratio, base_out), base_out, ratio, 3, 1)
        self.norm1 = norm(base_in, ratio if in_ratio is None else in_ratio)
        self.norm2 = norm(base_out, ratio)
        self.shortcut: SlimConv2d | None = None
        if stride != 1 or base_in != base_out:
            self.shortcut = slim_conv(cin, base_out, ratio, 1, stride)
        self.identity = self.shortcut is None
        self.step = StepSize() if step_size else None

    def forward(self, x: torch.Tensor, width: float | None = None) -> torch.Tensor:
        h = torch.relu(self.norm1(x, width))
        skip = x if self.shortcut is None else self.shortcut(h, width)
        h = self.conv1(h, width)
        h = self.conv2(torch.relu(self.norm2(h, width)), width)
        return (h if self.step is None else self.step(h)) + skip


class Bottleneck(nn.Module):
    """The post-activation bottleneck block (He et al., CVPR 2016, Fig. 5 right, as
    torchvision and DTFL's CIFAR ResNet-56/110 build it: the stride on the 3x3):
    conv1x1-norm-ReLU, conv3x3-norm-ReLU, conv1x1 to `4 * base_out` base channels-norm,
    plus the shortcut, then ReLU."""

    expansion: ClassVar[int] = 4
    preactivation: ClassVar[bool] = False

    def __init__(
        self,
        cin: int,
        base_in: int,
        base_out: int,
        ratio: float,
        stride: int,
        norm: NormFactory,
        in_ratio: float | None = None,
    ) -> None:
        super().__init__()
        base_wide = base_out * self.expansion
        mid = channels(ratio, base_out)
        self.conv1 = slim_conv(cin, base_out, ratio, 1, 1)
        self.norm1 = norm(base_out, ratio)
        self.conv2 = slim_conv(mid, base_out, ratio, 3, stride)
        self.norm2 = norm(base_out, ratio)
        self.conv3 = slim_conv(mid, base_wide, ratio, 1, 1)
        self.norm3 = norm(base_wide, ratio)
        self.shortcut: SlimConv2d | None = None
        self.norm_sc: nn.Module | None = None
        if stride != 1 or base_in != base_wide:
            self.shortcut = slim_conv(cin, base_wide, ratio, 1, stride)
            self.norm_sc = norm(base_wide, ratio)
        self.identity = self.shortcut is None

    def forward(self, x: torch.Tensor, width: float | None = None) -> torch.Tensor:
        h = torch.relu(self.norm1(self.conv1(x, width), width))  # (B, planes, H, W)
        h = torch.relu(self.norm2(self.conv2(h, width), width))  # (B, planes, H/s, W/s)
        h = self.norm3(self.conv3(h, width), width)  # (B, 4 planes, H/s, W/s)
        skip = x
        if self.shortcut is not None and self.norm_sc is not None:
            skip = self.norm_sc(self.shortcut(x, width), width)
        return torch.relu(h + skip)
