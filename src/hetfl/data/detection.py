"""The `DetectionSet` record every detection source produces, checked when made.

Images are uint8 (N, 3, H, W) pixels with their `PixelNorm`, as the image classification
sets hold them; each image's objects are rows of a padded float32 (N, M, TARGET_FIELDS)
array in `hetfl.core.boxes`' layout (label, x1, y1, x2, y2 in image fractions, difficult;
label -1 pads), so a split is one tensor that batches slice. A source builds its rows
with `pad_targets`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hetfl.core.boxes import PAD_LABEL, TARGET_FIELDS
from hetfl.core.pixels import PixelNorm


@dataclass(frozen=True, eq=False)
class DetectionSet:
    """A train/test pair of images and their objects; `classes` names label 0, 1, ...

    `__post_init__` refuses what no detector can learn from and names the array and the
    image: images that are not uint8 (N, 3, H, W), targets not (N, M, 6) float32, labels
    outside 0..K-1 (or -1 for padding), boxes outside [0, 1] or of no area, `difficult`
    other than 0 or 1.
    """

    name: str
    x_train: np.ndarray
    targets_train: np.ndarray
    x_test: np.ndarray
    targets_test: np.ndarray
    classes: tuple[str, ...]
    pixels: PixelNorm

    def __post_init__(self) -> None:
        for split in ("train", "test"):
            self._check(split)
        if self.x_train.shape[1:] != self.x_test.shape[1:]:
            raise ValueError(
                f"dataset {self.name!r}: train images are {self.x_train.shape[1:]} but test "
                f"images are {self.x_test.shape[1:]}"
            )

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.x_train.shape[1:])

    def _check(self, split: str) -> None:
        x, t = getattr(self, f"x_{split}"), getattr(self, f"targets_{split}")
        where = f"dataset {self.name!r}, {split}"
        if x.dtype != np.uint8 or x.ndim != 4 or x.shape[1] != 3:
            raise ValueError(f"{where}: images must be uint8 (N, 3, H, W), got {x.dtype} {x.shape}")
        if t.dtype != np.float32 or t.ndim != 3 or t.shape[2] != TARGET_FIELDS:
            raise ValueError(
                f"{where}: targets must be float32 (N, M, {TARGET_FIELDS}), got {t.dtype} {t.shape}"
            )
        if t.shape[0] != x.shape[0]:
            raise ValueError(f"{where}: {x.shape[0]} images but {t.shape[0]} target rows")
        labels, boxes, difficult = t[..., 0], t[..., 1:5], t[..., 5]
        real = labels != PAD_LABEL
        problems = {
            "labels outside 0..K-1": real & ((labels < 0) | (labels >= self.num_classes)),
            "boxes outside [0, 1]": real[..., None] & ((boxes < 0) | (boxes > 1)),
            "boxes with x2 <= x1 or y2 <= y1": real[..., None] & (boxes[..., 2:] <= boxes[..., :2]),
            "difficult flags other than 0 or 1": real & (difficult != 0) & (difficult != 1),
        }
        for what, bad in problems.items():
            rows = np.flatnonzero(bad.reshape(bad.shape[0], -1).any(axis=1))
            if rows.size:
                raise ValueError(
                    f"{where}: {rows.size} images have {what}, the first image {int(rows[0])}"
                )


def pad_targets(objects: Sequence[np.ndarray]) -> np.ndarray:
    """Each image's (m_i, 6) object rows as one (N, max m_i, 6) float32 array, padded with
    label -1 rows (at least one column, so an image set without objects still has a
    shape)."""
    width = max([1, *(len(o) for o in objects)])
    out = np.zeros((len(objects), width, TARGET_FIELDS), dtype=np.float32)
    out[..., 0] = PAD_LABEL
    for i, rows in enumerate(objects):
        if len(rows):
            out[i, : len(rows)] = rows
    return out
