"""Plain (fixed-architecture) models: the small CNN of the default job, LeNet-5, an MLP, a
linear (softmax) classifier, VGG-11 (`hetfl.models.vgg`) and LEAF's character LSTM
(`hetfl.models.char`).

Each model marks its classifier as `self.head`, so private-head options (FedPer) can find
it by structure rather than by parameter names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from hetfl.models.base import MODELS, ModelBuilder
from hetfl.models.char import CharLSTM
from hetfl.models.vgg import VGG11


def _flat(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


class SmallCNN(nn.Module):
    """conv 1->16 and 16->32 (3x3, padding 1, ReLU, 2x2 max-pool), linear to the classes.

    On 28x28 Fashion-MNIST: 20,490 parameters (the workload of the speed benchmark).
    """

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        c, h, w = input_shape
        self.features = nn.Sequential(
            nn.Conv2d(c, 16, 3, padding=1),  # (B, 16, H, W)
            nn.ReLU(),
            nn.MaxPool2d(2),  # (B, 16, H/2, W/2)
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # (B, 32, H/4, W/4)
        )
        self.head = nn.Linear(32 * (h // 4) * (w // 4), num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


class LeNet5(nn.Module):
    """LeNet-5 as FedALRC uses it: conv 6@5x5 (padded to keep 28x28), pool, conv 16@5x5,
    pool, fully connected 120 and 84, head."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        c, h, w = input_shape
        self.features = nn.Sequential(
            nn.Conv2d(c, 6, 5, padding=2),  # (B, 6, H, W)
            nn.ReLU(),
            nn.MaxPool2d(2),  # (B, 6, H/2, W/2)
            nn.Conv2d(6, 16, 5),  # (B, 16, H/2-4, W/2-4)
            nn.ReLU(),
            nn.MaxPool2d(2),  # (B, 16, (H/2-4)/2, (W/2-4)/2)
        )
        side_h, side_w = (h // 2 - 4) // 2, (w // 2 - 4) // 2
        self.body = nn.Sequential(
            nn.Linear(16 * side_h * side_w, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU()
        )
        self.head = nn.Linear(84, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.features(x).flatten(1)))


class MLP(nn.Module):
    """Two hidden layers of 200 units with ReLU, on flattened inputs."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, hidden: int = 200) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Flatten(),
            nn.Linear(_flat(input_shape), hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
        )
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class Linear(nn.Module):
    """A linear (multinomial logistic) classifier on flattened inputs: one weight matrix of
    shape (C, D) and a bias. FedALRC's shallow model (Algorithm 1): its singular-value
    thresholding acts on `head.weight`, found as the model's only `nn.Linear`."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        self.head = nn.Linear(_flat(input_shape), num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x.flatten(1))  # (B, C)


@dataclass(frozen=True)
class _Images:
    """Accepts (C, H, W) shapes with H, W >= `min_side` (a class, not a closure, so that a
    model family pickles into worker processes)."""

    min_side: int

    def __call__(self, s: tuple[int, ...]) -> bool:
        return len(s) == 3 and s[1] >= self.min_side and s[2] >= self.min_side


def _non_empty(s: tuple[int, ...]) -> bool:
    return len(s) >= 1


def _tokens(s: tuple[int, ...]) -> bool:
    return len(s) == 1 and s[0] >= 1


def _image(min_side: int) -> tuple[_Images, str]:
    return _Images(min_side), f"needs images shaped (C, H, W) with H, W >= {min_side}"


MODELS.register("small-cnn", ModelBuilder(SmallCNN, *_image(4)))
MODELS.register("lenet5", ModelBuilder(LeNet5, *_image(16)))
MODELS.register("mlp", ModelBuilder(MLP, _non_empty, "needs a non-empty input shape"))
MODELS.register("linear", ModelBuilder(Linear, _non_empty, "needs a non-empty input shape"))
MODELS.register("vgg11", ModelBuilder(VGG11, *_image(32)))
MODELS.register(
    "char-lstm", ModelBuilder(CharLSTM, _tokens, "needs token sequences shaped (T,), T >= 1")
)
