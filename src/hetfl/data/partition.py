"""Partitioners: how a training set is dealt out to clients.

Every partitioner has the signature `(labels, num_clients, rng, *, groups, **options)` and
returns one sorted int64 index array per client. `groups` is the owner id of each sample
(LEAF's writers and speakers, `Dataset.train_groups`) or None for data without owners; only
`natural` uses it, the others ignore it. Unless its docstring says otherwise the arrays are
disjoint and together cover every sample. All randomness comes from the `rng` passed in, so
a partition is a pure function of the labels, the groups, the options and the generator's
seed.
Impossible settings raise `PartitionError`, whose message names the numbers involved and
what to change.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, get_args

import numpy as np

from hetfl.core.registry import Registry
from hetfl.data.dataset import OWNED_DATASETS

Partitioner = Callable[..., list[np.ndarray]]

PARTITIONERS = Registry[Partitioner]("partitioner")


class PartitionError(ValueError):
    """A partition that cannot be made with the given settings."""


def _check(labels: np.ndarray, num_clients: int) -> int:
    """Validate the arguments every partitioner shares; return the number of samples."""
    if labels.ndim != 1 or labels.dtype.kind not in "iu":
        raise PartitionError(
            f"labels must be a 1-d integer array, got {labels.dtype} of shape {labels.shape}"
        )
    n = int(labels.shape[0])
    if num_clients < 1:
        raise PartitionError(f"num_clients must be at least 1, got {num_clients}")
    if num_clients > n:
        raise PartitionError(
            f"more clients than samples: num_clients = {num_clients} but the training set "
            f"has {n} samples"
        )
    return n


def _finish(parts: list[np.ndarray]) -> list[np.ndarray]:
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


#: How `iid` sizes its clients.
IID_SIZES = ("equal", "half-to-full")


@PARTITIONERS.decorator("iid")
def iid(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    sizes: str = "equal",
    *,
    groups: np.ndarray | None = None,
) -> list[np.ndarray]:
    """A random permutation cut into `num_clients` pieces.

    `sizes="equal"`: sizes that differ by at most one. `sizes="half-to-full"`: FedFA's IID
    setting (Park and Joe-Wong, "Federated Learning with Flexible Architectures", ECML-PKDD
    2024, §5.1: every client holds every class, and the smallest client holds at least half
    as many samples as the largest): each client draws a weight uniformly in [1/2, 1], and
    the permutation is cut at the cumulative weights' share of the n samples, so every size
    is n * u_i / sum(u) up to one sample: between 1/2 and 1 times the largest's. The weights
    are drawn before the permutation, both from `rng`.
    """
    n = _check(labels, num_clients)
    if sizes == "equal":
        return _finish(np.array_split(rng.permutation(n), num_clients))
    if sizes != "half-to-full":
        raise PartitionError(
            f"iid partition: sizes must be one of {', '.join(IID_SIZES)}, got {sizes!r}"
        )
    weights = rng.uniform(0.5, 1.0, size=num_clients)
    cuts = np.floor(np.cumsum(weights)[:-1] / weights.sum() * n).astype(np.int64)
    if np.diff(np.concatenate([[0], cuts, [n]])).min() < 1:
        raise PartitionError(
            f"iid partition with sizes half-to-full left a client without samples "
            f"({num_clients} clients, {n} samples); use fewer clients"
        )
    return _finish(np.split(rng.permutation(n), cuts))


def _check_min_size(kind: str, n: int, num_clients: int, alpha: float, min_size: int) -> None:
    if alpha <= 0:
        raise PartitionError(f"{kind} partition needs alpha > 0, got alpha = {alpha}")
    if min_size < 0:
        raise PartitionError(f"{kind} partition needs min_size >= 0, got min_size = {min_size}")
    if num_clients * min_size > n:
        raise PartitionError(
            f"{kind} partition cannot give {num_clients} clients min_size = {min_size} samples "
            f"each from {n} samples; use fewer clients or a smaller min_size"
        )


def _retry_failed(
    kind: str, alpha: float, min_size: int, num_clients: int, n: int, tries: int, smallest: int
) -> PartitionError:
    return PartitionError(
        f"{kind} partition failed: in {tries} draws with alpha = {alpha}, some client always "
        f"got fewer than min_size = {min_size} samples (num_clients = {num_clients}, "
        f"{n} samples; best draw's smallest client had {smallest}); use a larger alpha, "
        "a smaller min_size or fewer clients"
    )


@PARTITIONERS.decorator("dirichlet")
def dirichlet(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    alpha: float,
    min_size: int = 10,
    max_retries: int = 100,
    *,
    groups: np.ndarray | None = None,
) -> list[np.ndarray]:
    """Dirichlet(alpha) label skew in the form of FedMA (Wang et al., "Federated Learning
    with Matched Averaging", ICLR 2020) and FedML's loader, which FedALRC (§V-A) and DTFL
    (§4.1, authors' code `api/data_preprocessing/cifar10/data_loader.py`) use.

    For each class in turn: shuffle its samples, draw client proportions from
    Dirichlet(alpha * 1), zero the proportion of every client that already holds at least
    N / num_clients samples (so no client grows far past an equal share), renormalise, and
    cut the shuffled samples at the cumulative proportions. The whole draw is repeated until
    every client has at least `min_size` samples, at most `max_retries` times. Small alpha
    gives each client few classes; large alpha approaches IID.

    If every client still below N / num_clients drew a proportion of exactly zero (possible
    only for tiny alpha), the class is shared equally among those clients instead of
    dividing by zero.
    """
    n = _check(labels, num_clients)
    _check_min_size("dirichlet", n, num_clients, alpha, min_size)
    if max_retries < 1:
        raise PartitionError(f"max_retries must be at least 1, got {max_retries}")
    by_class = [np.flatnonzero(labels == c) for c in np.unique(labels)]
    smallest = -1
    for _ in range(max_retries):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        sizes = np.zeros(num_clients, dtype=np.int64)
        for members in by_class:
            idx = rng.permutation(members)
            p = rng.dirichlet(np.full(num_clients, alpha))
            below = sizes < n / num_clients
            p = p * below
            p = p / p.sum() if p.sum() > 0 else below / below.sum()
            cuts = (np.cumsum(p) * idx.size).astype(np.int64)[:-1]
            for client, piece in enumerate(np.split(idx, cuts)):
                parts[client].append(piece)
                sizes[client] += piece.size
        smallest = max(smallest, int(sizes.min()))
        if sizes.min() >= min_size:
            return _finish([np.concatenate(p) for p in parts])
    raise _retry_failed("dirichlet", alpha, min_size, num_clients, n, max_retries, smallest)


#: How the `classes` partition deals classes to clients (`k_classes`).
Deal = Literal["round-robin", "least-used"]
DEALS: tuple[str, ...] = get_args(Deal)


def _deal_round_robin(
    classes: np.ndarray, num_clients: int, k: int, rng: np.random.Generator
) -> list[list[int]]:
    """Classes shuffled once, then dealt in turn: client i holds order[(i * k + j) mod C]."""
    order = rng.permutation(classes)
    return [[int(order[(i * k + j) % classes.size]) for j in range(k)] for i in range(num_clients)]


def _deal_least_used(
    classes: np.ndarray, num_clients: int, k: int, rng: np.random.Generator
) -> list[list[int]]:
    """Clients in id order each draw their k classes one at a time, uniformly among the
    classes dealt least often so far that they do not hold yet: the rule of FLANC's code
    (HarukiYqM/All-In-One-Neural-Composition, `data/fashion-mnist.py: partition_data`,
    a draw among the classes with the most unused slots), which can also give one client
    a class twice; here a client's k classes are distinct. Usage counts never differ by
    more than one, so every class has num_clients * k / C holders when that divides."""
    used = np.zeros(classes.size, dtype=np.int64)
    held = []
    for _ in range(num_clients):
        mine: list[int] = []
        for _ in range(k):
            free = np.ones(classes.size, dtype=bool)
            free[mine] = False
            least = np.flatnonzero(free & (used == used[free].min()))
            pick = int(rng.choice(least))
            mine.append(pick)
            used[pick] += 1
        held.append([int(classes[i]) for i in mine])
    return held


_DEALERS = {"round-robin": _deal_round_robin, "least-used": _deal_least_used}


@PARTITIONERS.decorator("classes")
def k_classes(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    k: int,
    deal: str = "round-robin",
    *,
    groups: np.ndarray | None = None,
) -> list[np.ndarray]:
    """Each client holds exactly `k` classes (the shards of HeteroFL, FedFA and FLANC).

    `deal` says which: `round-robin` shuffles the classes, then client i holds classes
    order[(i * k + j) mod C] for j < k (so at most C distinct sets of classes);
    `least-used` draws each client's classes among those dealt least often so far
    (`_deal_least_used`, FLANC's code). Each class's shuffled samples are split equally
    among the clients that hold it. Not a cover of the training set: the `n_c mod h_c`
    samples left over when class c's n_c samples do not divide among its h_c holders are
    dropped, as is every sample of a class no client holds (when num_clients * k < C).
    """
    _check(labels, num_clients)
    classes = np.unique(labels)
    if not 1 <= k <= classes.size:
        raise PartitionError(
            f"classes partition needs 1 <= k <= {classes.size} (the number of classes), got k = {k}"
        )
    if deal not in _DEALERS:
        raise PartitionError(
            f"classes partition: deal must be one of {', '.join(DEALS)}, got {deal!r}"
        )
    held = _DEALERS[deal](classes, num_clients, k, rng)
    holders: dict[int, list[int]] = {int(c): [] for c in classes}
    for client, cls in enumerate(held):
        for c in cls:
            holders[c].append(client)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c in classes:  # a fixed class order, so the draws do not depend on dict order
        owners = holders[int(c)]
        if not owners:
            continue
        idx = rng.permutation(np.flatnonzero(labels == c))
        share = idx.size // len(owners)
        if share == 0:
            raise PartitionError(
                f"classes partition: class {int(c)} has {idx.size} samples for {len(owners)} "
                f"clients that hold it, so some would get none; use fewer clients or a "
                "smaller k"
            )
        for j, client in enumerate(owners):
            parts[client].append(idx[j * share : (j + 1) * share])
    return _finish([np.concatenate(p) for p in parts])


@PARTITIONERS.decorator("quantity")
def quantity_skew(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    alpha: float = 1.0,
    min_size: int = 10,
    max_retries: int = 100,
    *,
    groups: np.ndarray | None = None,
) -> list[np.ndarray]:
    """IID labels with client sizes proportional to Dirichlet(alpha * 1) proportions.

    The NIID-Bench form: the proportions are redrawn until every client gets at least
    `min_size` samples, at most `max_retries` times; then a random permutation is cut at
    the cumulative proportions. Smaller alpha gives more unequal sizes.
    """
    n = _check(labels, num_clients)
    _check_min_size("quantity", n, num_clients, alpha, min_size)
    if max_retries < 1:
        raise PartitionError(f"max_retries must be at least 1, got {max_retries}")
    smallest = -1
    for _ in range(max_retries):
        p = rng.dirichlet(np.full(num_clients, alpha))
        cuts = (np.cumsum(p) * n).astype(np.int64)[:-1]
        sizes = np.diff(np.concatenate([[0], cuts, [n]]))
        smallest = max(smallest, int(sizes.min()))
        if sizes.min() >= min_size:
            return _finish(np.split(rng.permutation(n), cuts))
    raise _retry_failed("quantity", alpha, min_size, num_clients, n, max_retries, smallest)


@PARTITIONERS.decorator("natural")
def natural(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    *,
    groups: np.ndarray | None = None,
) -> list[np.ndarray]:
    """Each client holds all samples of one owner: LEAF's setting, one writer (FEMNIST) or
    speaker (Shakespeare) per device (Caldas et al., "LEAF: A Benchmark for Federated
    Settings", 2018, §3).

    With fewer clients than owners, the owners are a seeded sample (`rng.choice` without
    replacement), dealt to clients in ascending owner id. A sample rather than the first N
    ids because ids are not in random order: Shakespeare's are `<play>_<character>`, so the
    first N sorted ids are the characters of a few plays. Not a cover of the training set
    when num_clients is below the number of owners: the others' samples are unused. With as
    many clients as owners, client i holds owner i (in sorted id order).
    """
    _check(labels, num_clients)
    if groups is None:
        raise PartitionError(
            "natural partition needs the owner of each sample (writers, speakers), and this "
            f"dataset has none; datasets with owners: {', '.join(OWNED_DATASETS)}"
        )
    if groups.shape != labels.shape:
        raise PartitionError(
            f"natural partition needs one owner per sample: {labels.shape[0]} labels but "
            f"groups of shape {groups.shape}"
        )
    owners = np.unique(groups)
    if num_clients > owners.size:
        raise PartitionError(
            f"natural partition gives each client one owner: num_clients = {num_clients} but "
            f"the training set has {owners.size} owners; use at most {owners.size} clients"
        )
    chosen = np.sort(rng.choice(owners.size, size=num_clients, replace=False))
    order = np.argsort(groups, kind="stable")
    bounds = np.searchsorted(groups[order], owners)
    ends = np.append(bounds[1:], order.size)
    return _finish([order[bounds[i] : ends[i]] for i in chosen])


def class_counts(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> np.ndarray:
    """A (clients, classes) int64 table of how many samples of each class each client has."""
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(
            f"labels must lie in 0..{num_classes - 1}, found {labels.min()}..{labels.max()}"
        )
    counts = np.zeros((len(parts), num_classes), dtype=np.int64)
    for i, p in enumerate(parts):
        counts[i] = np.bincount(labels[p], minlength=num_classes)
    return counts


def format_class_table(counts: np.ndarray) -> str:
    """`class_counts` as plain text: a header of class ids, one row per client, a total
    column and a total row; for logs and for eyeballing how skewed a partition is."""
    counts = np.asarray(counts, dtype=np.int64)
    header = ["client", *(str(c) for c in range(counts.shape[1])), "total"]
    rows = [[str(i), *(str(v) for v in row), str(row.sum())] for i, row in enumerate(counts)]
    rows.append(["total", *(str(v) for v in counts.sum(axis=0)), str(counts.sum())])
    widths = [max(len(r[j]) for r in [header, *rows]) for j in range(len(header))]
    return "\n".join(
        "  ".join(cell.rjust(w) for cell, w in zip(r, widths, strict=True)) for r in [header, *rows]
    )
