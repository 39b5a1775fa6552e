"""A client's model from its data: ScalableFL's architecture rule and its HeteroFL
comparison's parameter-matched model (Nitta, Suzuki, Rodríguez Mulet, Yaguchi and Hirai,
"Scalable Federated Learning for Clients with Different Input Image Sizes and Numbers of
Output Categories", arXiv 2311.08716 v1, §III-A and §V).

A client with input side H and K classes trains c = ceil(log2(H / H0)) down-sampling
stages (halvings of the feature map) of a scalable family, each kappa = log10(K) /
log10(K0) times as wide as the family's base widths (`ScalingRule.model`; times
`model.width` too, which narrows the whole family for a small machine). §V's HeteroFL gives
a fixed depth instead and widths whose parameter count is the ScalableFL model's
(`ScalingRule.matched`, through `hetfl.models.matching`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from hetfl.core.spec import Spec
from hetfl.core.types import ModelFamily
from hetfl.models.matching import match_parameters, parameter_count
from hetfl.models.scalable import family_stages, input_reductions

#: A group's key (the models of `ScalingRule.at_fixed_depth` are per group).
K = TypeVar("K")


def scaled_depth(size: int, base_size: int) -> int:
    """c = ceil(log2(H / H0)), in integers: the smallest c >= 1 with H0 * 2**c >= H (an
    input no larger than H0 still gets one stage: c = 0 would leave no model)."""
    c = 1
    while base_size * 2**c < size:
        c += 1
    return c


def width_ratio(classes: int, base_classes: int) -> float:
    """kappa = log10(K) / log10(K0) (above 1 when K > K0)."""
    return math.log10(classes) / math.log10(base_classes)


def check_depth_scalable(base: Spec, method: str) -> None:
    """Refuses a family whose `stages` do not each halve the input once more: the depth
    rule needs one model per number of halvings."""
    reductions = input_reductions(base)
    if len(set(reductions)) < len(reductions):
        raise ValueError(
            f"{method} sets each client's depth, but {base['family']} has a fixed depth; use "
            "stage-cnn, resnet18 or preresnet"
        )


@dataclass(frozen=True)
class ScaledModel:
    """A client group's model: `depth` halvings, its spec, its parameter count (shared and
    private) and the ScalableFL count it was matched to (`target`; equal for ScalableFL's
    own model); `per_stage` when the match needed one ratio per stage."""

    depth: int
    spec: Spec
    params: int
    target: int
    per_stage: bool = False

    @property
    def gap(self) -> float:
        """Relative parameter-count difference to the target."""
        return (self.params - self.target) / self.target

    def summary(self) -> dict[str, Any]:
        """Depth (halvings), width ratios, parameters, target and gap, rounded for a report."""
        return {
            "depth": self.depth,
            "widths": [round(w, 6) for w in self.spec["widths"]],
            "params": self.params,
            "target": self.target,
            "gap": round(self.gap, 6),
        }


@dataclass(frozen=True)
class ScalingRule:
    """ScalableFL's rule for `family`, whose `base` spec is the model of width ratio 1 for
    K0 = `base_classes` classes, with a last feature map of side H0 = `base_size`."""

    family: ModelFamily
    base: Spec
    base_size: int
    base_classes: int

    def model(self, input_shape: tuple[int, ...], classes: int) -> ScaledModel:
        """ScalableFL's model (§III-A) for inputs of `input_shape` (C, H, W) and `classes`
        classes: depth from H, every width slot at kappa times the base's own ratio (1
        unless `model.width` narrows the family; the input channels are never scaled); its
        parameter count is its own target."""
        depth = scaled_depth(int(input_shape[1]), self.base_size)
        kappa = width_ratio(classes, self.base_classes)
        spec = self.base.replace(
            input_shape=tuple(input_shape),
            num_classes=classes,
            stages=family_stages(self.base, depth),
            widths=tuple(kappa * w for w in self.base["widths"]),
        )
        count = parameter_count(self.family, spec)
        return ScaledModel(depth, spec, count, count)

    def matched(
        self,
        model: ScaledModel,
        depth: int,
        *,
        tolerance: float,
        max_ratio: float,
        max_spread: float,
    ) -> ScaledModel:
        """§V's HeteroFL model in place of `model`: `depth` halvings, widths whose parameter
        count is nearest to `model`'s (`match_parameters`: one ratio, else one per stage)."""
        at_depth = model.spec.replace(stages=family_stages(self.base, depth))
        found = match_parameters(
            self.family,
            at_depth,
            model.target,
            tolerance=tolerance,
            max_ratio=max_ratio,
            max_spread=max_spread,
        )
        spec = at_depth.replace(widths=found.widths)
        return replace(
            model, depth=depth, spec=spec, params=found.params, per_stage=found.per_stage
        )

    def at_fixed_depth(
        self, models: Mapping[K, ScaledModel], below_max: int, **matching: float
    ) -> dict[K, ScaledModel]:
        """§V's HeteroFL comparison: every model `matched` at depth c_max - `below_max`,
        c_max the deepest of `models`; `matching` as `matched` takes it."""
        c_max = max(m.depth for m in models.values())
        if c_max - below_max < 1:
            raise ValueError(
                f"the fixed depth c_max - {below_max} needs c_max > {below_max}, got c_max = "
                f"{c_max}; lower base_size or train nearer c_max"
            )
        return {key: self.matched(m, c_max - below_max, **matching) for key, m in models.items()}
