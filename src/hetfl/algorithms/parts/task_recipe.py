"""A method's plain local training for the task its model family serves: cross-entropy
for a classifier, SSD's objective for a detector (`hetfl.core.client.multibox`, with the
family's default boxes), so a method that trains plainly (ScalableFL) trains either."""

from __future__ import annotations

from hetfl.algorithms.parts.widths import scalable_base
from hetfl.core.client.multibox import MultiBoxLoss
from hetfl.core.client.recipe import LocalRecipe
from hetfl.core.types import ModelFamily
from hetfl.models.scalable import ARCHITECTURES
from hetfl.models.ssd import default_boxes


def plain_recipe(family: ModelFamily, method: str) -> LocalRecipe:
    """The default recipe, with SSD's loss as its forward when `family` is a detector."""
    name = scalable_base(family, method)["family"]
    if ARCHITECTURES.get(name).detector:
        return LocalRecipe(forward=MultiBoxLoss(default_boxes))
    return LocalRecipe()
