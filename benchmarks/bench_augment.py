"""Augmentation's share of a training step on CIFAR-sized images (issue 17: at most 10 %).

A step here is what HetFL's local training does per batch: gather the batch, turn it into
model inputs, forward, backward and an SGD update of the small CNN (`small-cnn`) on
3x32x32 images, one thread (the executor's default per unit). The augmented side adds the
CIFAR recipe (padded crop 4 and flip) or every transform (plus random resized crop and
Cutout 16) to the same steps; both standardise uint8 pixels per batch. Steps alternate
between the sides, so a busy machine slows both.

    .venv/bin/python benchmarks/bench_augment.py [--steps 300] [--batch 32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from hetfl.core.augment import Augmentation, ResizedCrop
from hetfl.core.pixels import PixelNorm
from hetfl.models.plain import SmallCNN

CIFAR_PIXELS = PixelNorm((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
RECIPES = {
    "crop+flip": Augmentation(crop_padding=4, flip=True),
    "all four": Augmentation(crop_padding=4, flip=True, resized_crop=ResizedCrop(), cutout=16),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    images = torch.randint(0, 256, (5000, 3, 32, 32), dtype=torch.uint8)
    labels = torch.randint(0, 10, (5000,))
    model = SmallCNN((3, 32, 32), 10)
    optimiser = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(1)

    def step(augment: Augmentation | None) -> float:
        start = time.perf_counter()
        idx = torch.randint(0, 5000, (args.batch,), generator=generator)
        x = images[idx]
        x = CIFAR_PIXELS(x) if augment is None else augment(x, generator, CIFAR_PIXELS)
        loss = F.cross_entropy(model(x), labels[idx])
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        return time.perf_counter() - start

    def augment_only(augment: Augmentation) -> float:
        x = images[torch.randint(0, 5000, (args.batch,), generator=generator)]
        start = time.perf_counter()
        augment(x, generator, CIFAR_PIXELS)
        return time.perf_counter() - start

    for _ in range(20):  # warm-up
        step(None)
        for recipe in RECIPES.values():
            step(recipe)
    plain: list[float] = []
    timed: dict[str, list[float]] = {name: [] for name in RECIPES}
    alone: dict[str, list[float]] = {name: [] for name in RECIPES}
    for _ in range(args.steps):
        plain.append(step(None))
        for name, recipe in RECIPES.items():
            timed[name].append(step(recipe))
            alone[name].append(augment_only(recipe))
    base = statistics.median(plain)
    print(f"small CNN step on 3x32x32, batch {args.batch}, 1 thread: {base * 1e3:.2f} ms (median)")
    for name in RECIPES:
        with_aug = statistics.median(timed[name])
        own = statistics.median(alone[name])
        print(
            f"  {name:9s}: step {with_aug * 1e3:.2f} ms, augmentation alone {own * 1e3:.2f} ms, "
            f"share of the augmented step {own / with_aug:.1%} "
            f"(step ratio {with_aug / base:.3f}; target share <= 10 %)"
        )


if __name__ == "__main__":
    main()
