"""Dropout whose masks come from an explicit generator.

`nn.Dropout` draws its masks from PyTorch's global RNG, which HetFL code never uses: a
round's result must not depend on the order clients run in or on where a run resumed
(`hetfl.core.rng`). A model that needs dropout uses `SeededDropout` instead. Models are
built once per spec and shared by every client a program runs, so the generator is not
the model's: the client program hands one to every `SeededDropout` of the model for the
length of a task (`dropout_masks`), a generator of its own purpose per (seed, round,
client). Each forward in training mode draws a fresh mask from it, so the masks follow
the modules' order in the forward pass; evaluation mode draws nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


class SeededDropout(nn.Module):
    """Inverted dropout (PyTorch's: each element zeroed with probability `p`, the others
    scaled by 1 / (1 - p)) with masks drawn from `generator`, which `dropout_masks` sets.

    Training without a generator is an error rather than a draw from the global RNG."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        if not 0 <= p < 1:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p = p
        self.generator: torch.Generator | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        if self.generator is None:
            raise RuntimeError(
                "SeededDropout in training mode needs a generator: run the model inside "
                "hetfl.core.client.dropout.dropout_masks(model, generator), as ClientProgram.fit "
                "does"
            )
        keep = torch.empty_like(x).bernoulli_(1 - self.p, generator=self.generator)
        return x * keep / (1 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}"


@contextmanager
def dropout_masks(model: nn.Module, generator: torch.Generator) -> Iterator[None]:
    """Every `SeededDropout` of `model` draws its masks from `generator` inside the block,
    and has none after it (a later task must hand its own)."""
    layers = [m for m in model.modules() if isinstance(m, SeededDropout)]
    for m in layers:
        m.generator = generator
    try:
        yield
    finally:
        for m in layers:
            m.generator = None
