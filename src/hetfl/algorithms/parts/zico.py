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
"""

from __future__ import annotations

import math
from collections.abc import Sequence

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
    grads: dict[str, list[torch.Tensor]] = {n: [] for n in params}
    for x, y in batches:
        for p in params.values():
            p.grad = None
        nn.functional.cross_entropy(model(x), y).backward()
        for name, p in params.items():
            g = torch.zeros_like(p) if p.grad is None else p.grad
            grads[name].append(g.detach().reshape(-1).to(torch.float64))
    score = 0.0
    for stacked in (torch.stack(g) for g in grads.values()):  # (B, entries)
        spread = stacked.std(dim=0, correction=0)
        varying = spread > 0
        total = float((stacked.abs().mean(dim=0)[varying] / spread[varying]).sum())
        if total > 0:
            score += math.log(total)
    for p in params.values():
        p.grad = None
    return score
