"""Deterministic parameter initialisation from an explicit generator.

PyTorch's layer constructors draw from the global RNG; HetFL never does. After building a
module, `initialize` re-draws every parameter from the given generator with PyTorch's own
default schemes (so accuracy matches what users expect), walking modules in registration
order so the result depends only on the generator.

A custom layer takes part by defining `reset_parameters_with(generator)`; a layer with
parameters this function does not know is an error rather than a silent global-RNG draw.
"""

from __future__ import annotations

import math
from typing import cast

import torch
from torch import nn

from hetfl.core.roles import NORM_LAYERS
from hetfl.core.spec import Spec
from hetfl.core.types import ModelFamily


def build_model(family: ModelFamily, spec: Spec) -> nn.Module:
    """`family.build(spec)` without moving the global RNG (layer constructors draw from it);
    the weights are whatever the constructors made — call `initialize` for seeded ones."""
    with torch.random.fork_rng(devices=[]):
        return family.build(spec)


def initialize(module: nn.Module, generator: torch.Generator) -> nn.Module:
    """Re-initialise every parameter of `module` in place from `generator`; returns it."""
    with torch.no_grad():
        for sub in module.modules():
            custom = getattr(sub, "reset_parameters_with", None)
            if custom is not None:
                custom(generator)
            elif isinstance(sub, nn.Linear | nn.modules.conv._ConvNd):
                _kaiming_default(sub.weight, sub.bias, generator)
            elif isinstance(sub, NORM_LAYERS):
                if getattr(sub, "weight", None) is not None:
                    sub.weight.fill_(1.0)
                if getattr(sub, "bias", None) is not None:
                    sub.bias.zero_()
                running_mean = getattr(sub, "running_mean", None)
                if running_mean is not None:  # tracked running statistics: all three are tensors
                    running_mean.zero_()
                    cast(torch.Tensor, sub.running_var).fill_(1.0)
                    cast(torch.Tensor, sub.num_batches_tracked).zero_()
            elif any(True for _ in sub.parameters(recurse=False)):
                raise TypeError(
                    f"cannot initialise {type(sub).__name__} deterministically: give it a "
                    "reset_parameters_with(generator) method"
                )
    return module


def _kaiming_default(
    weight: torch.Tensor, bias: torch.Tensor | None, generator: torch.Generator
) -> None:
    """PyTorch's Linear/Conv default: kaiming_uniform(a=sqrt(5)), bias U(±1/sqrt(fan_in))."""
    fan_in = weight[0].numel() if weight.dim() > 1 else weight.numel()
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    # kaiming_uniform with a = sqrt(5) gives gain sqrt(2 / 6) and bound gain * sqrt(3 / fan_in)
    # = 1 / sqrt(fan_in): the same bound as the bias.
    weight.uniform_(-bound, bound, generator=generator)
    if bias is not None:
        bias.uniform_(-bound, bound, generator=generator)
