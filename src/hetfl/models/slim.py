"""Layers that slice themselves by width, so one module serves every sub-model.

A slim layer owns its full (allocated) tensors and, at call time, uses their leading part:
`W[:out, :in]`, the nested slice of ScalableFL (Nitta et al., arXiv 2311.08716, §III-A),
HeteroFL (Diao et al., ICLR 2021, §3) and FjORD's ordered dropout (Horváth et al., NeurIPS
2021, §3). The input width is read from the input
itself; the output width is either the allocated one (`width=None`) or `channels(width,
base)` for a width ratio relative to the layer's *base* channel count (the count at ratio
1, which ratios may exceed). So a model built at ratio p and a wider model run with
`width=p` compute the same function on the same leading tensors, and FjORD can change the
width every step without rebuilding anything.

The normalisation layers here (`SlimBatchNorm2d`, FjORD's `PerWidthBatchNorm2d`, `NoNorm`)
take the same `width` argument; which one a model gets is the factory it is given
(`hetfl.models.norms`), which also says where each kind comes from. HeteroFL's scaler
(activations divided by the width ratio during training only) lives in the normalisation
layer, which is where the paper's code places it ("before every normalisation layer").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn


def channels(ratio: float, base: int) -> int:
    """`ceil(ratio * base)`, at least 1: ScalableFL (arXiv 2311.08716, §III-A) does not say
    how it rounds; ceil is what its Table IV's widths show (kappa = 0.8997: 128 -> 116).

    The product is rounded to 9 decimals first, so that 0.3 * 10 gives 3, not 4.
    """
    if not (ratio > 0 and math.isfinite(ratio)):
        raise ValueError(f"width ratio must be a positive finite number, got {ratio}")
    return max(1, math.ceil(round(ratio * base, 9)))


def level_key(width: float) -> str:
    """A buffer-name-safe key for a width level: 0.25 -> 'w0p25'."""
    return "w" + f"{width:g}".replace(".", "p").replace("-", "m")


class SlimConv2d(nn.Conv2d):
    """A convolution that uses `weight[:out, :in]`; `base_out=None` keeps the output fixed
    (the stem of FLANC's CNN, whose 64 channels no width changes)."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        *,
        base_out: int | None,
        stride: int = 1,
        padding: int = 0,
        bias: bool = True,
    ) -> None:
        super().__init__(
            in_channels, out_channels, kernel_size, stride=stride, padding=padding, bias=bias
        )
        self.base_out = base_out

    def forward(self, x: torch.Tensor, width: float | None = None) -> torch.Tensor:
        out = _out_channels(self.out_channels, self.base_out, width, self)
        cin = _in_channels(x, self.in_channels, self)
        w = self.weight if (out, cin) == tuple(self.weight.shape[:2]) else self.weight[:out, :cin]
        b = None if self.bias is None else self.bias[:out]
        return F.conv2d(x, w, b, self.stride, self.padding, self.dilation, self.groups)


class SlimDepthwiseConv2d(nn.Conv2d):
    """A depthwise convolution, one k x k filter per channel (`groups` = channels: the 3x3
    convolution of MobileNetV2's inverted residual, Sandler et al., "MobileNetV2: Inverted
    Residuals and Linear Bottlenecks", CVPR 2018, §3.1, §3.3), that slices itself with its
    groups: on an input of c channels it uses the first c filters, `weight[:c]` of shape
    (c, 1, k, k), with `groups = c`. A slice of a depthwise convolution is the depthwise
    convolution of the leading channels, so the model built at ratio p and a wider model
    run at p compute the same function. Its output has as many channels as its input;
    `width` (checked against them when given) changes nothing else."""

    def __init__(
        self, num_channels: int, kernel_size: int, *, base: int, stride: int = 1, padding: int = 0
    ) -> None:
        super().__init__(
            num_channels,
            num_channels,
            kernel_size,
            stride=stride,
            padding=padding,
            groups=num_channels,
            bias=False,
        )
        self.base = base

    def forward(self, x: torch.Tensor, width: float | None = None) -> torch.Tensor:
        c = _in_channels(x, self.in_channels, self)
        if width is not None and channels(width, self.base) != c:
            raise ValueError(
                f"{type(self).__name__}: width {width} needs {channels(width, self.base)} "
                f"channels, the input has {c}; a depthwise convolution keeps its input's channels"
            )
        w = self.weight if c == self.weight.shape[0] else self.weight[:c]  # (c, 1, k, k)
        return F.conv2d(x, w, None, self.stride, self.padding, self.dilation, c)


class SlimLinear(nn.Linear):
    """A linear layer that uses `weight[:out, :in]`. A flattened (C, H, W) input keeps its
    leading channels in its leading features, so slicing columns slices channels."""

    def __init__(self, in_features: int, out_features: int, *, base_out: int | None) -> None:
        super().__init__(in_features, out_features)
        self.base_out = base_out

    def forward(self, x: torch.Tensor, width: float | None = None) -> torch.Tensor:
        out = _out_channels(self.out_features, self.base_out, width, self)
        cin = _in_channels(x, self.in_features, self)
        w = self.weight if (out, cin) == tuple(self.weight.shape) else self.weight[:out, :cin]
        return F.linear(x, w, self.bias[:out])


