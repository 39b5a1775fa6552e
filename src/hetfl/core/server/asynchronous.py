"""One job: the server steps of asynchronous aggregation, built on the method's own
`Strategy.aggregate`, so that its index maps, label-split masks, weights and per-element
coverage (HeteroFL's count per element) decide which elements an update moves.

Both rules are one move of the global state x toward the method's aggregate A of a set of
uploads, x <- x + r (A - x), on the elements some upload covers (A = x elsewhere: the
aggregate keeps what no client trained):

- FedAsync ("Asynchronous Federated Optimization", Algorithm 1): the upload is the client's
  trained model y itself and r = a_t, so a covered element becomes (1 - a_t) x + a_t y.
  With one full model this is the paper's mixing exactly.
- FedBuff ("Federated Learning with Buffered Asynchronous Aggregation", Algorithm 1): client
  i's upload is x + w_i (y_i - x_i), its delta from the model x_i it downloaded scaled by
  its staleness weight w_i and laid on the current model, and r = eta_g. The aggregate's
  per-element weighted mean then gives x + mean_i(w_i delta_i) over the clients covering
  each element, so x moves by eta_g times that mean: with K full models of equal weight the
  paper's step x <- x + eta_g (1/K) sum_i w_i delta_i (its Delta has the opposite sign).

Tensors that are not floating point (BatchNorm's `num_batches_tracked`) take the aggregate's
value: a step size has no meaning for a counter.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch

from hetfl.core.state import extract
from hetfl.core.types import State, Trained, TrainedRound


def moved(
    state: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor], rate: float
) -> State:
    """x + rate (target - x) for every floating tensor x of `state`; `target`'s value for
    the others."""
    out: State = {}
    for name, x in state.items():
        t = target[name]
        out[name] = x + rate * (t - x) if x.is_floating_point() else t.clone()
    return out


def delta_uploads(
    trained: TrainedRound, state: Mapping[str, torch.Tensor], weights: Sequence[float]
) -> TrainedRound:
    """Each result's tensors replaced by the current model's elements under its task's map
    plus its weight times its delta from what its task sent (`task.payload`): FedBuff's
    staleness-weighted deltas, in the form the method's aggregate reduces."""
    if len(weights) != len(trained.trained):
        raise ValueError(
            f"{len(weights)} staleness weights for {len(trained.trained)} buffered updates"
        )
    rewritten = []
    for item, w in zip(trained.trained, weights, strict=True):
        current = extract(state, item.task.index_map)
        sent = item.task.payload
        tensors = {
            name: current[name] + w * (y - sent[name]) if y.is_floating_point() else y
            for name, y in item.result.tensors.items()
        }
        rewritten.append(Trained(item.task, replace(item.result, tensors=tensors)))
    return replace(trained, trained=tuple(rewritten))
