"""The per-channel pixel statistics of a training set, computed exactly from its uint8 pixels.

The image loaders (CIFAR-10/100, Tiny-ImageNet) compute their `PixelNorm` from the training
images they load rather than copying published constants: the values are then those of
the data actually loaded, by definition of the `Dataset` contract ("per-channel statistics
of the training set"), and a test can check them against NumPy. On the full official
training sets they should be the widely quoted population statistics (CIFAR-10: mean
0.4914, 0.4822, 0.4465, std 0.2470, 0.2435, 0.2616; not verified here, there being no
network). Much widely copied CIFAR-10 code normalises with std (0.2023, 0.1994, 0.2010)
instead, which is not the population std of the pixels.

A uint8 channel takes 256 values, so a histogram per channel gives the mean and the
(population, ddof=0) standard deviation exactly, in float64, touching the pixels once and
holding one chunk of samples at a time: no float copy of the images is ever made.
"""

from __future__ import annotations

import numpy as np

from hetfl.core.pixels import PIXEL_SCALE, PixelNorm

#: Samples per histogram chunk: 4096 CIFAR images are 12 MB.
_CHUNK = 4096


def pixel_norm_of(x: np.ndarray) -> PixelNorm:
    """Mean and std per channel of uint8 images `x` (N, C, H, W), on the [0, 1] scale."""
    if x.dtype != np.uint8 or x.ndim != 4 or x.shape[0] == 0:
        raise ValueError(
            f"pixel statistics need uint8 images (N, C, H, W) with N > 0, got {x.dtype} "
            f"of shape {x.shape}"
        )
    channels = x.shape[1]
    counts = np.zeros((channels, 256), dtype=np.int64)
    for start in range(0, x.shape[0], _CHUNK):
        block = x[start : start + _CHUNK]
        for c in range(channels):
            counts[c] += np.bincount(block[:, c].ravel(), minlength=256)
    values = np.arange(256, dtype=np.float64) / PIXEL_SCALE
    n = counts.sum(axis=1)
    mean = counts @ values / n
    var = (counts * (values[None, :] - mean[:, None]) ** 2).sum(axis=1) / n
    return PixelNorm(tuple(float(m) for m in mean), tuple(float(s) for s in np.sqrt(var)))
