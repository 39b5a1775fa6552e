"""Scoring a detector on images with targets: mAP@0.5 and the summed SSD loss.

The detector's outputs become detections (`hetfl.core.client.multibox.detections`) and are
scored with VOC's rules (`hetfl.core.client.average_precision`), `difficult` objects
ignored; the loss is `MultiBoxLoss`'s per-sample loss summed over the batches, as
classification's scoring sums cross-entropy (`hetfl.core.client.scoring`).
"""

from __future__ import annotations

import torch
from torch import nn

from hetfl.core.boxes import PAD_LABEL
from hetfl.core.client.average_precision import (
    Detections,
    GroundTruth,
    Interpolation,
    mean_average_precision,
)
from hetfl.core.client.multibox import MultiBoxLoss, detections
from hetfl.core.client.scoring import EVAL_BATCH
from hetfl.core.pixels import PixelNorm, model_inputs


def ground_truth(targets: torch.Tensor) -> list[GroundTruth]:
    """Each image's objects of padded targets (N, M, 6)."""
    out = []
    for rows in targets:
        real = rows[:, 0] != PAD_LABEL
        out.append(GroundTruth(rows[real, 1:5], rows[real, 0].long(), rows[real, 5] > 0))
    return out


@torch.no_grad()
def evaluate_detector(
    model: nn.Module,
    x: torch.Tensor,
    targets: torch.Tensor,
    loss: MultiBoxLoss,
    priors: torch.Tensor,
    num_classes: int,
    *,
    pixels: PixelNorm | None = None,
    batch_size: int = EVAL_BATCH,
    interpolation: Interpolation = "all-point",
) -> tuple[float | None, float, int]:
    """(mAP@0.5, summed loss, count) of `model` in eval mode on (x, targets); mAP None when
    the images hold no scored object."""
    model.eval()
    found: list[Detections] = []
    loss_sum = 0.0
    for start in range(0, int(x.shape[0]), batch_size):
        batch = model_inputs(x[start : start + batch_size], pixels)
        outputs = model(batch)
        loss_sum += float(
            loss.per_sample(outputs, targets[start : start + batch_size], priors).sum()
        )
        found += detections(outputs, priors, variances=loss.variances)
    mean, _ = mean_average_precision(
        found, ground_truth(targets), num_classes, interpolation=interpolation
    )
    return mean, loss_sum, int(x.shape[0])
