"""Scoring a detector on images with targets: mAP@0.5 and the summed SSD loss.

The detector's outputs become detections (`hetfl.core.client.multibox.detections`) and are
scored with VOC's rules (`hetfl.core.client.average_precision`), `difficult` objects
ignored; the loss is `MultiBoxLoss`'s per-sample loss summed over the batches, as
classification's scoring sums cross-entropy (`hetfl.core.client.scoring`).

`DetectionScoring` is a detector recipe's `scoring` (`hetfl.core.client.recipe`): a
client's mAP is over its whole split at once (AP ranks every detection of the split, so it
is not a sum over batches), and is handed on as mAP x count, the slot where classification
puts its correct count, so that every executor and the Flower nodes carry it unchanged and
the engine's score over count is the mAP. A split whose images hold no scored object (only
`difficult` ones) scores 0.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

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
from hetfl.core.client.recipe import LocalRecipe
from hetfl.core.client.scoring import EVAL_BATCH
from hetfl.core.pixels import PixelNorm, model_inputs
from hetfl.core.spec import Spec


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


@dataclass(frozen=True)
class DetectionScoring:
    """A detector's scoring (module docstring) with `loss`'s default boxes and variances,
    AP by `interpolation` (config `eval.map_interpolation`)."""

    loss: MultiBoxLoss
    interpolation: Interpolation = "all-point"

    def __call__(
        self,
        model: nn.Module,
        x: torch.Tensor,
        y: torch.Tensor,
        spec: Spec,
        num_classes: int,
        pixels: PixelNorm | None,
    ) -> tuple[float, float, int]:
        priors = self.loss.priors(spec).to(x.device)
        mean, loss_sum, n = evaluate_detector(
            model,
            x,
            y,
            self.loss,
            priors,
            num_classes,
            pixels=pixels,
            interpolation=self.interpolation,
        )
        return (mean or 0.0) * n, loss_sum, n


def scored_with(recipe: LocalRecipe, interpolation: Interpolation) -> LocalRecipe:
    """`recipe` with its detection scoring's AP by `interpolation` (config
    `eval.map_interpolation`); a recipe scored otherwise is returned as it is."""
    if not isinstance(recipe.scoring, DetectionScoring):
        return recipe
    return replace(recipe, scoring=replace(recipe.scoring, interpolation=interpolation))
