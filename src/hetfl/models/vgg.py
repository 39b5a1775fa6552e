"""VGG-11 as FedNova and FedALRC train it on CIFAR-10: configuration "A" of Simonyan &
Zisserman (ICLR 2015) without BatchNorm, and a 512-512 fully connected classifier.

Eight 3x3 convolutions (padding 1, ReLU) in five stages of 64, 128, 256x2, 512x2 and 512x2
channels, each stage ending in a 2x2 max-pool; a 32x32 input leaves 512 features of 1x1.
The classifier is that of FedNova's CIFAR-10 setting (Wang et al., "Tackling the Objective
Inconsistency Problem in Heterogeneous Federated Optimization", NeurIPS 2020; the authors'
code, `models/vgg.py`), which FedALRC's CIFAR-10 experiment follows: dropout with p = 0.5
before each of the two hidden linear layers. Its masks come from a generator of their own
per (seed, round, client) that the client program hands to the model for each task
(`hetfl.core.client.dropout`), never from PyTorch's global RNG, so a round's result does not
depend on the order clients run in; evaluation (eval mode) drops nothing.
"""

from __future__ import annotations

import torch
from torch import nn

from hetfl.core.client.dropout import SeededDropout

#: Output channels of the convolutions, stage by stage (configuration "A").
STAGES: tuple[tuple[int, ...], ...] = ((64,), (128,), (256, 256), (512, 512), (512, 512))


class VGG11(nn.Module):
    """VGG-11 without BatchNorm for (C, H, W) inputs with H, W >= 32."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        c, h, w = input_shape
        layers: list[nn.Module] = []
        for widths in STAGES:
            for out in widths:
                layers += [nn.Conv2d(c, out, 3, padding=1), nn.ReLU()]
                c = out
            layers.append(nn.MaxPool2d(2))
        self.features = nn.Sequential(*layers)  # (B, 512, H/32, W/32)
        flat = c * (h // 32) * (w // 32)
        self.body = nn.Sequential(
            SeededDropout(0.5),
            nn.Linear(flat, 512),
            nn.ReLU(),
            SeededDropout(0.5),
            nn.Linear(512, 512),
            nn.ReLU(),
        )
        self.head = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.features(x).flatten(1)))
