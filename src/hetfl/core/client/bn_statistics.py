"""BatchNorm running statistics re-estimated from data: HeteroFL's static BN statistics pass
(Diao et al., ICLR 2021, §3, "sBN"; the authors' `stats`), as sums a parallel or federated
caller can add across parts of the data before dividing once.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from hetfl.core.pixels import PixelNorm, model_inputs

#: Per BatchNorm layer (by module name): (sum of per-batch means, sum of per-batch unbiased
#: variances, number of batches), the sufficient statistics of a static-BN pass.
BNStatistics = dict[str, tuple[torch.Tensor, torch.Tensor, int]]


def _batch_norms(model: nn.Module) -> dict[str, nn.modules.batchnorm._BatchNorm]:
    return {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
    }


def has_batch_norm(model: nn.Module) -> bool:
    """Whether `model` has BatchNorm layers, whose running statistics a pass re-estimates."""
    return bool(_batch_norms(model))


def _running_stats(
    m: nn.modules.batchnorm._BatchNorm,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(running_mean, running_var, num_batches_tracked) of `m`; the callers need a layer that
    tracks running statistics (PyTorch types them Optional for layers that do not)."""
    return (
        cast(torch.Tensor, m.running_mean),
        cast(torch.Tensor, m.running_var),
        cast(torch.Tensor, m.num_batches_tracked),
    )


def bn_batch_statistics(
    model: nn.Module, x: torch.Tensor, batch_size: int = 500, pixels: PixelNorm | None = None
) -> BNStatistics:
    """Sum each BatchNorm layer's per-batch statistics over one pass of `x` in train mode.

    Batches are consecutive slices of `x`. For each batch the layer's running statistics are
    reset and updated once with momentum None, so PyTorch's own kernel gives that batch's
    mean and unbiased variance, which are summed. Parts of one data set (clients' data) are
    combined by adding their sums (`apply_bn_statistics` divides). Stored pixels are
    standardised batch by batch with `pixels`. Normalisation in train
    mode uses batch statistics, so the resets do not change any layer's input. The model's
    momenta are restored and its running statistics are left as the last batch's.
    """
    norms = _batch_norms(model)
    saved = {k: m.momentum for k, m in norms.items()}
    sums = {k: [torch.zeros_like(s) for s in _running_stats(m)[:2]] for k, m in norms.items()}
    batches = 0
    model.train()
    with torch.no_grad():
        for start in range(0, int(x.shape[0]), batch_size):
            for m in norms.values():
                m.reset_running_stats()
                m.momentum = None
            model(model_inputs(x[start : start + batch_size], pixels))
            batches += 1
            for k, m in norms.items():
                mean, var, _ = _running_stats(m)
                sums[k][0] += mean
                sums[k][1] += var
    for k, m in norms.items():
        m.momentum = saved[k]
    return {k: (mean, var, batches) for k, (mean, var) in sums.items()}


@torch.no_grad()
def apply_bn_statistics(model: nn.Module, stats: BNStatistics) -> None:
    """Set each BatchNorm layer's running statistics to the cumulative average of `stats`
    (mean of the per-batch means and of the per-batch unbiased variances, as PyTorch's
    momentum None gives); the model is left in eval mode."""
    norms = _batch_norms(model)
    if set(stats) != set(norms):
        raise ValueError(
            f"BatchNorm statistics for layers {sorted(stats)}, the model has {sorted(norms)}"
        )
    for k, m in norms.items():
        mean, var, n = stats[k]
        if n < 1:
            raise ValueError(f"no batches for BatchNorm layer {k!r}")
        running_mean, running_var, tracked = _running_stats(m)
        running_mean.copy_(mean / n)
        running_var.copy_(var / n)
        tracked.fill_(n)
    model.eval()


def recompute_bn_statistics(
    model: nn.Module, x: torch.Tensor, batch_size: int = 500, pixels: PixelNorm | None = None
) -> None:
    """Re-estimate BatchNorm running statistics by one pass over `x` (HeteroFL's static BN).

    As HeteroFL's code does it: statistics are reset and accumulated with momentum None,
    PyTorch's cumulative average, so the running mean is the mean of the per-batch means and
    the running variance the mean of the per-batch unbiased variances (equal to the exact
    statistics of `x` only when it is one batch). Batches are consecutive slices of `x`, so
    the result is deterministic; the model is left in eval mode. It is
    `bn_batch_statistics` then `apply_bn_statistics`, which the Flower adapter splits
    between clients and server.
    """
    apply_bn_statistics(model, bn_batch_statistics(model, x, batch_size, pixels))
