"""From a dataset and a partition to the clients' tensors.

Each client's training data is its partition of the training set, held as tensors on the
device (batches are index slices later, never a DataLoader per client). Its local test
split is drawn from the global test set in the proportions of the client's own training
classes, so that `local_acc` measures a personalised model on the distribution it was
trained for. With a validation fraction, part of the client's training data is held out
(`validation_split`) for model selection, which must never look at a test split.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import torch

from hetfl.core.augment import Augmentation
from hetfl.core.rng import SERVER, numpy_generator
from hetfl.core.types import ClientData
from hetfl.data.dataset import Dataset
from hetfl.data.views import ClientView, remap_labels, resize_images, restrict


def largest_remainder(total: int, weights: np.ndarray) -> np.ndarray:
    """Integer shares of `total` proportional to `weights`, summing exactly to `total`.

    Each share is rounded down and the units left over go to the largest remainders (ties
    to the lower index), so the shares never differ from the exact quotas by one or more.
    """
    quotas = total * weights / weights.sum()
    shares = np.floor(quotas).astype(np.int64)
    leftover = total - int(shares.sum())
    order = np.argsort(-(quotas - shares), kind="stable")
    shares[order[:leftover]] += 1
    return shares


def _allocate(total: int, weights: np.ndarray, caps: np.ndarray) -> np.ndarray:
    """Shares of `total` proportional to `weights` but at most `caps`.

    Whatever a capped entry cannot take is redistributed over the others in proportion to
    their weights, until `total` is placed or every entry with weight is full (then the
    shares sum to less than `total`).
    """
    shares = np.zeros_like(caps)
    active = (weights > 0) & (caps > 0)
    while (remaining := total - int(shares.sum())) > 0 and active.any():
        extra = largest_remainder(remaining, np.where(active, weights, 0).astype(np.float64))
        shares += np.minimum(extra, caps - shares)
        active &= shares < caps
    return shares


def local_test_indices(
    train_labels: np.ndarray, test_labels: np.ndarray, n: int, rng: np.random.Generator
) -> np.ndarray:
    """Sorted indices of `n` distinct test samples in the proportions of `train_labels`.

    Counts per class come from largest-remainder rounding of `n` times the client's class
    fractions, over the classes it holds only. A class with fewer test samples than its
    count gives all it has and the rest is spread over the client's other classes in
    proportion. If the client's classes have fewer than `n` test samples in all, every one
    of them is returned (the caller warns).
    """
    num_classes = int(max(train_labels.max(initial=0), test_labels.max(initial=0))) + 1
    weights = np.bincount(train_labels, minlength=num_classes).astype(np.float64)
    by_class = [np.flatnonzero(test_labels == c) for c in range(num_classes)]
    caps = np.array([idx.size for idx in by_class], dtype=np.int64)
    counts = _allocate(n, weights, caps)
    chosen = [
        rng.choice(by_class[c], size=int(k), replace=False) for c, k in enumerate(counts) if k
    ]
    return np.sort(np.concatenate(chosen)) if chosen else np.zeros(0, dtype=np.int64)


def validation_split(
    part: np.ndarray, labels: np.ndarray, fraction: float, rng: np.random.Generator, cid: int
) -> tuple[np.ndarray, np.ndarray]:
    """(training indices kept, sorted validation indices) of one client's training `part`.

    round(fraction * n) of its n samples (half up), clamped so that at least one is held
    out, are drawn at random from `rng`, except that one sample of each of its classes,
    also drawn at random, always stays in training: a client's label set (which sizes a
    private head, a label split or its local test split) does not change. The training
    indices keep their order in `part`. A client whose every sample is the only one of its
    class cannot hold any out, and is an error.
    """
    if not 0 < fraction < 1:
        raise ValueError(f"validation fraction must be in (0, 1), got {fraction}")
    order = rng.permutation(part.size)
    _, first_of_class = np.unique(labels[part[order]], return_index=True)
    candidates = np.delete(order, first_of_class)  # positions in `part`, in drawn order
    if candidates.size == 0:
        raise ValueError(
            f"client {cid} has {part.size} training samples, one per class it holds, and none "
            f"can be held out for data.validation = {fraction}: every class keeps one training "
            "sample; give clients more data (fewer clients) or leave data.validation unset"
        )
    wanted = int(np.floor(fraction * part.size + 0.5))
    held = candidates[: min(max(wanted, 1), candidates.size)]
    keep = np.ones(part.size, dtype=bool)
    keep[held] = False
    return part[keep], np.sort(part[held])


def _to_device(array: np.ndarray, device: torch.device | str, copy: bool = False) -> torch.Tensor:
    """One tensor over the whole array; without `copy` it shares the array's memory on the CPU.

    Cached datasets hand out read-only arrays, and torch warns that writing through a tensor
    over one is undefined. A shared tensor here is only indexed (which copies) and a copied
    one owns its memory, so the warning does not apply and is silenced.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array).to(device, copy=copy)


