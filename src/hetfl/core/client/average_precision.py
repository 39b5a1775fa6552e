"""Mean average precision at one IoU threshold, as PASCAL VOC scores detectors.

Everingham et al., "The PASCAL Visual Object Classes (VOC) Challenge", IJCV 2010, §4.2
(and the VOC development kit's `VOCevaldet.m`, from which the rules below are taken):
per class, all detections of every image are ranked by confidence; a detection is a true
positive when its best-overlapping ground-truth box of that class in its image has IoU
above the threshold (0.5) and was not claimed by a higher-ranked detection; a second
detection of one object is a false positive. A detection whose best match is a
`difficult` object counts as neither, and difficult objects are not in the recall's
denominator. AP summarises the precision/recall curve:

- `all-point` (the default; VOC 2010 onward, the development kit's `VOCap`): the area
  under the precision envelope, p_interp(r) = max_{r' >= r} p(r'), summed over every
  recall step;
- `11-point` (VOC 2007, IJCV 2010 §4.2 equation 1): the mean of p_interp(r) at
  r = 0, 0.1, ..., 1 (0 where that recall is never reached).

mAP is the mean over the classes that have at least one non-difficult object in the
scored images (the kit leaves a class without any undefined; HetFL skips it, so a
client's local mAP is over the classes it holds). Ties in confidence keep the order of
the images and, within one, the order the detector gave (a stable sort).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from hetfl.core.boxes import box_iou

Interpolation = Literal["all-point", "11-point"]
INTERPOLATIONS: tuple[Interpolation, ...] = ("all-point", "11-point")


@dataclass(frozen=True)
class Detections:
    """One image's detections: boxes (D, 4) in image fractions, scores (D,), labels (D,)."""

    boxes: torch.Tensor
    scores: torch.Tensor
    labels: torch.Tensor


@dataclass(frozen=True)
class GroundTruth:
    """One image's objects: boxes (G, 4), labels (G,), difficult (G,) bool."""

    boxes: torch.Tensor
    labels: torch.Tensor
    difficult: torch.Tensor


def average_precision(
    precision: torch.Tensor, recall: torch.Tensor, interpolation: Interpolation = "all-point"
) -> float:
    """AP of a ranked list's cumulative precision (R,) and recall (R,) (module docstring)."""
    if interpolation not in INTERPOLATIONS:
        raise ValueError(
            f"interpolation must be one of {INTERPOLATIONS}, got {interpolation!r}: "
            "'all-point' is VOC 2010 onward, '11-point' VOC 2007"
        )
    p = precision.double()
    r = recall.double()
    if interpolation == "11-point":
        points = [
            float(p[r >= t / 10].max()) if bool((r >= t / 10).any()) else 0.0 for t in range(11)
        ]
        return sum(points) / len(points)
    # the envelope: running maximum from the right, over a curve closed at (0, ·) and (1, 0)
    mpre = torch.cat([p.new_zeros(1), p, p.new_zeros(1)])
    mrec = torch.cat([r.new_zeros(1), r, r.new_ones(1)])
    mpre = torch.flip(torch.cummax(torch.flip(mpre, [0]), 0).values, [0])
    steps = torch.nonzero(mrec[1:] != mrec[:-1]).flatten() + 1
    return float(((mrec[steps] - mrec[steps - 1]) * mpre[steps]).sum())


def class_ap(
    detections: list[Detections],
    truths: list[GroundTruth],
    label: int,
    iou_threshold: float = 0.5,
    interpolation: Interpolation = "all-point",
) -> float | None:
    """AP of class `label` over the images (module docstring); None without a
    non-difficult object of that class."""
    positives = sum(int((~t.difficult[t.labels == label]).sum()) for t in truths)
    if positives == 0:
        return None
    scores, images, rows = [], [], []
    for i, det in enumerate(detections):
        mine = torch.nonzero(det.labels == label).flatten()
        scores.append(det.scores[mine].double())
        images += [i] * mine.numel()
        rows += mine.tolist()
    if not images:
        return 0.0
    order = torch.argsort(torch.cat(scores), descending=True, stable=True).tolist()
    claimed = [torch.zeros(int(t.labels.numel()), dtype=torch.bool) for t in truths]
    hits: list[bool] = []  # ranked: True a true positive, False a false one
    for k in order:
        image, row = images[k], rows[k]
        truth = truths[image]
        of_class = torch.nonzero(truth.labels == label).flatten()
        match = _best_match(detections[image].boxes[row], truth.boxes[of_class], iou_threshold)
        if match is None:
            hits.append(False)
            continue
        g = int(of_class[match])
        if bool(truth.difficult[g]):
            continue  # neither a true nor a false positive
        hits.append(not bool(claimed[image][g]))
        claimed[image][g] = True
    if not hits:
        return 0.0
    ranked = torch.tensor(hits, dtype=torch.float64)
    true_pos = ranked.cumsum(0)
    false_pos = (1 - ranked).cumsum(0)
    precision = true_pos / (true_pos + false_pos)
    return average_precision(precision, true_pos / positives, interpolation)


def _best_match(box: torch.Tensor, candidates: torch.Tensor, threshold: float) -> int | None:
    """The index of the candidate (G, 4) overlapping `box` (4,) most, when its IoU is
    above `threshold` (the kit's strict `ovmax > minoverlap`), else None."""
    if candidates.numel() == 0:
        return None
    iou = box_iou(box[None], candidates)[0]
    best = int(torch.argmax(iou))
    return best if float(iou[best]) > threshold else None


def mean_average_precision(
    detections: list[Detections],
    truths: list[GroundTruth],
    num_classes: int,
    iou_threshold: float = 0.5,
    interpolation: Interpolation = "all-point",
) -> tuple[float | None, dict[int, float]]:
    """(mAP, AP by class) over the images; mAP None when no class has a scored object."""
    if len(detections) != len(truths):
        raise ValueError(
            f"{len(detections)} images of detections but {len(truths)} of ground truth; "
            "give one of each per image"
        )
    if not 0 < iou_threshold < 1:
        raise ValueError(f"iou_threshold must be in (0, 1), got {iou_threshold}")
    per_class = {}
    for c in range(num_classes):
        ap = class_ap(detections, truths, c, iou_threshold, interpolation)
        if ap is not None:
            per_class[c] = ap
    if not per_class:
        return None, per_class
    return sum(per_class.values()) / len(per_class), per_class
