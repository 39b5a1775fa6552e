"""Model tensors in plain dicts made trainable: the parameters that train, the model on them."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from hetfl.core.client.recipe import ModelCall


def trainable_names(template: nn.Module) -> set[str]:
    """The names of `template`'s parameters that training updates (those requiring a
    gradient); its other state-dict tensors are buffers to the optimiser."""
    return {k for k, p in template.named_parameters() if p.requires_grad}


def model_call(
    template: nn.Module, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]
) -> ModelCall:
    """`template` evaluated on `params` and `buffers` (in-place buffer updates land in
    `buffers`); keyword arguments pass through to its forward."""

    def call(x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        out: torch.Tensor = functional_call(template, (params, buffers), (x,), kwargs)
        return out

    return call
