"""Client views: each client sees its images at its own input size and only its own classes.

ScalableFL (Nitta et al., arXiv 2311.08716, §III-A and §V-A) assumes
clients that differ in input image size H_j and in number of classes K_j: its ImageNet
clients hold 1000, 500, 200 or 100 random classes at 256, 192, 128 or 96 px. A view
reproduces that over any image dataset, on top of any partition:

- `classes`: the client keeps only the samples of K classes drawn for it, and its labels
  are remapped to 0..K-1 (in increasing order of the original class ids), so its model
  has a K-way head;
- `samples`: optionally a fixed number of its training samples (a seeded subset), so that
  clients of different groups hold balanced data, as in the paper ("the number of training
  samples of all clients is balanced");
- `size`: its images (training and local test) are resized to size x size once, when the
  federation is built, with bilinear interpolation and antialiasing (the triangle filter
  widened by the scale factor, so that down-sizing averages neighbours instead of aliasing).

Clients are dealt to groups in id order (ids are exchangeable: partitions are random). A
client's classes are drawn among those its partition holds, so a view narrows a
label-skewed partition rather than clashing with it.
Every draw comes from a generator derived from (seed, 0, client id, purpose), never the
global RNG, so one client's view does not depend on the others'. The local test split is
drawn from the test set in the proportions of the client's (restricted) training classes,
so it holds only the client's classes, and is resized and remapped the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from hetfl.core.rng import numpy_generator


@dataclass(frozen=True)
class ViewGroup:
    """`clients` clients that see `size` x `size` images (None: unchanged) of `classes`
    classes each (None: all, labels unchanged), `samples` training samples each (None: all
    of their classes in their partition)."""

    clients: int
    size: int | None = None
    classes: int | None = None
    samples: int | None = None


@dataclass(frozen=True)
class ClientView:
    """One client's view. `classes` holds the original class ids in increasing order; the
    client's label for class `classes[i]` is i."""

    size: int | None = None
    classes: tuple[int, ...] | None = None
    samples: int | None = None


def draw_views(
    groups: Sequence[ViewGroup],
    num_classes: int,
    seed: int,
    held: Sequence[Sequence[int]] | None = None,
) -> list[ClientView]:
    """One view per client, the clients of `groups[0]` first; each client's class subset is
    drawn without replacement from the generator for (seed, 0, client id, "view-classes").

    `held[cid]`, when given, lists the classes client `cid`'s partition holds: its subset
    is drawn from those, so that views work on top of label-skewed partitions too (under
    a partition that gives every client every class the draw is the same as without)."""
    views: list[ClientView] = []
    for g, group in enumerate(groups):
        if group.clients < 1:
            raise ValueError(f"data.groups[{g}].clients must be >= 1, got {group.clients}")
        if group.size is not None and group.size < 1:
            raise ValueError(f"data.groups[{g}].size must be >= 1, got {group.size}")
        if group.classes is not None and not 1 <= group.classes <= num_classes:
            raise ValueError(
                f"data.groups[{g}].classes must be in 1..{num_classes} (the dataset's classes), "
                f"got {group.classes}"
            )
        for _ in range(group.clients):
            cid = len(views)
            classes = None
            if group.classes is not None:
                candidates = np.arange(num_classes) if held is None else np.asarray(held[cid])
                if candidates.size < group.classes:
                    raise ValueError(
                        f"client {cid}'s partition holds {candidates.size} classes "
                        f"{candidates.tolist()}, fewer than data.groups[{g}].classes = "
                        f"{group.classes}; use a partition that gives every client at least "
                        "that many classes (a larger Dirichlet alpha, a larger k) or fewer classes"
                    )
                rng = numpy_generator(seed, 0, cid, "view-classes")
                drawn = rng.choice(candidates, size=group.classes, replace=False)
                classes = tuple(sorted(int(c) for c in drawn))
            views.append(ClientView(group.size, classes, group.samples))
    return views


def restrict(
    part: np.ndarray, labels: np.ndarray, view: ClientView, cid: int, seed: int
) -> np.ndarray:
    """The sorted indices of `part` the client keeps: those of its classes, then (with
    `samples`) a subset drawn from the generator for (seed, 0, cid, "view-samples").
    Every one of its classes must keep at least one sample, so that its label set is
    exactly 0..K-1."""
    kept = part if view.classes is None else part[np.isin(labels[part], view.classes)]
    if view.samples is not None:
        if kept.size < view.samples:
            raise ValueError(
                f"client {cid} holds {kept.size} training samples of its classes, fewer than "
                f"samples = {view.samples}; lower the group's samples or use fewer clients"
            )
        rng = numpy_generator(seed, 0, cid, "view-samples")
        kept = np.sort(rng.choice(kept, size=view.samples, replace=False))
    if view.classes is not None:
        missing = sorted(set(view.classes) - set(np.unique(labels[kept]).tolist()))
        if missing:
            raise ValueError(
                f"client {cid} has no training sample of its classes {missing}; use fewer "
                "clients, a partition that gives every client every class (iid), or more samples"
            )
    return kept


def remap_labels(y: torch.Tensor, classes: tuple[int, ...] | None) -> torch.Tensor:
    """Labels as positions in `classes` (class `classes[i]` -> i); unchanged for None."""
    if classes is None:
        return y
    table = torch.full((max(classes) + 1,), -1, dtype=y.dtype, device=y.device)
    table[list(classes)] = torch.arange(len(classes), dtype=y.dtype, device=y.device)
    if y.numel() and (int(y.max()) >= table.numel() or bool((table[y] < 0).any())):
        raise ValueError(f"labels outside the view's classes {classes}")
    return table[y]


def resize_images(x: torch.Tensor, size: int | None, chunk: int = 2048) -> torch.Tensor:
    """(N, C, H, W) images resized to (N, C, size, size), bilinear with antialiasing, in
    chunks to bound the memory of the intermediate buffers; unchanged for None or the
    same size. Stored uint8 pixels are resized as floats on their 0..255 scale (and stay
    floats: rounding them back would add quantisation noise), still to be standardised."""
    if size is None:
        return x
    if x.dim() != 4:
        raise ValueError(
            f"resizing needs images of shape (N, C, H, W), got inputs of shape {tuple(x.shape)}"
        )
    if tuple(x.shape[2:]) == (size, size):
        return x
    parts = [
        F.interpolate(
            x[i : i + chunk].to(torch.float32),
            size=(size, size),
            mode="bilinear",
            antialias=True,
            align_corners=False,
        )
        for i in range(0, int(x.shape[0]), chunk)
    ]
    return torch.cat(parts) if parts else x.new_zeros((0, x.shape[1], size, size))
