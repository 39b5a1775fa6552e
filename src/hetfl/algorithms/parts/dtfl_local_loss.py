"""The client's half of local-loss split learning: send each batch's activations, learn
from a head of its own.

DTFL ("Speed up Federated Learning in Heterogeneous Environment: A Dynamic Tiering
Approach", §3.2, Algorithm 1 lines 15-19; the authors' code, `main.py`, `Client.train`):
per batch the client runs its modules md1..md_m, hands the activations z and the labels to
the server (`ctx.send`: a detached copy, counted, never collected into one payload) without
waiting for an answer, and updates its modules and its auxiliary head on the head's
cross-entropy alone. The server trains its own copy on z meanwhile
(`hetfl.algorithms.parts.server_copies`).

`LocalLoss` is that step as a recipe's forward part: its model is a client side with a head
that returns `(z, logits)` when called with `activations=True` (`hetfl.models.resnet_cifar`).
Its options are DTFL's privacy measures (§4.2, Table 5; `hetfl.core.client.privacy`):
`alpha` > 0 trains on (1 - alpha) CE + alpha DCor(x, z) per batch (`LocalLoss.dcor`, a loss
term, adds the second part), and `patch` shuffles the patches of what is sent, one order
per batch from a generator of the client's own (the client's round generator's sibling
"patch-shuffle"); its head still sees z in order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hetfl.core.client.privacy import distance_correlation, shuffle_patches
from hetfl.core.client.recipe import ModelCall, TrainContext
from hetfl.core.rng import sibling_generator


@dataclass(frozen=True)
class LocalLoss:
    """The forward part (outputs: the head's logits (B, C); per-sample loss: (1 - alpha)
    times their cross-entropy) and, through `dcor`, the loss term alpha DCor(x, z)."""

    alpha: float = 0.0
    patch: int | None = None

    def __post_init__(self) -> None:
        if not (0 <= self.alpha < 1 and math.isfinite(self.alpha)):
            raise ValueError(f"dcor_alpha must be in [0, 1), got {self.alpha!r}")
        if self.patch is not None and self.patch < 1:
            raise ValueError(f"patch_size must be >= 1 when set, got {self.patch!r}")

    def __call__(
        self, model: ModelCall, x: torch.Tensor, y: torch.Tensor, ctx: TrainContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        z, logits = model(x, activations=True)  # (B, C_m, H_m, W_m), (B, classes)
        sent = z
        if self.patch is not None:
            scratch = ctx.scratch(self)
            if "shuffle" not in scratch:
                scratch["shuffle"] = sibling_generator(ctx.generator, "patch-shuffle")
            sent = shuffle_patches(z.detach(), self.patch, scratch["shuffle"])
        ctx.send(sent, y)  # no answer comes: the client does not wait
        per_sample = F.cross_entropy(logits, y, reduction="none")
        if self.alpha == 0:
            return logits, per_sample
        ctx.scratch(self)["z"] = z
        return logits, (1 - self.alpha) * per_sample

    def dcor(
        self, outputs: torch.Tensor, y: torch.Tensor, per_sample: torch.Tensor, ctx: TrainContext
    ) -> torch.Tensor | None:
        """The loss term alpha DCor(x, z) of the batch (None with alpha 0)."""
        if self.alpha == 0:
            return None
        if ctx.batch is None:
            raise RuntimeError("LocalLoss.dcor runs inside the training loop, after its forward")
        z = ctx.scratch(self).pop("z")
        return self.alpha * distance_correlation(ctx.batch[0], z)
