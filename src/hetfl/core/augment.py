"""Training-time augmentation of a batch of images, drawn from the client's own generator.

The transforms most FL papers train CIFAR and Tiny-ImageNet with: a random crop from the
image padded with black on every side, a horizontal flip, torchvision's random resized
crop, and Cutout (DeVries and Taylor 2017, "Improved Regularization of Convolutional Neural
Networks with Cutout", §3: one square patch per image, its centre uniform over the image,
clipped at the borders, set to zero after normalisation). Each acts on the whole batch in a
few tensor operations; none loops over images in Python.

Determinism. A client's draws come from a generator derived from (seed, round, client,
"augment") (`hetfl.core.rng.sibling_generator` of its training generator) and are consumed
per batch in step order, in a fixed order of transforms: crop offsets, flips, resized-crop
boxes, Cutout centres. So a run is reproducible, a client's augmentation does not depend on
which other clients train or in which process, and a resumed run draws what an
uninterrupted one draws.

Order within a batch: the geometric transforms act on the pixels as stored (a crop pads
with 0, black, as on a PIL image), then the pixels are standardised (`hetfl.core.pixels`),
then Cutout zeroes its patch, which is the mean colour, as in DeVries and Taylor's code.
On inputs without pixel statistics (already scaled arrays) the padding and the patch are
zeros of that scale.

Random resized crop samples the box as torchvision's `RandomResizedCrop` does (area
fraction uniform in `scale`, log aspect ratio uniform in `ratio`, ten tries, then the
central crop of the clamped ratio), but resamples with `affine_grid` and bilinear
`grid_sample` at the output grid's points: there is no antialiasing filter when the box is
larger than the output, so a strongly shrunk crop is sharper (more aliased) than PIL's
resize of the same box.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hetfl.core.pixels import PixelNorm, model_inputs

#: How many boxes random resized crop draws per image before falling back to the centre.
RESIZED_CROP_TRIES = 10


@dataclass(frozen=True)
class ResizedCrop:
    """torchvision's `RandomResizedCrop` box distribution: area fraction in `scale`,
    aspect ratio (width / height) in `ratio`, resampled to the input's own size."""

    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)

    def __post_init__(self) -> None:
        lo, hi = self.scale
        if not 0 < lo <= hi <= 1:
            raise ValueError(f"resized crop scale must satisfy 0 < lo <= hi <= 1, got {self.scale}")
        if not 0 < self.ratio[0] <= self.ratio[1]:
            raise ValueError(f"resized crop ratio must satisfy 0 < lo <= hi, got {self.ratio}")


