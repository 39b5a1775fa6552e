"""Axis-aligned boxes for object detection: the target layout, overlap and suppression.

Boxes are (x1, y1, x2, y2) in image fractions (0..1 of the width and height), so a
client view that resizes an image leaves its boxes unchanged. A detection sample's
targets are one float32 row per object, padded to a fixed count so that a split is one
(N, M, TARGET_FIELDS) tensor that batches slice like labels:

    [label, x1, y1, x2, y2, difficult]    label -1 marks a padding row

`difficult` (0 or 1) is PASCAL VOC's flag (Everingham et al., "The PASCAL Visual Object
Classes (VOC) Challenge", IJCV 2010, §4.1): such objects are kept, trained on (HetFL's
choice: SSD's paper does not say), and neither rewarded nor penalised in scoring
(`hetfl.core.client.average_precision`).

Overlap is continuous intersection over union; the VOC development kit's "+1 pixel"
convention for integer pixel boxes does not apply to fractional boxes.
"""

from __future__ import annotations

import torch

#: Fields of one target row: label, x1, y1, x2, y2, difficult.
TARGET_FIELDS = 6
#: The label of a padding row.
PAD_LABEL = -1


def box_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Pairwise intersection over union of boxes a (..., P, 4) and b (..., Q, 4), leading
    dimensions broadcast: (..., P, Q); boxes of zero area overlap nothing (IoU 0, never
    NaN)."""
    lo = torch.maximum(a[..., :, None, :2], b[..., None, :, :2])  # (..., P, Q, 2)
    hi = torch.minimum(a[..., :, None, 2:], b[..., None, :, 2:])
    inter = (hi - lo).clamp(min=0).prod(dim=-1)  # (..., P, Q)
    area_a = (a[..., 2:] - a[..., :2]).clamp(min=0).prod(dim=-1)  # (..., P)
    area_b = (b[..., 2:] - b[..., :2]).clamp(min=0).prod(dim=-1)  # (..., Q)
    union = area_a[..., :, None] + area_b[..., None, :] - inter
    return torch.where(union > 0, inter / union.clamp(min=1e-12), torch.zeros_like(inter))


def nms(boxes: torch.Tensor, scores: torch.Tensor, threshold: float) -> torch.Tensor:
    """Greedy non-maximum suppression: indices into boxes (D, 4) of the kept boxes, by
    descending score (ties by index); a box overlapping a kept one by IoU > `threshold`
    is dropped (SSD's evaluation: Liu et al., "SSD: Single Shot MultiBox Detector", ECCV
    2016, §3.7: NMS at IoU 0.45)."""
    order = torch.argsort(scores, descending=True, stable=True)
    iou = box_iou(boxes[order], boxes[order])  # (D, D), in score order
    removed = torch.zeros(order.numel(), dtype=torch.bool)
    kept: list[int] = []
    for i in range(order.numel()):
        if removed[i]:
            continue
        kept.append(i)
        removed |= iou[i] > threshold
    return order[torch.tensor(kept, dtype=torch.long)]


def corners(centre_form: torch.Tensor) -> torch.Tensor:
    """(..., 4) boxes (cx, cy, w, h) as (x1, y1, x2, y2)."""
    half = centre_form[..., 2:] / 2
    return torch.cat([centre_form[..., :2] - half, centre_form[..., :2] + half], dim=-1)


def centres(corner_form: torch.Tensor) -> torch.Tensor:
    """(..., 4) boxes (x1, y1, x2, y2) as (cx, cy, w, h)."""
    size = corner_form[..., 2:] - corner_form[..., :2]
    return torch.cat([corner_form[..., :2] + size / 2, size], dim=-1)
