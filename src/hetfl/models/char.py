"""LEAF's Shakespeare model: next-character prediction with a two-layer LSTM.

Caldas et al., "LEAF: A Benchmark for Federated Settings" (2018), §4, and the reference
code `models/shakespeare/stacked_lstm.py`: an 8-dimensional embedding of each character,
two stacked LSTM layers of 256 units, and a linear decoder from the last step's output to
the classes. The classes are the vocabulary (the label is the next character), so the
embedding has one row per class.

Inputs are int64 token codes (B, T); the model declares `input_dtype` so that the cost
model (`hetfl.systems.costs`) prices it on tokens rather than on float zeros.
"""

from __future__ import annotations

import math

import torch
from torch import nn

EMBEDDING = 8
HIDDEN = 256
LAYERS = 2


class SeededEmbedding(nn.Embedding):
    """`nn.Embedding` whose default initialisation, N(0, 1), draws from a given generator
    (`hetfl.core.init`)."""

    def reset_parameters_with(self, generator: torch.Generator) -> None:
        self.weight.normal_(generator=generator)


class LastStepLSTM(nn.LSTM):
    """A batch-first `nn.LSTM` that returns the last step's output of its top layer, so the
    model is a pipeline of modules each taking the previous one's tensor; initialised as
    PyTorch does, every weight and bias U(-1/sqrt(hidden), 1/sqrt(hidden)), from a given
    generator."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x)[0][:, -1]  # (B, T, H) -> (B, H)

    def reset_parameters_with(self, generator: torch.Generator) -> None:
        bound = 1.0 / math.sqrt(self.hidden_size)
        for weight in self.parameters():
            weight.uniform_(-bound, bound, generator=generator)


class CharLSTM(nn.Module):
    """embedding 8 -> LSTM 256 -> LSTM 256 -> linear over the last step; (B, T) int64 codes
    in, (B, num_classes) logits out. 819,920 parameters for 80 characters."""

    input_dtype = torch.int64

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        self.embed = SeededEmbedding(num_classes, EMBEDDING)  # (B, T, 8)
        self.rnn = LastStepLSTM(EMBEDDING, HIDDEN, num_layers=LAYERS, batch_first=True)
        self.head = nn.Linear(HIDDEN, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.embed(x)))
