"""ZiCo, a zero-cost proxy of how well an untrained network will train (Li et al., "ZiCo:
Zero-shot NAS via Inverse Coefficient of Variation on Gradients", ICLR 2023, the
score it defines):

    ZiCo = Σ_l log( Σ_{θ ∈ W_l, σ(θ) > 0} E_b[|g_b(θ)|] / σ_b(g_b(θ)) ),

over the weight W_l of every convolution and linear layer, where g_b(θ) is the gradient of
the loss on mini-batch b at the network's initialisation and E_b and σ_b are the mean and
the (population) standard deviation over the B batches. A layer whose sum is 0 adds
nothing. FedFA's clients rank their candidate architectures with it on their own data
(Park and Joe-Wong, "Federated Learning with Flexible Architectures", ECML-PKDD 2024, §5.1).

The gradient of each batch is taken on its own, as the paper defines g_b. The authors' code
(SLDGroup/ZiCo, `ZeroShotProxy/compute_zico.py`) never zeroes the gradients between
batches, so its b-th sample is the sum of the first b gradients; with B = 2 its spread is
|g_2| / 2 whatever g_1 is, which is not the batch-to-batch variation the paper measures.

The moments are kept as each batch's gradient arrives (`_Moments`), in float64, with the
update of PyTorch's own CPU `std` and `mean` over the stacked gradients (Welford's, one
batch after another, and the sum of the |g_b| over B), so that the score is bit for bit the
one of `torch.stack(g).std(0, correction=0)` at a small part of its cost: that kernel
reduces each entry on its own, about 40 ms per layer of a Pre-ResNet, most of a client's
set-up query. The square root is NumPy's, correctly rounded as the C++ `std::sqrt` of
that kernel is; `torch.sqrt` on CPU float64 is not (it can be one unit in the last place off).
On another device the moments are kept there and the root is taken on the CPU.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from hetfl.core.roles import layer_weight_names


def zico(model: nn.Module, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """The ZiCo score of `model` (in training mode, as it is given) over `batches` of
    (inputs, labels), with the cross-entropy loss; at least two batches."""
    if len(batches) < 2:
        raise ValueError(f"ZiCo needs at least 2 mini-batches, got {len(batches)}")
    weights = layer_weight_names(model)
    params = {n: p for n, p in model.named_parameters() if n in weights and p.requires_grad}
    moments = {n: _Moments(p) for n, p in params.items()}
    for x, y in batches:
        for p in params.values():
            p.grad = None
        nn.functional.cross_entropy(model(x), y).backward()
        for name, p in params.items():
            moments[name].add(torch.zeros_like(p) if p.grad is None else p.grad)
    score = 0.0
    for layer in moments.values():
        spread, mean_abs = layer.spread_and_mean_abs()
        varying = spread > 0
        if not bool(varying.all()):  # else every entry, in order: the same sum
            spread, mean_abs = spread[varying], mean_abs[varying]
        total = float((mean_abs / spread).sum())
        if total > 0:
            score += math.log(total)
    for p in params.values():
        p.grad = None
    return score


class _Moments:
    """The population standard deviation and the mean of |g| over the batches of one
    layer's gradient, entry by entry, updated a batch at a time in float64 as PyTorch's
    CPU kernels update them (Welford: delta = g - mean, mean += delta / n, m2 += delta *
    (g - mean), from zeros; the sum of |g| from zero), so that the two are bit for bit
    those of `std(0, correction=0)` and `abs().mean(0)` over the stacked gradients."""

    def __init__(self, param: torch.Tensor) -> None:
        self.n = 0
        self.mean, self.m2, self.abs_sum = (
            torch.zeros(param.numel(), dtype=torch.float64, device=param.device) for _ in range(3)
        )

    def add(self, grad: torch.Tensor) -> None:
        g = grad.detach().reshape(-1).to(torch.float64)
        self.n += 1
        delta = g - self.mean
        self.mean += delta / self.n
        self.m2 += delta.mul_(g - self.mean)
        self.abs_sum += g.abs()

    def spread_and_mean_abs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(σ_b, E_b|g_b|) on the CPU; a NaN spread (a NaN or infinite gradient) stays NaN."""
        variance = (self.m2 / self.n).cpu().numpy()
        with np.errstate(invalid="ignore"):
            spread = torch.from_numpy(np.sqrt(variance))
        return spread, (self.abs_sum / self.n).cpu()
