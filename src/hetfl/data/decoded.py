"""Image files decoded once into uint8 arrays, and the cache folder that keeps them.

The folder-of-images datasets (Tiny-ImageNet, CINIC-10, HAM10000) hold tens of thousands
to hundreds of thousands of small files; decoding them takes minutes, so each loader
decodes them once with Pillow and keeps the arrays as `.npy` files in a cache folder.
The folder is written into a temporary directory and renamed into place, so a cache is
whole or absent, and a concurrent first load that placed it first wins. Later loads
memory-map the image arrays (names starting with `x`), so pages are read as samples are
used and shared between processes.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import IO

import numpy as np

from hetfl.core.pixels import PixelNorm


def decode_rgb(
    source: Path | IO[bytes], name: str, size: tuple[int, int], what: str, *, resize: bool = False
) -> np.ndarray:
    """One image file as (3, H, W) uint8 RGB, `size` being (W, H); grayscale, palette and
    other modes become RGB (a gray value in all three channels).

    With `resize`, any size is resampled to `size` with Pillow's bicubic filter (what
    `Image.resize` does by default, and so what the seed papers' code did); without, an
    image of another size is an error naming `name` and saying `what` images measure.
    """
    from PIL import Image, UnidentifiedImageError  # only a first load decodes

    try:
        with Image.open(source) as image:
            rgb = image.convert("RGB")
            if resize and rgb.size != size:
                rgb = rgb.resize(size, Image.Resampling.BICUBIC)
            pixels = np.asarray(rgb)  # (H, W, 3)
    except (UnidentifiedImageError, OSError) as exc:
        raise ValueError(f"{name}: not a readable image ({exc})") from exc
    if pixels.shape != (size[1], size[0], 3):
        raise ValueError(
            f"{name}: image is {pixels.shape[1]}x{pixels.shape[0]}; {what} images are "
            f"{size[0]}x{size[1]}"
        )
    return pixels.transpose(2, 0, 1)


def decode_files(paths: list[Path], size: tuple[int, int], what: str) -> np.ndarray:
    """The images at `paths`, each exactly `size` (W, H), as one (N, 3, H, W) uint8 array
    filled in place (`decode_rgb`)."""
    x = np.empty((len(paths), 3, size[1], size[0]), dtype=np.uint8)
    for i, path in enumerate(paths):
        x[i] = decode_rgb(path, str(path), size, what)
    return x


def write_arrays(cache: Path, arrays: Mapping[str, np.ndarray], what: str, room: str) -> None:
    """Save `arrays` as `<cache>/<name>.npy`, the folder placed whole by a rename.

    `what` names the cache and `room` the space it takes, for the error when the
    directory holding `cache` is not writable.
    """
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{cache.name}.", suffix=".part", dir=cache.parent))
        try:
            for name, array in arrays.items():
                np.save(tmp / f"{name}.npy", array)
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; the data is public
            os.rename(tmp, cache)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as exc:
        if cache.is_dir():  # a concurrent first load placed it first
            return
        raise OSError(
            f"cannot write the {what} cache {cache}: {exc}; the directory holding it must be "
            f"writable (with {room} free) for the first load"
        ) from exc


def read_arrays(cache: Path, names: Iterable[str]) -> dict[str, np.ndarray]:
    """The cached arrays by name; image arrays (`x...`) memory-mapped, read-only."""
    return {
        name: np.load(cache / f"{name}.npy", mmap_mode="r" if name.startswith("x") else None)
        for name in names
    }


def norm_array(norm: PixelNorm) -> np.ndarray:
    """A `PixelNorm` as the (2, C) float64 array a cache keeps: means, then stds."""
    return np.array([norm.mean, norm.std], dtype=np.float64)


def norm_of_array(array: np.ndarray) -> PixelNorm:
    """The `PixelNorm` that `norm_array` made `array` from."""
    mean, std = array
    return PixelNorm(tuple(map(float, mean)), tuple(map(float, std)))