@dataclass(frozen=True)
class Augmentation:
    """Which transforms a client's training batches get; all off is no augmentation.

    `crop_padding`: pad by this many pixels, then crop back to the input size at a random
    offset; `flip`: mirror left-right with probability 1/2; `resized_crop`: a random
    resized crop; `cutout`: the side of Cutout's square patch, in pixels.
    """

    crop_padding: int = 0
    flip: bool = False
    resized_crop: ResizedCrop | None = None
    cutout: int = 0

    def __post_init__(self) -> None:
        if self.crop_padding < 0 or self.cutout < 0:
            raise ValueError(
                f"crop padding and cutout size must be >= 0, got {self.crop_padding} and "
                f"{self.cutout}"
            )

    @property
    def active(self) -> bool:
        return bool(self.crop_padding or self.flip or self.resized_crop or self.cutout)

    def __call__(
        self, x: torch.Tensor, generator: torch.Generator, pixels: PixelNorm | None
    ) -> torch.Tensor:
        """The model inputs of one training batch `x` (N, C, H, W) as stored."""
        return self.standardised(self.geometric(x, generator), generator, pixels)

    def geometric(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """The crop, flip and resized crop of a batch `x` (N, C, H, W) as stored, still
        pixels on their stored scale (what a backdoor stamps its trigger on,
        `hetfl.core.types.ClientData.train_batch`)."""
        if x.dim() != 4:
            raise ValueError(
                f"augmentation needs images (N, C, H, W), got inputs of shape {tuple(x.shape)}"
            )
        if self.crop_padding:
            x = padded_crop(x, self.crop_padding, generator)
        if self.flip:
            x = random_flip(x, generator)
        if self.resized_crop is not None:
            x = resized_crop(x, self.resized_crop, generator)
        return x

    def standardised(
        self, x: torch.Tensor, generator: torch.Generator, pixels: PixelNorm | None
    ) -> torch.Tensor:
        """`geometric`'s pixels standardised, then Cutout's patch: the model inputs."""
        x = model_inputs(x, pixels)
        if self.cutout:
            x = cutout(x, self.cutout, generator)
        return x


def _uniform(n: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    return torch.rand(n, generator=generator, device=device)


def padded_crop(x: torch.Tensor, padding: int, generator: torch.Generator) -> torch.Tensor:
    """Each image padded with zeros by `padding` on every side, then cropped back to its
    size at an offset uniform in 0..2·padding along each axis: one gather of each image's
    window from its flattened padded planes."""
    n, c, h, w = x.shape
    padded = F.pad(x, (padding, padding, padding, padding))
    offsets = torch.randint(0, 2 * padding + 1, (2, n), generator=generator, device=x.device)
    rows = offsets[0, :, None] + torch.arange(h, device=x.device)  # (N, H)
    cols = offsets[1, :, None] + torch.arange(w, device=x.device)  # (N, W)
    window = rows[:, :, None] * (w + 2 * padding) + cols[:, None, :]  # (N, H, W) flat indices
    index = window.view(n, 1, h * w).expand(n, c, h * w)
    return padded.view(n, c, -1).gather(2, index).view(n, c, h, w)


def random_flip(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Each image mirrored left-right with probability 1/2."""
    flipped = _uniform(x.shape[0], generator, x.device) < 0.5
    return torch.where(flipped[:, None, None, None], x.flip(3), x)


def resized_crop(x: torch.Tensor, box: ResizedCrop, generator: torch.Generator) -> torch.Tensor:
    """Each image's random box (see `ResizedCrop`) resampled bilinearly to the image size.
    Returns floats on the scale of `x` (uint8 pixels stay on 0..255)."""
    n, _, h, w = x.shape
    bw, bh = _boxes(n, h, w, box, generator, x.device)  # box sides as fractions of the image
    # Box corners: offsets uniform over the positions where the box fits.
    left = _uniform(n, generator, x.device) * (1 - bw)
    top = _uniform(n, generator, x.device) * (1 - bh)
    theta = torch.zeros(n, 2, 3, device=x.device)
    theta[:, 0, 0] = bw
    theta[:, 1, 1] = bh
    theta[:, 0, 2] = 2 * left + bw - 1  # the box centre in [-1, 1] coordinates
    theta[:, 1, 2] = 2 * top + bh - 1
    grid = F.affine_grid(theta, [n, x.shape[1], h, w], align_corners=False)
    return F.grid_sample(
        x.to(torch.float32), grid, mode="bilinear", padding_mode="border", align_corners=False
    )


def _boxes(
    n: int, h: int, w: int, box: ResizedCrop, generator: torch.Generator, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(width, height) of each image's box as fractions of the image: the first of
    `RESIZED_CROP_TRIES` draws that fits, else the centre crop of the clamped ratio
    (torchvision's rule), in pixels rounded as torchvision rounds them."""
    area = h * w
    draws = torch.rand(2, n, RESIZED_CROP_TRIES, generator=generator, device=device)
    lo, hi = box.scale
    target = area * (lo + (hi - lo) * draws[0])
    log_lo, log_hi = math.log(box.ratio[0]), math.log(box.ratio[1])
    aspect = torch.exp(log_lo + (log_hi - log_lo) * draws[1])
    bw = torch.sqrt(target * aspect).round()
    bh = torch.sqrt(target / aspect).round()
    fits = (bw > 0) & (bw <= w) & (bh > 0) & (bh <= h)
    first = torch.where(fits.any(1), fits.to(torch.int8).argmax(1), -1)
    # The fallback: the whole image cropped to the nearest allowed aspect ratio.
    image_ratio = w / h
    if image_ratio < box.ratio[0]:
        fw, fh = w, round(w / box.ratio[0])
    elif image_ratio > box.ratio[1]:
        fw, fh = round(h * box.ratio[1]), h
    else:
        fw, fh = w, h
    take = first.clamp(min=0)[:, None]
    out_w = torch.where(first >= 0, bw.gather(1, take)[:, 0], torch.full_like(bw[:, 0], fw))
    out_h = torch.where(first >= 0, bh.gather(1, take)[:, 0], torch.full_like(bh[:, 0], fh))
    return out_w / w, out_h / h


def cutout(x: torch.Tensor, size: int, generator: torch.Generator) -> torch.Tensor:
    """Each image with a `size` x `size` square set to zero, centred at a uniform pixel and
    clipped at the borders (DeVries and Taylor 2017, §3)."""
    n, _, h, w = x.shape
    cy = torch.randint(0, h, (n,), generator=generator, device=x.device)
    cx = torch.randint(0, w, (n,), generator=generator, device=x.device)
    rows = torch.arange(h, device=x.device)
    cols = torch.arange(w, device=x.device)
    half = size // 2
    in_rows = (rows >= (cy - half)[:, None]) & (rows < (cy - half + size)[:, None])  # (N, H)
    in_cols = (cols >= (cx - half)[:, None]) & (cols < (cx - half + size)[:, None])  # (N, W)
    patch = in_rows[:, None, :, None] & in_cols[:, None, None, :]
    return x.masked_fill(patch, 0.0)
