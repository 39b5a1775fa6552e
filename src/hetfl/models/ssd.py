"""One job: an SSD-style detector on ScalableFL's scalable stage backbone, and its default
boxes.

ScalableFL's detection experiment (Nitta et al., arXiv 2311.08716, §V-B and Tables VI,
IX) puts SSD heads (Liu et al., "SSD: Single Shot MultiBox Detector", ECCV 2016, §2.1) on
a backbone whose depth follows the input side (c = ceil(log2(H / H0)) halvings, H0 = 4
for detection) and whose width follows the class count. The heads attach to feature maps
of the same sides in every client (Table VI: COCO's head 1 on stage 3, VOC's on stage 2,
both 64x64), so default boxes match across clients; heads and every BatchNorm are private.

Here the backbone is the stage CNN of the paper's Fig. 1 (`StageSSD`): `stages` 3x3
stride-2 convolutions, each with BN and ReLU, base channels `BASE`; the `heads` last
feature maps each get a 3x3 class convolution to A (K + 1) channels (K classes and
background, the paper's Table VI count of A5) and a 3x3 box convolution to 4A channels,
A = 4 default boxes per location. So a client of side H has heads on the maps of sides
H/2^(c-heads+1) .. H/2^c, the same sides for clients whose H / 2^c agree.

Choices where the papers leave room (named in docs/methods.md):
- the width ratio scales every backbone stage (the issue's "width from category count");
  the paper's VOC model leaves the ResNet-18 stages unscaled and scales only its extra SSD
  stages (Table VI);
- A = 4 default boxes per location, aspect ratios {1, 2, 1/2} plus SSD's extra box of
  scale sqrt(s_k s_(k+1)) (SSD §2.2, "Choosing scales and aspect ratios"), on every map;
  scales s_k = s_min + (s_max - s_min)(k - 1)/(m - 1), s_min = 0.2, s_max = 0.9 (SSD
  §2.2; one map: s_min, its extra box at sqrt(s_min)); boxes clipped to the image, as the
  authors' code does;
- the output is one (B, A_total, 4 + K + 1) tensor: box offsets, then the background
  logit and the K class logits, for every default box in map order (row-major, box
  fastest), so that training parts and scoring read one tensor.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from hetfl.core.boxes import corners
from hetfl.core.spec import Spec
from hetfl.models.blocks import ConvUnit
from hetfl.models.norms import NormFactory
from hetfl.models.scalable import ARCHITECTURES, Architecture, SpecError
from hetfl.models.slim import SlimConv2d

#: Default boxes per feature-map location: ratios 1, 2, 1/2 and the extra ratio-1 box.
BOXES_PER_PLACE = 4
#: SSD's smallest and largest default-box scales (§2.2).
S_MIN, S_MAX = 0.2, 0.9
#: Heads unless the spec says `heads`.
DEFAULT_HEADS = 2


def head_count(spec: Spec) -> int:
    return int(spec.get("heads", DEFAULT_HEADS))


class SSDHeads(nn.Module):
    """The class and box convolutions of every head, applied to their feature maps:
    (B, A_total, 4 + K + 1). Private in ScalableFL (Table VI), and the model's `head`."""

    def __init__(self, channels: list[int], num_classes: int) -> None:
        super().__init__()
        out = BOXES_PER_PLACE * (num_classes + 1)
        self.classes = nn.ModuleList(
            SlimConv2d(c, out, 3, base_out=None, padding=1) for c in channels
        )
        self.boxes = nn.ModuleList(
            SlimConv2d(c, 4 * BOXES_PER_PLACE, 3, base_out=None, padding=1) for c in channels
        )
        self.num_classes = num_classes

    def forward(self, *features: torch.Tensor) -> torch.Tensor:
        """The maps as separate arguments, so the cost model sees the head run on a tensor
        (`hetfl.systems.costs`: the head is the last module of the pipeline)."""
        outs = []
        for f, cls, box in zip(features, self.classes, self.boxes, strict=True):
            b = f.shape[0]
            # (B, A (K+1), h, w) -> (B, h, w, A, K+1) -> (B, h w A, K+1)
            logits = cls(f).permute(0, 2, 3, 1).reshape(b, -1, self.num_classes + 1)
            offsets = box(f).permute(0, 2, 3, 1).reshape(b, -1, 4)
            outs.append(torch.cat([offsets, logits], dim=2))
        return torch.cat(outs, dim=1)  # (B, A_total, 4 + K + 1)


