"""VGG-11 as FedNova and FedALRC train it on CIFAR-10 (METHODS.md §2.5): configuration "A" of
Simonyan & Zisserman (ICLR 2015) without BatchNorm, and a 512-512 fully connected classifier.

Eight 3x3 convolutions (padding 1, ReLU) in five stages of 64, 128, 256x2, 512x2 and 512x2
channels, each stage ending in a 2x2 max-pool; a 32x32 input leaves 512 features of 1x1.

Deviation: FedNova's classifier puts dropout (p = 0.5) before both hidden layers. Dropout
draws its masks from PyTorch's global RNG, which HetFL code never uses (a round's result
must not depend on execution order or on where a run resumed), so this model has none.
"""

from __future__ import annotations

import torch
from torch import nn

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
        self.body = nn.Sequential(nn.Linear(flat, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU())
        self.head = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.features(x).flatten(1)))
