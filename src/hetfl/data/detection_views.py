"""From a detection set to clients in groups of one input side and one class count.

ScalableFL's detection experiment (Nitta et al., arXiv 2311.08716, §V-B) has client
groups that differ in input size and in the categories they detect. A `DetectionGroup`
names a group's side, its class count K (the set's classes 0..K-1) and its clients;
`detection_clients` deals the training images to every client IID (equal shares, from a
seeded permutation) and the test images likewise, then gives each client its group's view:
only the objects of its classes are kept (the others become background, as when a
category is not annotated), images left without an object are dropped, and the images
are resized to the group's side (`hetfl.data.views.resize_images`; boxes are fractions,
so they stay). The targets take the place of the labels in `ClientData` (y (N, M, 6)),
so batches slice them as they slice labels.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hetfl.core.boxes import PAD_LABEL
from hetfl.core.rng import SERVER, numpy_generator
from hetfl.core.types import ClientData
from hetfl.data.detection import DetectionSet
from hetfl.data.views import resize_images


@dataclass(frozen=True)
class DetectionGroup:
    """`clients` clients that see images at `side` pixels and the classes 0..`classes`-1."""

    side: int
    classes: int
    clients: int

    def __post_init__(self) -> None:
        if self.side < 1 or self.classes < 1 or self.clients < 1:
            raise ValueError(
                "a detection group needs side >= 1, classes >= 1 and clients >= 1, got "
                f"side={self.side}, classes={self.classes}, clients={self.clients}"
            )


def restrict_targets(targets: np.ndarray, classes: int) -> tuple[np.ndarray, np.ndarray]:
    """(the images that hold an object of the classes 0..`classes`-1, their targets with
    the other objects padded out), of targets (N, M, 6)."""
    out = targets.copy()
    other = (out[..., 0] != PAD_LABEL) & (out[..., 0] >= classes)
    out[other] = 0.0
    out[..., 0][other] = PAD_LABEL
    kept = np.flatnonzero((out[..., 0] != PAD_LABEL).any(axis=1))
    return kept, out[kept]


def detection_clients(
    data: DetectionSet,
    groups: Sequence[DetectionGroup],
    seed: int,
    device: torch.device | str = "cpu",
) -> list[ClientData]:
    """The clients of `groups`, in order, with ids 0, 1, ... (module docstring)."""
    if not groups:
        raise ValueError("detection_clients needs at least one group")
    widest = max(g.classes for g in groups)
    if widest > data.num_classes:
        raise ValueError(
            f"a group detects {widest} classes, but {data.name} has {data.num_classes}"
        )
    total = sum(g.clients for g in groups)
    if total > min(len(data.x_train), len(data.x_test)):
        raise ValueError(
            f"{total} clients but {len(data.x_train)} training and {len(data.x_test)} test "
            f"images in {data.name}: every client needs at least one of each"
        )
    rng = numpy_generator(seed, 0, SERVER, "detection-partition")
    train_shares = np.array_split(rng.permutation(len(data.x_train)), total)
    test_shares = np.array_split(rng.permutation(len(data.x_test)), total)
    clients: list[ClientData] = []
    for group in groups:
        for _ in range(group.clients):
            cid = len(clients)
            x_train, t_train = _view(data.x_train, data.targets_train, train_shares[cid], group)
            x_test, t_test = _view(data.x_test, data.targets_test, test_shares[cid], group)
            clients.append(
                ClientData(
                    cid,
                    x_train.to(device),
                    t_train.to(device),
                    x_test.to(device),
                    t_test.to(device),
                    group.classes,
                    pixels=data.pixels,
                )
            )
    return clients


def _view(
    x: np.ndarray, targets: np.ndarray, share: np.ndarray, group: DetectionGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """A share's images that hold the group's classes, at its side, and their targets."""
    share = np.sort(share)
    kept, rows = restrict_targets(targets[share], group.classes)
    images = torch.from_numpy(np.ascontiguousarray(x[share[kept]]))
    return resize_images(images, group.side), torch.from_numpy(rows)
