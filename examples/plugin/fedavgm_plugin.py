"""A HetFL plugin: a method and a model registered from outside HetFL, without a fork.

Name this file in a config (`plugins: [./fedavgm_plugin.py]`, relative to the config's
folder) or on the command line (`hetfl run CONFIG --plugin examples/plugin/fedavgm_plugin.py`);
HetFL imports it before validating the config, so `algorithm: fedavgm` and
`model.name: tiny-mlp` validate, list (`hetfl list --plugin ...`), sweep and run under every
executor. See docs/plugins.md.

**FedAvgM**: Hsu, Qi and Brown, "Measuring the Effects of Non-Identical Data Distribution
for Federated Visual Classification" (arXiv:1909.06335, 2019), FedAvg with server
momentum: with Δ = w - Σ p_k w_k (the current weights minus FedAvg's average),

    v ← β v + Δ,    w ← w - η v.

Composed from HetFL's parts, nothing new: FedAvg's (sampling, one spec, sample weighting,
the chosen reducer) with the server update `Optimised(pseudo_gradient, ServerOptimizer)`
of FedAdagrad/FedAdam/FedYogi, its optimiser SGD with momentum.
HetFL's server SGD keeps a damped momentum, m ← β m + (1 - β) d with d = -Δ, and steps
w ← w + η' m; by induction m = (1 - β) (-v), so η' = η / (1 - β) gives the same step
(equal in exact arithmetic; in float32 the two orders of operations may differ in the last
bits). BatchNorm running statistics, if the model had any, take the average.

**tiny-mlp**: one hidden layer of `HIDDEN` ReLU units on flattened inputs, its classifier
marked `head` (what `private_head` keeps on the client).

Classes and functions a run pickles (the model, its builder's `accepts`) are defined at
module level, so that the process executor's workers, which import this plugin first,
find them.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
from pydantic import Field
from torch import nn

from hetfl.api import (
    Aggregation,
    AggregationOptions,
    Extras,
    LocalRecipe,
    LocalTraining,
    ModelFamily,
    Optimised,
    ServerOptimizer,
    ServerOptSettings,
    Strategy,
    one_spec,
    pseudo_gradient,
    register_algorithm,
    weighting,
)
from hetfl.models import MODELS, ModelBuilder

HIDDEN = 32


class FedAvgMOptions(AggregationOptions):
    """FedAvg's options (reducer, weighting, sampling) and the server step's."""

    server_lr: float = Field(1.0, gt=0, description="server learning rate eta (Hsu et al.)")
    momentum: float = Field(0.9, ge=0, lt=1, description="server momentum beta")


@register_algorithm(
    "fedavgm",
    FedAvgMOptions,
    summary="FedAvgM (Hsu et al. 2019): FedAvg with server momentum [example plugin]",
)
def make_fedavgm(
    family: ModelFamily, opts: FedAvgMOptions, *, clients_per_round: int, train: LocalTraining
) -> tuple[Strategy, LocalRecipe]:
    """FedAvg's parts with a momentum step as the server update; clients train as in
    FedAvg (the default recipe)."""
    damped_lr = opts.server_lr / (1 - opts.momentum)
    optimizer = ServerOptimizer(ServerOptSettings(kind="sgd", lr=damped_lr, beta1=opts.momentum))
    strategy = Strategy(
        family,
        train=train,
        sampler=opts.sampler(clients_per_round),
        assignment=one_spec(family.global_spec([])),
        aggregation=Aggregation(
            weighting=weighting(opts.weighting),
            server_update=Optimised(pseudo_gradient, optimizer),
            reducer=opts.reducer.build(),
        ),
        extras=Extras(describe=partial(_described, opts)),
    )
    return strategy, LocalRecipe()


def _described(opts: FedAvgMOptions) -> dict[str, Any]:
    return {"server": f"SGD with momentum {opts.momentum} (FedAvgM), lr {opts.server_lr}"}


class TinyMLP(nn.Module):
    """Flatten, linear to `HIDDEN` units, ReLU, linear to the classes (`head`)."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Flatten(), nn.Linear(math.prod(input_shape), HIDDEN), nn.ReLU()
        )  # (B, HIDDEN)
        self.head = nn.Linear(HIDDEN, num_classes)  # (B, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def accepts(input_shape: tuple[int, ...]) -> bool:
    return len(input_shape) >= 1


MODELS.register("tiny-mlp", ModelBuilder(TinyMLP, accepts, "needs a non-empty input shape"))
