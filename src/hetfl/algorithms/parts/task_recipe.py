"""A method's plain local training for the task its model family serves: cross-entropy
for a classifier, SSD's objective for a detector (`hetfl.core.client.multibox`, with the
family's default boxes) and scored by mAP (`DetectionScoring`), so a method that trains
plainly (ScalableFL) trains either."""

from __future__ import annotations

from hetfl.algorithms.parts.widths import scalable_base
from hetfl.core.client.detection_scoring import DetectionScoring
from hetfl.core.client.multibox import MultiBoxLoss
from hetfl.core.client.recipe import LocalRecipe
from hetfl.core.types import ModelFamily
from hetfl.models.scalable import ARCHITECTURES
from hetfl.models.ssd import default_boxes


def plain_recipe(family: ModelFamily, method: str) -> LocalRecipe:
    """The default recipe, with SSD's loss as its forward and mAP as its scoring when
    `family` is a detector (the interpolation is the run's: `scored_with`)."""
    name = scalable_base(family, method)["family"]
    if ARCHITECTURES.get(name).detector:
        loss = MultiBoxLoss(default_boxes)
        return LocalRecipe(forward=loss, scoring=DetectionScoring(loss))
    return LocalRecipe()