class StageSSD(nn.Module):
    """The stage-CNN backbone with SSD heads on its last `heads` feature maps (module
    docstring)."""

    BASE = (32, 64, 128, 256, 256, 256)

    def __init__(self, spec: Spec, norm: NormFactory) -> None:
        super().__init__()
        cin = spec["input_shape"][0]
        self.stages = nn.ModuleList()
        widths = []
        for i in range(spec["stages"]):
            unit = ConvUnit(cin, self.BASE[i], spec["widths"][i], norm, stride=2)
            self.stages.append(unit)
            cin = unit.conv.out_channels
            widths.append(cin)
        self.first_head = spec["stages"] - head_count(spec)
        self.head = SSDHeads(widths[self.first_head :], spec["num_classes"])
        self.pipeline = [f"stages.{i}" for i in range(len(self.stages))] + ["head"]

    def forward(self, x: torch.Tensor, width: float | None = None) -> torch.Tensor:
        features = []
        for i, stage in enumerate(self.stages):
            x = stage(x, width)  # (B, C_i, H / 2^(i+1), W / 2^(i+1))
            if i >= self.first_head:
                features.append(x)
        return self.head(*features)  # (B, A_total, 4 + K + 1)


def feature_sides(spec: Spec) -> list[tuple[int, int]]:
    """(h, w) of each head's feature map: a 3x3 stride-2 padding-1 convolution takes a side
    s to ceil(s / 2)."""
    h, w = spec["input_shape"][1:]
    sides = []
    for _ in range(spec["stages"]):
        h, w = -(-h // 2), -(-w // 2)
        sides.append((h, w))
    return sides[spec["stages"] - head_count(spec) :]


def default_boxes(spec: Spec) -> torch.Tensor:
    """(A_total, 4) default boxes (x1, y1, x2, y2) in image fractions, in the order of the
    model's output (module docstring; SSD §2.2)."""
    sides = feature_sides(spec)
    m = len(sides)
    scales = [S_MIN + (S_MAX - S_MIN) * k / (m - 1) for k in range(m)] if m > 1 else [S_MIN]
    scales.append(scales[-1] + (S_MAX - S_MIN) / (m - 1) if m > 1 else 1.0)
    boxes = []
    for k, (h, w) in enumerate(sides):
        s, extra = scales[k], math.sqrt(scales[k] * scales[k + 1])
        shapes = [
            (s, s),
            (s * math.sqrt(2), s / math.sqrt(2)),
            (s / math.sqrt(2), s * math.sqrt(2)),
        ]
        shapes.append((extra, extra))  # (width, height) of each of the place's boxes
        ys, xs = torch.meshgrid(
            (torch.arange(h, dtype=torch.float64) + 0.5) / h,
            (torch.arange(w, dtype=torch.float64) + 0.5) / w,
            indexing="ij",
        )
        centres = torch.stack([xs, ys], dim=-1).reshape(-1, 1, 2)  # (h w, 1, 2)
        sizes = torch.tensor(shapes, dtype=torch.float64).reshape(1, -1, 2)  # (1, A, 2)
        form = torch.cat([centres.expand(-1, BOXES_PER_PLACE, 2), sizes.expand(h * w, -1, 2)], 2)
        boxes.append(form.reshape(-1, 4))
    return corners(torch.cat(boxes)).clamp(0, 1).float()


def _check(spec: Spec) -> None:
    heads = head_count(spec)
    if not (isinstance(heads, int) and 1 <= heads <= spec["stages"]):
        raise SpecError(
            f"ssd-stage-cnn: heads must be an integer in 1..stages ({spec['stages']}), got "
            f"{spec.get('heads')}; a client of side H has ceil(log2(H / H0)) stages, so raise "
            "the input size or lower model.heads"
        )


ARCHITECTURES.register(
    "ssd-stage-cnn",
    Architecture(
        StageSSD,
        StageSSD.BASE,
        len(StageSSD.BASE),
        None,
        lambda s: 2 ** s["stages"],
        "SSD heads on ScalableFL's stage CNN (object detection)",
        check=_check,
        detector=True,
    ),
)