def build_clients(
    dataset: Dataset,
    parts: list[np.ndarray],
    test_per_client: int,
    seed: int,
    device: torch.device | str = "cpu",
    views: Sequence[ClientView] | None = None,
    validation: float | None = None,
    augment: Augmentation | None = None,
) -> list[ClientData]:
    """One `ClientData` per partition, client ids 0..len(parts)-1 in partition order.

    Client `cid`'s local test split takes `test_per_client` distinct samples of the global
    test set in its training class proportions (`local_test_indices`), drawn with the
    generator for (seed, 0, cid, "local-test"), so it does not depend on the other clients.
    Different clients may share test samples. A client whose classes have fewer than
    `test_per_client` test samples gets all of them, with a warning.

    With `views` (one per client, `hetfl.data.views`), a client keeps only the training
    samples of its view's classes (so its local test split holds only those classes too),
    its labels are remapped to 0..K-1 and its images resized to the view's size.

    With `validation` (a fraction in (0, 1)), client `cid` holds out that fraction of its
    training samples as its validation split (`validation_split`, drawn with the generator
    for (seed, 0, cid, "validation")); they leave its training data, so training never sees
    them. Its local test split is drawn from its classes before the hold-out, so adding a
    validation split leaves every test split as it was.

    Inputs stay as the dataset stores them (uint8 pixels are standardised per batch with
    `dataset.pixels`); `augment` is every client's training augmentation.
    """
    if test_per_client < 0:
        raise ValueError(f"test_per_client must be >= 0, got {test_per_client}")
    if views is not None and len(views) != len(parts):
        raise ValueError(f"{len(views)} client views for {len(parts)} clients")
    n_train = dataset.y_train.shape[0]
    for cid, part in enumerate(parts):
        if part.size == 0:
            raise ValueError(f"client {cid} has no training samples")
        if part.min() < 0 or part.max() >= n_train:
            raise ValueError(
                f"client {cid}'s indices reach {int(part.max())}, outside the training set "
                f"of {n_train} samples"
            )
    x_train = _to_device(dataset.x_train, device)  # (N, *input_shape), converted once
    y_train = _to_device(dataset.y_train, device)
    x_test = _to_device(dataset.x_test, device)
    y_test = _to_device(dataset.y_test, device)
    clients, short = [], []
    for cid, part in enumerate(parts):
        view = None if views is None else views[cid]
        if view is not None:
            part = restrict(part, dataset.y_train, view, cid, seed)
        if test_per_client:
            rng = numpy_generator(seed, 0, cid, "local-test")
            test_idx = local_test_indices(
                dataset.y_train[part], dataset.y_test, test_per_client, rng
            )
        else:
            test_idx = np.zeros(0, dtype=np.int64)
        if test_idx.size < test_per_client:
            short.append(f"client {cid} ({test_idx.size})")
        val_t = None
        if validation is not None:
            rng = numpy_generator(seed, 0, cid, "validation")
            part, val_idx = validation_split(part, dataset.y_train, validation, rng, cid)
            val_t = torch.from_numpy(val_idx).to(device)
        train_t = torch.from_numpy(part.astype(np.int64)).to(device)
        test_t = torch.from_numpy(test_idx).to(device)
        client = ClientData(
            cid=cid,
            x_train=x_train[train_t],
            y_train=y_train[train_t],
            x_test=x_test[test_t],
            y_test=y_test[test_t],
            num_classes=dataset.num_classes,
            x_val=None if val_t is None else x_train[val_t],
            y_val=None if val_t is None else y_train[val_t],
            pixels=dataset.pixels,
            augment=augment,
        )
        clients.append(client if view is None else _seen_through(client, view))
    if short:
        warnings.warn(
            f"{len(short)} clients hold classes with fewer than test_per_client = "
            f"{test_per_client} test samples and got all there were: {', '.join(short)}",
            stacklevel=2,
        )
    return clients


def _seen_through(client: ClientData, view: ClientView) -> ClientData:
    """The client's data as its view shows it: resized images, remapped labels."""
    return ClientData(
        cid=client.cid,
        x_train=resize_images(client.x_train, view.size),
        y_train=remap_labels(client.y_train, view.classes),
        x_test=resize_images(client.x_test, view.size),
        y_test=remap_labels(client.y_test, view.classes),
        num_classes=client.num_classes if view.classes is None else len(view.classes),
        x_val=None if client.x_val is None else resize_images(client.x_val, view.size),
        y_val=None if client.y_val is None else remap_labels(client.y_val, view.classes),
        pixels=client.pixels,
        augment=client.augment,
    )


def global_test(
    dataset: Dataset,
    device: torch.device | str = "cpu",
    samples: int | None = None,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The test set as (x, y) tensors on the device, for the global model's accuracy.

    `samples` keeps a fixed subsample, drawn from the run's seed and in the original order,
    for runs where evaluating many sub-models on the whole test set costs more than
    training (the same images every round, so curves stay comparable).
    """
    x, y = dataset.x_test, dataset.y_test
    if samples is not None:
        if samples < 1:
            raise ValueError(f"test samples must be >= 1, got {samples}")
        if samples < len(y):
            drawn = numpy_generator(seed, 0, SERVER, "test-subsample").permutation(len(y))
            keep = np.sort(drawn[:samples])
            x, y = x[keep], y[keep]
    return _to_device(x, device, copy=True), _to_device(y, device, copy=True)
