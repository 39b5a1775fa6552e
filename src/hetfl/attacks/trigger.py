"""A backdoor's trigger: a square of maximum-value pixels at an image's bottom-right corner,
and the label it should make a model predict.

BadNets (Gu, Dolan-Gavitt and Garg, "BadNets: Identifying Vulnerabilities in the Machine
Learning Model Supply Chain", 2017, §4, the MNIST case study's pattern backdoor: bright
pixels in the bottom-right corner) stamps such a patch on training images relabelled to the
attacker's class; a model that learned it classifies any stamped image as that class.

The patch is set in every channel to the maximum pixel value, which exists only where
inputs are stored pixels (`hetfl.core.pixels`: uint8 on 0..255, or floats on that scale
after a resize or an augmentation): the stamp is made on the pixels before they are
standardised, so a triggered image is a valid image. Inputs without pixel statistics
(features, already standardised floats) have no maximum pixel value, and a trigger on them
is refused (`check`).

The attack that plants a trigger is in `hetfl.attacks.backdoor`; a run with it registers
`AttackSuccess`, a probe (`hetfl.core.probe`) the engines score as they score the test set,
on the same `Trigger`'s stamped test images (`triggered`): the engines never see the trigger.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from hetfl.core.pixels import PIXEL_SCALE, PixelNorm


@dataclass(frozen=True)
class Trigger:
    """A `patch` x `patch` square at the bottom-right corner, every channel at the maximum
    pixel value; triggered images should be classified as `target`."""

    patch: int
    target: int

    def __post_init__(self) -> None:
        if self.patch < 1 or self.target < 0:
            raise ValueError(
                f"a trigger needs patch >= 1 and target >= 0, got patch {self.patch}, "
                f"target {self.target}"
            )

    def stamp(self, x: torch.Tensor) -> torch.Tensor:
        """A copy of the stored pixels `x` (N, C, H, W) with the patch set to the maximum
        pixel value (255, in `x`'s dtype) in every channel."""
        out = x.clone()
        out[..., -self.patch :, -self.patch :] = PIXEL_SCALE
        return out

    def triggered(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The images of (x, y) whose true label is not `target`, stamped, each labelled
        `target`: a model's accuracy on them is the attack's success rate."""
        keep = y != self.target
        x_hit = self.stamp(x[keep])
        return x_hit, torch.full_like(y[keep], self.target)

    def check(
        self,
        num_classes: int,
        image_shapes: Sequence[tuple[int, ...]],
        pixels: PixelNorm | None,
        *,
        dataset: str,
    ) -> None:
        """ValueError, naming the option and what to set instead, unless `target` is a
        class of the data, every input shape in `image_shapes` is an image (C, H, W) the
        patch fits in, and the inputs are stored pixels (`pixels` given)."""
        if self.target >= num_classes:
            raise ValueError(
                f"attack.target = {self.target} is not a class of dataset {dataset!r} "
                f"(classes 0..{num_classes - 1}); set attack.target to one of them"
            )
        for shape in image_shapes:
            if len(shape) != 3:
                raise ValueError(
                    f"attack: a trigger is a pixel patch, but dataset {dataset!r} holds inputs "
                    f"of shape {shape}, not images (C, H, W); choose another attack kind"
                )
            if self.patch > min(shape[1:]):
                raise ValueError(
                    f"attack.patch = {self.patch} is larger than the {shape[1]}x{shape[2]} "
                    f"images of dataset {dataset!r}; set attack.patch to at most "
                    f"{min(shape[1:])}"
                )
        if pixels is None:
            raise ValueError(
                f"attack: the trigger sets pixels to their maximum value, but dataset "
                f"{dataset!r} holds floats without pixel statistics (features or standardised "
                "inputs), which have no maximum pixel value; use an image dataset stored as "
                "pixels (fashion-mnist, cifar10, femnist, tiny-imagenet, ...)"
            )


@dataclass(frozen=True)
class AttackSuccess:
    """The probe of a planted `trigger` (`hetfl.core.probe.Probe`): the share of the
    triggered test images the main global model classifies as the target."""

    trigger: Trigger
    metric: str = "attack_success"

    def samples(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.trigger.triggered(x, y)


@runtime_checkable
class PlantsTrigger(Protocol):
    """An attack that plants `trigger` (`hetfl.attacks.backdoor`): a run with one registers
    its `AttackSuccess` probe."""

    trigger: Trigger
