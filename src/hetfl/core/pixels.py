"""Images kept as stored pixels and standardised per batch.

Image datasets hold their pixels as uint8 (N, C, H, W) arrays: CIFAR-10 takes 150 MB
that way against 600 MB as float32, Tiny-ImageNet 1.2 GB against 4.9 GB. A batch becomes
the float32 input a model sees only when it is drawn, through the dataset's `PixelNorm`:
`(x / 255 - mean[c]) / std[c]`, the standardisation torchvision's `ToTensor` then
`Normalize` applies, with per-channel statistics of the training set. Augmentation
(`hetfl.data.augment`) works on the pixels before this step, so that a crop pads with
black as it does on a PIL image.

Inputs that are not pixels (features, already standardised images, token codes) carry no
`PixelNorm` and pass through unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: A uint8 pixel's value range: pixels are divided by this before standardising.
PIXEL_SCALE = 255.0


@dataclass(frozen=True)
class PixelNorm:
    """Per-channel mean and standard deviation of pixel values in [0, 1]."""

    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.mean or len(self.mean) != len(self.std):
            raise ValueError(
                f"pixel statistics need one mean and one std per channel, got "
                f"{len(self.mean)} means and {len(self.std)} stds"
            )
        if any(s <= 0 for s in self.std):
            raise ValueError(f"pixel standard deviations must be > 0, got {self.std}")

    @property
    def channels(self) -> int:
        return len(self.mean)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """(..., C, H, W) pixels (uint8, or floats on the 0..255 scale after a resize or
        an augmentation) as float32 model inputs. One channel's statistics are applied as
        scalars, in the order `x / 255 - mean`, then `/ std`."""
        out = x.to(torch.float32) * (1 / PIXEL_SCALE)
        if self.channels == 1:
            return (out - self.mean[0]) / self.std[0]
        mean = torch.tensor(self.mean, dtype=torch.float32, device=x.device).view(-1, 1, 1)
        std = torch.tensor(self.std, dtype=torch.float32, device=x.device).view(-1, 1, 1)
        return (out - mean) / std


def model_inputs(x: torch.Tensor, pixels: PixelNorm | None) -> torch.Tensor:
    """`x` as a model takes it: standardised pixels, or `x` itself without pixel statistics."""
    return x if pixels is None else pixels(x)
