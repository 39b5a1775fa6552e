"""FLANC's composed architectures, one model per capacity p (Mei et al., "Resource-Adaptive
Federated Learning with All-In-One Neural Composition", NeurIPS 2022, supplementary §1.2).

Every architecture has a *layout*: its composed layers at a capacity (`Composition`: module
path, S_p, T_p, R1, R2, kernel, and which bank they draw their basis from). The model is
built from its layout, and the family (`hetfl.models.flanc`) reads the same layout to check
`S_p/R1`, to map bases into the global banks and to declare the banks, so the three always
agree. Widths are `channels(p, base)` (`hetfl.models.slim`), as the scalable families'.

Basis sizes are presets named for where they come from (`basis` in the spec): `code`, the
authors' code; `table2`, the sizes whose MACs reproduce the supplement's Table 2;
`supplement`, the sizes the supplement's text states (the RNN's, which has no code).

- `composed-cnn`: the Fashion-MNIST CNN of the authors' `src/model/cnn_flanc.py`: a plain
  3x3 stem to 64 channels with bias (no activation, no pool) that no capacity changes, two
  composed 3x3 convolutions to 128p channels, each followed by ReLU and a 2x2 max-pool, a
  linear head on the flattened 128p x H/4 x W/4 features; no normalisation. `table2`
  (the default): R1 = 16 in both; `code`: R1 = 8 in the first.
- `composed-resnet18`: the authors' `src/model/resnet18_flanc.py`: a CIFAR stem (3x3 conv
  to 64 channels, BN, ReLU; no max-pool) kept at 64, post-activation basic blocks of
  64p·2^i planes whose two 3x3 convolutions are composed, a plain 1x1 shortcut with BN where
  the stride or the widths differ, global average pooling, a linear head. `code` (the
  default): one bank per block, (R2, R1) of `RESNET_BASES`; `table2`: every convolution
  its own bank with R1 = 1/8 of its full-width input (supplementary §1.2, "12.5 % of the
  full model"), which gives Table 2's 55/112/186/275 M within 2.5 % (`code`: 11 % above).
- `composed-rnn`: a character RNN (supplementary §1.2: one layer, embedding = hidden = 512,
  R1 = 32, R2 = 30: `supplement`), see `ComposedRNN`; these sizes give 8-14 % more MACs
  than Table 2's FLANC row (5/16/34/59 M), about its p-width row.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from hetfl.core.spec import Spec
from hetfl.models.char import SeededEmbedding
from hetfl.models.composed import ComposedConv2d, ComposedLinear
from hetfl.models.slim import channels


@dataclass(frozen=True)
class Composition:
    """One composed layer at one capacity: `path` in the model, S_p -> T_p from R2 bases
    of size R1 (`kernel` k for a k x k convolution, 0 for a matrix), and the rows
    [row0, row0 + R2) it takes of the bank owned by `bank`, which has `bank_rows` rows."""

    path: str
    s: int
    t: int
    r1: int
    r2: int
    kernel: int
    stride: int
    bank: str
    row0: int
    bank_rows: int

    @property
    def bank_shape(self) -> tuple[int, ...]:
        kernel = (self.kernel, self.kernel) if self.kernel else ()
        return (self.bank_rows, self.r1, *kernel)

    @property
    def rows(self) -> slice:
        return slice(self.row0, self.row0 + self.r2)


def _own_bank(
    path: str, s: int, t: int, r1: int, r2: int, kernel: int, stride: int = 1
) -> Composition:
    """A layer that owns its bank alone (the CNN's, the RNN's, the `table2` ResNet's)."""
    return Composition(path, s, t, r1, r2, kernel, stride, path, 0, r2)


def _conv(c: Composition, mode: str) -> ComposedConv2d:
    return ComposedConv2d(
        c.s, c.t, c.r1, c.r2, c.kernel, stride=c.stride, padding=c.kernel // 2, mode=mode
    )


# -- the CNN ------------------------------------------------------------------------------------
#: R1 of the two composed layers per preset: `table2` (supplementary §1.2 read with the MACs
#: of Table 2: 20.3/26.6/33.6/41.5 M at p = 1/4..1 on 28x28) and `code` (the authors'
#: `basis_fraction` 0.125 of 64 for the first layer: 23.5/33.0/43.2/54.3 M).
CNN_BASIS_SIZES = {"table2": (16, 16), "code": (8, 16)}
CNN_BASES = 32  # R2 = 1/4 of the 128 full output channels
CNN_STEM, CNN_WIDTH = 64, 128


def cnn_layout(spec: Spec) -> list[Composition]:
    r1a, r1b = CNN_BASIS_SIZES[spec["basis"]]
    t = channels(spec["capacity"], CNN_WIDTH)
    return [
        _own_bank("conv2.conv", CNN_STEM, t, r1a, CNN_BASES, 3),
        _own_bank("conv3.conv", t, t, r1b, CNN_BASES, 3),
    ]


class ReluPool(nn.Module):
    """A composed convolution, then ReLU and a 2x2 max-pool."""

    def __init__(self, conv: ComposedConv2d) -> None:
        super().__init__()
        self.conv = conv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.max_pool2d(torch.relu(self.conv(x)), 2)


class ComposedCNN(nn.Module):
    """stem -> composed conv, ReLU, pool -> composed conv, ReLU, pool -> linear head."""

    def __init__(self, spec: Spec) -> None:
        super().__init__()
        c, h, w = spec["input_shape"]
        first, second = cnn_layout(spec)
        self.stem = nn.Conv2d(c, CNN_STEM, 3, padding=1)
        self.conv2 = ReluPool(_conv(first, spec["compose"]))
        self.conv3 = ReluPool(_conv(second, spec["compose"]))
        self.head = nn.Linear(second.t * (h // 4) * (w // 4), spec["num_classes"])
        self.pipeline = ["stem", "conv2", "conv3", "head"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv3(self.conv2(self.stem(x)))  # (B, T_p, H/4, W/4)
        return self.head(x.flatten(1))


# -- the ResNet-18 ------------------------------------------------------------------------------
#: (R2, R1) of each block's bank, stage by stage, as the authors' `resnet18_flanc.py`
#: (n_basis 0.25 and basis_fraction 0.125 of its `cfg` channel counts): the `code` preset.
RESNET_BASES = (
    ((16, 8), (16, 8)),
    ((32, 8), (32, 16)),
    ((64, 16), (64, 32)),
    ((128, 32), (128, 64)),
)
RESNET_STEM = 64
#: `table2`: a convolution's R1 is its full-width input channel count over this.
TABLE2_R1_DIVISOR = 8


def resnet_layout(spec: Spec) -> list[Composition]:
    """conv1 then conv2 of every block. `code`: a block's two convolutions take rows
    [0, R2) and [R2, 2·R2) of the block's one bank; `table2`: each convolution owns a bank
    of R2 rows with R1 = its full-width input / `TABLE2_R1_DIVISOR`."""
    out, cin = [], RESNET_STEM
    for i, blocks in enumerate(RESNET_BASES):
        full = RESNET_STEM * 2**i
        planes = channels(spec["capacity"], full)
        for b, (r2, r1) in enumerate(blocks):
            block = f"layer{i + 1}.{b}"
            stride = 2 if i > 0 and b == 0 else 1
            conv1, conv2 = f"{block}.conv1", f"{block}.conv2"
            if spec["basis"] == "code":
                out.append(Composition(conv1, cin, planes, r1, r2, 3, stride, block, 0, 2 * r2))
                out.append(Composition(conv2, planes, planes, r1, r2, 3, 1, block, r2, 2 * r2))
            else:
                full_in = full // 2 if i > 0 and b == 0 else full
                r1_in, r1_out = full_in // TABLE2_R1_DIVISOR, full // TABLE2_R1_DIVISOR
                out.append(_own_bank(conv1, cin, planes, r1_in, r2, 3, stride))
                out.append(_own_bank(conv2, planes, planes, r1_out, r2, 3))
            cin = planes
    return out


class Stem(nn.Module):
    """The CIFAR stem: 3x3 conv (no bias), BN, ReLU."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)))


class ComposedBlock(nn.Module):
    """A post-activation basic block with composed convolutions and a plain 1x1 shortcut
    (with BN) where the stride or the widths differ."""

    def __init__(self, conv1: Composition, conv2: Composition, mode: str) -> None:
        super().__init__()
        self.conv1 = _conv(conv1, mode)
        self.bn1 = nn.BatchNorm2d(conv1.t)
        self.conv2 = _conv(conv2, mode)
        self.bn2 = nn.BatchNorm2d(conv2.t)
        self.shortcut: nn.Conv2d | None = None
        self.shortcut_bn: nn.BatchNorm2d | None = None
        if conv1.stride != 1 or conv1.s != conv1.t:
            self.shortcut = nn.Conv2d(conv1.s, conv1.t, 1, stride=conv1.stride, bias=False)
            self.shortcut_bn = nn.BatchNorm2d(conv1.t)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        skip = x
        if self.shortcut is not None and self.shortcut_bn is not None:
            skip = self.shortcut_bn(self.shortcut(x))
        return torch.relu(h + skip)


class ComposedResNet18(nn.Module):
    """stem -> layer1..layer4 (two blocks each, strides 1, 2, 2, 2) -> mean -> head."""

    def __init__(self, spec: Spec) -> None:
        super().__init__()
        layout = resnet_layout(spec)
        pairs = zip(layout[::2], layout[1::2], strict=True)
        self.stem = Stem(spec["input_shape"][0], RESNET_STEM)
        self.pipeline = ["stem"]
        for i, blocks in enumerate(RESNET_BASES, start=1):
            layer = nn.Sequential(*(ComposedBlock(*next(pairs), spec["compose"]) for _ in blocks))
            self.add_module(f"layer{i}", layer)
            self.pipeline += [f"layer{i}.{b}" for b in range(len(blocks))]
        self.head = nn.Linear(layout[-1].t, spec["num_classes"])
        self.pipeline.append("head")

    def blocks(self) -> Iterator[nn.Module]:
        for i in range(1, len(RESNET_BASES) + 1):
            yield from cast(nn.Sequential, self.get_submodule(f"layer{i}"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks():
            x = block(x)
        return self.head(x.mean(dim=(2, 3)))  # global average pooling


# -- the character RNN --------------------------------------------------------------------------
RNN_WIDTH = 512  # embedding and hidden size at p = 1
RNN_BASIS_SIZE, RNN_BASES = 32, 30  # R1, R2 (supplementary §1.2)


def rnn_layout(spec: Spec) -> list[Composition]:
    width = channels(spec["capacity"], RNN_WIDTH)
    return [
        _own_bank(f"rnn.{name}", width, width, RNN_BASIS_SIZE, RNN_BASES, 0)
        for name in ("ih", "hh", "proj")
    ]


class ComposedRNN(nn.Module):
    """A vanilla tanh RNN, h_t = tanh(W_ih e_t + W_hh h_{t-1} + b_h) from h_0 = 0, and a
    projection o_t = W_ho h_t + b_o of every step; the three matrices are composed.

    The input and output products of all steps are one batched product each, the
    recurrence one product per step. Biases are U(-1/sqrt(H_p), 1/sqrt(H_p)), PyTorch's
    `nn.RNN` and `nn.Linear(H_p, H_p)` default."""

    def __init__(self, ih: Composition, hh: Composition, proj: Composition, mode: str) -> None:
        super().__init__()
        self.ih = ComposedLinear(ih.s, ih.t, ih.r1, ih.r2, mode=mode)
        self.hh = ComposedLinear(hh.s, hh.t, hh.r1, hh.r2, mode=mode)
        self.proj = ComposedLinear(proj.s, proj.t, proj.r1, proj.r2, mode=mode)
        self.hidden = hh.t
        self.bias_h = nn.Parameter(torch.empty(hh.t))
        self.bias_o = nn.Parameter(torch.empty(proj.t))
        self.reset_parameters_with(None)

    def forward(self, e: torch.Tensor) -> torch.Tensor:
        """(B, L, E_p) embeddings -> (B, L, H_p) projected states."""
        inputs = self.ih(e)  # (B, L, H_p), every step at once
        recur = self.hh.operator()  # explicit mode composes W_hh once, not once per step
        h = e.new_zeros(e.shape[0], self.hidden)
        states = []
        for t in range(e.shape[1]):
            h = torch.tanh(inputs[:, t] + recur(h) + self.bias_h)
            states.append(h)
        return self.proj(torch.stack(states, dim=1)) + self.bias_o

    def reset_parameters_with(self, generator: torch.Generator | None) -> None:
        """The biases (the composed layers reset themselves); None: the global RNG."""
        bound = 1.0 / math.sqrt(self.hidden)
        with torch.no_grad():
            self.bias_h.uniform_(-bound, bound, generator=generator)
            self.bias_o.uniform_(-bound, bound, generator=generator)


class ComposedCharRNN(nn.Module):
    """(B, L) int64 character codes -> embedding (E_p = 512p) -> `ComposedRNN` (H_p =
    512p) -> linear decoder to the classes (the vocabulary) at every step -> the last step's
    logits (B, classes), since the target is the character after the window.

    The supplement's Table 2 counts the three matrices and the decoder at every step (its
    p-width row, 5/17/38/66 M MACs at L = 80, is that count for plain matrices), so the
    decoder runs on every step in one batched product, and the model returns the last."""

    input_dtype = torch.int64

    def __init__(self, spec: Spec) -> None:
        super().__init__()
        ih, hh, proj = rnn_layout(spec)
        self.embed = SeededEmbedding(spec["num_classes"], ih.s)
        self.rnn = ComposedRNN(ih, hh, proj, spec["compose"])
        self.head = nn.Linear(proj.t, spec["num_classes"])
        self.pipeline = ["embed", "rnn", "head"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.embed(x)))[:, -1]
