"""Coverage-aware Krum scores: each client judged against the clients that cover the same
elements, on those elements only.

Krum over heterogeneous sub-models (`hetfl.core.server.defences`, the naive baseline)
measures two clients over the elements both cover, as a mean squared difference: a pair of
wide clients is measured over elements a pair of narrow ones never shares, whose spread can
differ (wider layers start smaller), so the score picks clients by width, not behaviour.
Here the global elements are split into *cells*, the elements covered by exactly the same
set of the round's clients (HeteroFL's width levels give one cell per level's ring of
channels; a label split or FedFA's grafting more). Within a cell every client is measured
on the same elements, and Blanchard et al.'s score ("Machine Learning with Adversaries:
Byzantine Tolerant Gradient Descent", NeurIPS 2017, §4: the sum of squared distances to the
k − f − 2 nearest of the cell's k clients) compares like with like. A cell's scores are
divided by their median (the mean of the two middle ones for an even k), so that each cell
weighs a client's outlyingness, not its own scale; a client's score is the mean of its
normalised cell scores weighted by the cells' element counts. A cell of k <= 2f + 2 clients
cannot be judged (Krum's condition) and counts for no one; a client judged in no cell
scores +inf (kept last). Where a cell's median score is 0 (its clients mostly agree
exactly), a positive score there is +inf: outlying from an exact consensus.
"""

from __future__ import annotations

import math

import torch

from hetfl.core.server.defences import krum_scores
from hetfl.core.server.robust import HeldClients


def _flat(held: HeldClients) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, E) float64 values and (n, E) coverage over every global element any client
    holds (an element a client lacks the tensor of is uncovered for it)."""
    names = sorted({name for values in held.values for name in values})
    values, covered = [], []
    for i in range(len(held)):
        row_v, row_c = [], []
        for name in names:
            like = held.like[name]
            if name in held.values[i]:
                row_v.append(held.values[i][name].reshape(-1))
                row_c.append(held.covered[i][name].reshape(-1))
            else:
                row_v.append(torch.zeros(like.numel(), dtype=torch.float64, device=like.device))
                row_c.append(torch.zeros(like.numel(), dtype=torch.bool, device=like.device))
        values.append(torch.cat(row_v))
        covered.append(torch.cat(row_c))
    return torch.stack(values), torch.stack(covered)


def _squared_distances(x: torch.Tensor) -> torch.Tensor:
    """(k, k): the summed squared differences of the rows of `x`, one pair at a time (a
    (k, k, e) difference tensor would hold k² copies of a cell)."""
    k = x.shape[0]
    dist = torch.zeros(k, k, dtype=torch.float64)
    for i in range(k):
        for j in range(i + 1, k):
            diff = x[i] - x[j]
            dist[i, j] = dist[j, i] = float((diff * diff).sum())
    return dist


def _median(x: torch.Tensor) -> float:
    ordered = torch.sort(x).values
    k = ordered.shape[0]
    return float((ordered[(k - 1) // 2] + ordered[k // 2]) / 2)


def cell_scores(held: HeldClients, f: int) -> torch.Tensor:
    """(n,) float64: each client's Krum score over the cells it covers (module docstring)."""
    n = len(held)
    values, covered = _flat(held)
    cells, inverse = torch.unique(covered.T, dim=0, return_inverse=True)  # (C, n) member masks
    total = torch.zeros(n, dtype=torch.float64)
    size = torch.zeros(n, dtype=torch.float64)
    for c, members in enumerate(cells):
        who = members.nonzero().flatten()
        k = int(who.numel())
        if k <= 2 * f + 2:
            continue
        x = values[who][:, inverse == c]  # (k, e): the cell's elements of its k clients
        e = x.shape[1]
        scores = krum_scores(_squared_distances(x), f)
        scale = _median(scores)
        normalised = scores / scale if scale > 0 else torch.where(scores > 0, math.inf, 0.0)
        total[who] += e * normalised
        size[who] += e
    return torch.where(size > 0, total / size.clamp(min=1), math.inf)
