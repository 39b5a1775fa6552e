"""SplitFed (SFLV1): Thapa et al., "SplitFed: When Federated Learning Meets Split Learning"
(AAAI 2022), §3, Algorithm 1 (SFLV1), as DTFL compares against it ("Speed up Federated
Learning in Heterogeneous Environment: A Dynamic Tiering Approach", §4 and App. A.5: one
cut after md2 for every client, on its CIFAR bottleneck ResNet, `resnet-cifar`).

Reproduced: every client holds md1..md_cut, the same cut for all (`cut`, default 2), and
the server one copy of md_{cut+1}..md8 per client (`hetfl.algorithms.parts.server_copies`). Per
batch, the client runs its side and sends the activations and labels; the server runs
that client's copy forward, the cross-entropy, the backward and the copy's step, and
answers the activations' gradient; the client back-propagates it through its side and
steps. The client waits for the gradient every batch, so on the simulated clock its
round is its compute plus its server side's (docs/system.md §3.1), and activations up and
gradients down count in `bytes_up` and `bytes_down`. At the end of the round the fed
server averages the client sides and the main server the server copies, each weighted by
n_k (Algorithm 1); here that is one weighted mean of the joined models (client side ∪ its
server copy), BatchNorm statistics included. The global model md1..md8 is evaluated, on
the global test set and on each client's local test split (`local_acc`).

Choices where the paper or its code differ or are silent:

- Weights: Algorithm 1 weights by n_k / n; the reference code
  (chandra2thapa/SplitFed-When-Federated-Learning-Meets-Split-Learning,
  `SFLV1_ResNet_HAM10000.py`) averages uniformly and aggregates only once every client
  has trained (full participation). HetFL weights by n_k renormalised over the clients
  that returned, any participation (`weighting: uniform` gives the code's mean); with
  full participation and equal data sizes all three agree.
- The server's optimiser: SFLV1 steps each server copy with the clients' optimiser and
  learning rate; the reference code re-creates the copy's Adam at every batch (its moments
  never outlive one step). HetFL gives each copy one optimiser of the round's local
  settings (`train.optimizer`, lr, betas, weight decay) for the whole round, fresh each
  round as the client's is, kept per client only with `keep_momentum`, like the client's.
  DTFL's comparison trains both sides with AMSGrad, lr 1e-3, weight decay 5e-4.
  Stepped with the same settings, the two sides equal the joined model trained whole
  (tests/test_splitfed.py checks it for SGD and for AMSGrad).
- `train.clip_grad_norm` clips each side's gradient on its own (a joint norm would need
  the other side's gradient).
- The training loss (`loss` in metrics.jsonl) is the server copy's: the client has no head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pydantic import Field

from hetfl.algorithms.parts.method_registry import AggregationOptions, register_algorithm
from hetfl.algorithms.parts.server_copies import CopiesSide
from hetfl.core.client.recipe import LocalRecipe, ModelCall, TrainContext
from hetfl.core.server.assign import one_spec
from hetfl.core.server.evaluation import LocalModel, global_model
from hetfl.core.server.strategy import Aggregation, Evaluation, Extras, Strategy
from hetfl.core.server.weighting import weighting
from hetfl.core.training import LocalTraining
from hetfl.core.types import ModelFamily
from hetfl.models.resnet_cifar import TIERS, split_family

#: Why SplitFed runs in the simulator only (`hetfl serve` says so).
PER_BATCH_EXCHANGE = (
    "it exchanges activations and gradients with the server every batch (split learning), "
    "which the Flower adapter does not carry yet"
)


class SplitFedOptions(AggregationOptions):
    cut: int = Field(
        2,
        ge=TIERS[0],
        le=TIERS[-1],
        description="the client holds md1..md_cut, the server the rest (DTFL's SplitFed: 2)",
    )


@dataclass(frozen=True)
class SplitClient:
    """The client's half of a SplitFed step: `forward` runs the client side and keeps its
    activation z (B, C, H', W'); the loss is the server's, so the per-sample loss here is
    0; `backward` sends (z, y), waits for ∂loss/∂z and back-propagates it through the
    client side (in place of back-propagating a loss)."""

    def forward(
        self, model: ModelCall, x: torch.Tensor, y: torch.Tensor, ctx: TrainContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        z = model(x)
        ctx.scratch(self)["z"] = z
        return z, torch.zeros(y.shape[0], device=z.device)

    def backward(self, total: torch.Tensor, ctx: TrainContext) -> None:
        z = ctx.scratch(self).pop("z")
        assert ctx.batch is not None  # the loop sets the batch before the forward
        grad = ctx.send(z, ctx.batch[1])
        if grad is None:
            raise RuntimeError("SplitFed's server answered no gradient")
        z.backward(grad)


@register_algorithm("splitfed", SplitFedOptions, needs="split", simulator_only=PER_BATCH_EXCHANGE)
def _make(
    family: ModelFamily, opts: SplitFedOptions, *, clients_per_round: int, train: LocalTraining
) -> tuple[Strategy, LocalRecipe]:
    split = split_family(family, "splitfed")
    server = CopiesSide(family, split.server_spec, answers=True, parallel=False, client_loss=True)
    strategy = Strategy(
        family,
        train=train,
        sampler=opts.sampler(clients_per_round),
        assignment=one_spec(split.side_spec("client", opts.cut)),
        aggregation=Aggregation(
            weighting=weighting(opts.weighting),
            reducer=opts.reducer.build(),
        ),
        evaluation=Evaluation(local_eval=LocalModel(global_model)),
        extras=Extras(server_side=server),
    )
    client = SplitClient()
    return strategy, LocalRecipe(forward=client.forward, backward=client.backward)
