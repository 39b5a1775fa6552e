"""Scoring a model on labelled data: correct predictions and summed loss, batch by batch.

Losses are summed in batch order, so an executor that scores batches elsewhere and adds
their sums in the same order gets the same total (`EVAL_BATCH` is its unit of global
evaluation). Logits of classes outside a client's label mask are zeroed wherever training
masks them (HeteroFL's label split).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hetfl.core.client.terms import mask_logits
from hetfl.core.pixels import PixelNorm, model_inputs

#: Samples per batch of an evaluation; a parallel executor's unit of global evaluation.
EVAL_BATCH = 1000


@torch.no_grad()
def score_batch_of(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, label_mask: tuple[int, ...] | None = None
) -> tuple[int, float]:
    """(correct, summed loss) of `model` on one batch, in eval mode, with the logits of
    classes outside `label_mask` zeroed when it is given."""
    model.eval()
    out = mask_logits(model(x), label_mask)
    return int((out.argmax(dim=1) == y).sum()), float(F.cross_entropy(out, y, reduction="sum"))


def evaluate_model(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    batch_size: int = EVAL_BATCH,
    label_mask: tuple[int, ...] | None = None,
    pixels: PixelNorm | None = None,
) -> tuple[int, float, int]:
    """(correct, summed loss, count) of `model` on (x, y) in consecutive batches, the
    losses added in batch order (a parallel executor adds its batches' the same way); each
    batch standardised by `pixels` when the inputs are stored pixels."""
    correct, loss_sum = 0, 0.0
    for start in range(0, int(y.shape[0]), batch_size):
        batch = model_inputs(x[start : start + batch_size], pixels)
        c, loss = score_batch_of(model, batch, y[start : start + batch_size], label_mask)
        correct += c
        loss_sum += loss
    return correct, loss_sum, int(y.shape[0])
