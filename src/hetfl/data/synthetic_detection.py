"""A seeded synthetic detection set: coloured shapes on textured backgrounds, no file.

Each image is a scene drawn from the seed alone: a background of a base colour under two
random sinusoidal gratings and pixel noise, and 1..`max_objects` shapes of up to six
classes (square, disc, triangle, ring, cross, diamond), each a random size (`min_size` ..
`max_size` of the side), place and colour, overlapping earlier ones by IoU at most 0.3.
A scene is described in image fractions and rasterised at `side` pixels (pixel centres
inside the shape take its colour), so the same seed gives the same scenes, and boxes, at
every resolution: the set of client groups at several input sizes that ScalableFL's
detection experiment needs (Nitta et al., arXiv 2311.08716, §V-B), small enough to run
here. Boxes are each shape's tight extent; no object is marked difficult.
"""

from __future__ import annotations

import numpy as np

from hetfl.core.pixels import PixelNorm
from hetfl.core.rng import SERVER, numpy_generator
from hetfl.data.detection import DetectionSet, pad_targets
from hetfl.data.pixel_stats import pixel_norm_of

#: The shape classes, label 0 .. 5.
SHAPES = ("square", "disc", "triangle", "ring", "cross", "diamond")
_MAX_OVERLAP = 0.3


def _scene(
    rng: np.random.Generator, num_classes: int, max_objects: int, sizes: tuple[float, float]
) -> dict:
    """One scene's parameters in image fractions."""
    background = {
        "colour": rng.uniform(60, 200, 3),
        "gratings": [
            (
                rng.uniform(2, 8),
                rng.uniform(0, np.pi),
                rng.uniform(0, 2 * np.pi),
                rng.uniform(15, 40),
            )
            for _ in range(2)
        ],
        "noise_seed": int(rng.integers(2**31)),
    }
    objects: list[tuple[int, np.ndarray, np.ndarray]] = []
    for _ in range(int(rng.integers(1, max_objects + 1))):
        for _attempt in range(10):
            size = rng.uniform(*sizes)
            x1, y1 = rng.uniform(0, 1 - size, 2)
            box = np.array([x1, y1, x1 + size, y1 + size])
            if all(_iou(box, b) <= _MAX_OVERLAP for _, b, _ in objects):
                colour = rng.uniform(0, 255, 3)
                objects.append((int(rng.integers(num_classes)), box, colour))
                break
    return {"background": background, "objects": objects}


def _iou(a: np.ndarray, b: np.ndarray) -> float:
    w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = w * h
    return inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter)


def _mask(shape: str, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Pixels inside `shape`, u and v the pixel centres in box coordinates (-1..1)."""
    r = np.hypot(u, v)
    if shape == "square":
        return (np.abs(u) <= 1) & (np.abs(v) <= 1)
    if shape == "disc":
        return r <= 1
    if shape == "triangle":  # apex at the top centre, base along the bottom
        return (v <= 1) & (np.abs(u) <= (v + 1) / 2)
    if shape == "ring":
        return (r <= 1) & (r >= 0.55)
    if shape == "cross":
        return ((np.abs(u) <= 0.3) & (np.abs(v) <= 1)) | ((np.abs(v) <= 0.3) & (np.abs(u) <= 1))
    return np.abs(u) + np.abs(v) <= 1  # diamond


def _render(scene: dict, side: int) -> np.ndarray:
    """The scene as (3, side, side) uint8."""
    grid = (np.arange(side) + 0.5) / side
    x, y = np.meshgrid(grid, grid)  # (side, side), x along the width
    bg = scene["background"]
    texture = np.zeros((side, side))
    for freq, angle, phase, amplitude in bg["gratings"]:
        texture += amplitude * np.sin(
            2 * np.pi * freq * (x * np.cos(angle) + y * np.sin(angle)) + phase
        )
    noise = np.random.default_rng(bg["noise_seed"]).normal(0, 8, (side, side))
    image = bg["colour"][:, None, None] + texture[None] + noise[None]
    for label, box, colour in scene["objects"]:
        centre, half = (box[:2] + box[2:]) / 2, (box[2:] - box[:2]) / 2
        inside = _mask(SHAPES[label], (x - centre[0]) / half[0], (y - centre[1]) / half[1])
        image[:, inside] = colour[:, None]
    return np.clip(np.rint(image), 0, 255).astype(np.uint8)


def _rows(scene: dict) -> np.ndarray:
    return np.array([[label, *box, 0.0] for label, box, _ in scene["objects"]], dtype=np.float32)


def synthetic_detection(
    n_train: int = 256,
    n_test: int = 64,
    num_classes: int = 3,
    side: int = 32,
    max_objects: int = 3,
    min_size: float = 0.25,
    max_size: float = 0.5,
    seed: int = 0,
) -> DetectionSet:
    """`n_train` and `n_test` scenes of `num_classes` shape classes at `side` pixels
    (module docstring); the pixel statistics are the training images'."""
    if not 1 <= num_classes <= len(SHAPES):
        raise ValueError(
            f"num_classes must be in 1..{len(SHAPES)} (the shapes {SHAPES}), got {num_classes}"
        )
    if n_train < 1 or n_test < 1 or max_objects < 1 or side < 8:
        raise ValueError(
            "synthetic detection needs n_train >= 1, n_test >= 1, max_objects >= 1 and side >= 8, "
            f"got n_train={n_train}, n_test={n_test}, max_objects={max_objects}, side={side}"
        )
    if not 0 < min_size <= max_size < 1:
        raise ValueError(
            f"object sizes need 0 < min_size <= max_size < 1, got {min_size}, {max_size}"
        )
    rng = numpy_generator(seed, 0, SERVER, "synthetic-detection")
    scenes = [
        _scene(rng, num_classes, max_objects, (min_size, max_size)) for _ in range(n_train + n_test)
    ]
    images = np.stack([_render(s, side) for s in scenes])
    targets = pad_targets([_rows(s) for s in scenes])
    x_train, x_test = images[:n_train], images[n_train:]
    pixels: PixelNorm = pixel_norm_of(x_train)
    return DetectionSet(
        "synthetic-detection",
        x_train,
        targets[:n_train],
        x_test,
        targets[n_train:],
        SHAPES[:num_classes],
        pixels,
    )