def _out_channels(allocated: int, base: int | None, width: float | None, layer: nn.Module) -> int:
    if width is None or base is None:
        return allocated
    out = channels(width, base)
    if out > allocated:
        raise ValueError(
            f"{type(layer).__name__}: width {width} needs {out} output channels, but this "
            f"layer was built with {allocated}; run a model at most at the width it was built for"
        )
    return out


def _in_channels(x: torch.Tensor, allocated: int, layer: nn.Module) -> int:
    cin = int(x.shape[1])
    if cin > allocated:
        raise ValueError(
            f"{type(layer).__name__}: input has {cin} channels, the layer holds {allocated}"
        )
    return cin


class SlimBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm over the leading channels, with running statistics or, without
    `track_running_stats`, batch statistics always (HeteroFL's sBN). Stays a `_BatchNorm`,
    so HetFL's statistics re-estimation (`recompute_bn_statistics`) and initialisation treat
    it as one.

    `ratio` is the layer's built width ratio, used by the scaler when no width is given.
    """

    def __init__(
        self, num_features: int, *, ratio: float, scaler: bool, track_running_stats: bool = True
    ) -> None:
        super().__init__(num_features, track_running_stats=track_running_stats)
        self.ratio, self.scaler = ratio, scaler

    def forward(self, x: torch.Tensor, width: float | None = None) -> torch.Tensor:
        x = _scale(x, self.scaler and self.training, width or self.ratio)
        c = _in_channels(x, self.num_features, self)
        weight, bias = self.weight[:c], self.bias[:c]
        if self.running_mean is None or self.running_var is None:  # static: batch statistics
            return F.batch_norm(x, None, None, weight, bias, True, 0.0, self.eps)
        factor = 0.0
        if self.training:
            tracked = cast(torch.Tensor, self.num_batches_tracked)  # a tensor with running stats
            tracked.add_(1)
            factor = 1.0 / float(tracked) if self.momentum is None else self.momentum
        mean, var = self.running_mean[:c], self.running_var[:c]  # views: updated in place
        return F.batch_norm(x, mean, var, weight, bias, self.training, factor, self.eps)


class PerWidthBatchNorm2d(nn.Module):
    """FjORD's normalisation: a shared affine sliced to the width, and one set of running
    statistics per width level at or below the layer's built ratio (buffers
    `running_mean_w0p5`, ...), used for that width only."""

    hetfl_role = "norm"  # for `hetfl.core.roles`: private-BN options find it by structure

    def __init__(
        self, base: int, *, levels: Sequence[float], ratio: float, eps: float = 1e-5
    ) -> None:
        super().__init__()
        own = [p for p in levels if p <= ratio + 1e-12]
        if not own:
            raise ValueError(f"no width level at or below the built ratio {ratio} in {levels}")
        self.base, self.ratio, self.eps, self.momentum = base, ratio, eps, 0.1
        n = channels(ratio, base)
        self.weight = nn.Parameter(torch.ones(n))
        self.bias = nn.Parameter(torch.zeros(n))
        self.levels = tuple(own)
        for p in own:
            self.register_buffer(f"running_mean_{level_key(p)}", torch.zeros(channels(p, base)))
            self.register_buffer(f"running_var_{level_key(p)}", torch.ones(channels(p, base)))

    def reset_parameters_with(self, generator: torch.Generator) -> None:
        self.weight.data.fill_(1.0)
        self.bias.data.zero_()
        for p in self.levels:
            getattr(self, f"running_mean_{level_key(p)}").zero_()
            getattr(self, f"running_var_{level_key(p)}").fill_(1.0)

    def forward(self, x: torch.Tensor, width: float | None = None) -> torch.Tensor:
        p = self.ratio if width is None else width
        key = next((level_key(q) for q in self.levels if abs(q - p) < 1e-9), None)
        if key is None:
            raise ValueError(f"width {p} is not one of this layer's levels {self.levels}")
        c = _in_channels(x, self.weight.shape[0], self)
        mean, var = getattr(self, f"running_mean_{key}"), getattr(self, f"running_var_{key}")
        if mean.shape[0] != c:
            raise ValueError(f"width {p} has {mean.shape[0]} channels, the input has {c}")
        return F.batch_norm(
            x, mean, var, self.weight[:c], self.bias[:c], self.training, self.momentum, self.eps
        )


def _scale(x: torch.Tensor, active: bool, ratio: float) -> torch.Tensor:
    """HeteroFL's scaler: divide by the width ratio in training only."""
    return x / ratio if active else x


class NoNorm(nn.Identity):
    """No normalisation, with the `width` argument every slim layer takes; with `scaler`,
    HeteroFL's scaler alone (its code keeps the scaler under `norm: none`, `models/conv.py`)."""

    def __init__(self, ratio: float = 1.0, scaler: bool = False) -> None:
        super().__init__()
        self.ratio, self.scaler = ratio, scaler

    def forward(self, x: torch.Tensor, width: float | None = None) -> torch.Tensor:
        return _scale(x, self.scaler and self.training, width or self.ratio)
