"""The static-BatchNorm statistics pass, defined once for both engines.

HeteroFL (Diao, Ding and Tarokh, "HeteroFL: Computation and Communication Efficient
Federated Learning for Heterogeneous Clients", ICLR 2021, §3 "Static Batch Normalization")
trains without running statistics and re-estimates them from the training data before it
evaluates; the authors' code (train_classifier_fed.py, `stats`) runs the whole training set
through the model in train mode with a cumulative average. HetFL's pass is the same in the
simulator and under Flower:

- each client, in client-id order, runs its training data (or its share of a subsample)
  through the model in consecutive batches of `STATS_BATCH` and sums each BatchNorm layer's
  per-batch mean and unbiased variance (`hetfl.core.client.program.bn_batch_statistics`);
- the clients' sums are added in client-id order (`add_bn_statistics`) and the running
  statistics set to their cumulative average (`hetfl.core.client.program.apply_bn_statistics`).

`samples` (the config's `eval.stats_samples`): None, the default and the papers' choice, is
every client's whole training set. An integer n is a speed option: client c's share is
n * n_c / N rounded by largest remainder (the shares sum to n), drawn without replacement
by the client's own generator (seed, 0, c, "stats-pass"), so that a Flower node draws its
share itself from the count the server sends.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from hetfl.core.client.bn_statistics import BNStatistics, bn_batch_statistics
from hetfl.core.pixels import PixelNorm
from hetfl.core.rng import torch_generator
from hetfl.data.federation import largest_remainder

#: Samples per batch of the pass (the batches are consecutive slices of a client's data).
STATS_BATCH = 500


def stats_shares(sizes: Mapping[int, int], samples: int | None) -> dict[int, int]:
    """How many training samples each client (by id, from its training size) runs through
    the model: all of them when `samples` is None or covers the clients' total, else shares
    proportional to the sizes summing to `samples` (largest remainder, ties to the lower id).
    """
    cids = sorted(sizes)
    if samples is None or samples >= sum(sizes.values()):
        return {c: sizes[c] for c in cids}
    shares = largest_remainder(samples, np.array([sizes[c] for c in cids], dtype=np.float64))
    return {c: int(s) for c, s in zip(cids, shares, strict=True)}


def client_stats_input(x_train: torch.Tensor, share: int, seed: int, cid: int) -> torch.Tensor:
    """What client `cid` runs through the model: its whole training data, in order, when
    `share` covers it; else `share` samples drawn without replacement, in the drawn order,
    by its (seed, 0, cid, "stats-pass") generator."""
    n = int(x_train.shape[0])
    if share >= n:
        return x_train
    drawn = torch.randperm(n, generator=torch_generator(seed, 0, cid, "stats-pass"))[:share]
    return x_train[drawn.to(x_train.device)]


def client_bn_statistics(
    model: nn.Module,
    x_train: torch.Tensor,
    share: int,
    seed: int,
    cid: int,
    pixels: PixelNorm | None = None,
) -> BNStatistics:
    """One client's part of the pass: per-layer sums over its batches (a Flower node's
    `query.stats` answer); stored pixels are standardised with `pixels`."""
    x = client_stats_input(x_train, share, seed, cid)
    return bn_batch_statistics(model, x, STATS_BATCH, pixels)


def bn_statistics_problem(total: BNStatistics, part: Any) -> str | None:
    """Why one client's answer cannot be added to `total` (the other clients' sums so far),
    or None: it must be {layer: [sum of means, sum of variances, batches]} over the same
    layers and shapes."""
    if not isinstance(part, dict) or not all(
        isinstance(v, list)
        and len(v) == 3
        and isinstance(v[0], torch.Tensor)
        and isinstance(v[1], torch.Tensor)
        and isinstance(v[2], int)
        for v in part.values()
    ):
        return "malformed reply: expected {layer: [sum of means, sum of variances, batches]}"
    if total and set(part) != set(total):
        return f"BatchNorm layers {sorted(part)} differ from other clients' {sorted(total)}"
    for k, (mean, var, _) in part.items():
        if k in total:
            m0, v0, _ = total[k]
            if m0.shape != mean.shape or v0.shape != var.shape:
                return f"BatchNorm layer {k!r} has other shapes than other clients'"
    return None


def add_bn_statistics(total: BNStatistics, part: Mapping[str, Any]) -> None:
    """Add one client's per-layer sums to `total` in place (the next client in id order)."""
    for k, (mean, var, n) in part.items():
        if k in total:
            m0, v0, n0 = total[k]
            total[k] = (m0 + mean, v0 + var, n0 + n)
        else:
            total[k] = (mean.clone(), var.clone(), n)
