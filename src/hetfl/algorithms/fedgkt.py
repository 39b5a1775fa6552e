"""FedGKT: He, Annavaram and Avestimehr, "Group Knowledge Transfer: Federated Learning of
Large CNNs at the Edge" (NeurIPS 2020, §3, Algorithm 1, Eq. (4)-(7)), with FedML's code
(FedML-AI/FedML `simulation/mpi/fedgkt/`: `GKTClientTrainer`, `GKTServerTrainer`,
`utils.KL_Loss`) where the text is silent.

Reproduced: each client trains its own small model (`resnet-cifar`'s edge model, FedML's
ResNet-8: md1, two bottleneck blocks, its own classifier) for the run's local epochs on
cross-entropy plus alpha · KD(client ‖ server logits) (`hetfl.algorithms.parts.gkt_distill`; the KD
term only once the server has answered), then uploads the feature maps (md1's output),
logits and labels of its whole training set with their sample indices
(`ClientResult.uploads`, counted in `bytes_up`). Client models are never averaged: the
edge model is private (its index map is empty). After every client of the round has
finished, the server phase (`hetfl.algorithms.parts.gkt_server`) trains the global server model,
md2..md8 of the same family (`model.blocks` per group), over every valid upload for
`server_epochs` epochs and answers each client the logits of its samples, delivered with
its next task and counted in `bytes_down` then (`hetfl.core.server.phase`). Defaults as
FedML's published commands: T = 3, alpha = 1, no distillation on the server, 20 server
epochs, Adam with amsgrad (lr 1e-3, weight decay 1e-4) on both sides (the client's from
the run's `train`, which the shipped configs set so).

Evaluation: there is no single global model. `pooled_acc` is each trained client's
extractor joined to the server model (md1 private, md2..md8 global) on that client's own
local test split, pooled over clients by test samples, and `val_acc` the same on their
validation splits. With `eval.pooled_global` (or `eval.require_global_test`), `global_acc`
and `test_loss` are each such joined model on the run's global test set (the seeded
`eval.test_samples` subsample every method's global model is scored on), the unweighted
mean over the trained clients; otherwise `global_acc` is null. This follows FedML's
evaluation of the paper's model (Algorithm 1: the server model runs on the features each
edge extractor computes, so a test image is classified by an extractor joined to the
server model): FedML's `GKTServerTrainer.eval_large_model_on_the_server` scores the
server model on every client's features of its test loader, and FedML's CIFAR-10 loader
gives every client the whole test set, so every client counts equally. Here each client's
extractor and the server model run as one joined model in the client's evaluation unit,
the same forward pass without uploading test features. `local_acc`
is each client's own classifier on its local test split. A HetFL choice where the paper is silent:
the joined model is judged after a statistics pass over the client's own training data
(its BatchNorm statistics re-estimated for that evaluation only). The server trains client
after client, as FedML's does, and every client's md1 is its own, so the server model's
running statistics are those of the last clients it saw; with them, every other client is
judged through another client's normalisation (FedML evaluates so: on one checkpoint of
docs/dtfl_report.md's runs that gave 44 % where the client's own statistics give 74 %).

Deviations: FedML initialises the client from a pretrained ResNet-56; no checkpoint can be
downloaded here, so clients start from the seed's initialisation. Logits are aligned by
sample index (FedML's by batch position). The clients' test-set features, which FedML
uploads for its server's own evaluation, are not uploaded. docs/methods.md has the rest.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from hetfl.algorithms.parts.gkt_distill import FeatureUpload, ServerLogitsKD
from hetfl.algorithms.parts.gkt_server import GKTServer
from hetfl.algorithms.parts.method_registry import Options, register_algorithm
from hetfl.core.client.recipe import LocalRecipe
from hetfl.core.server.assign import UniformSampling, one_spec
from hetfl.core.server.evaluation import LocalModel, NoGlobalModel, fixed_spec
from hetfl.core.server.strategy import Aggregation, Evaluation, Extras, Strategy
from hetfl.core.server.weighting import uniform
from hetfl.core.training import LocalTraining
from hetfl.core.types import ModelFamily
from hetfl.models.resnet_cifar import OUT_CHANNELS, split_family

#: What the run outputs' `pooled_acc` is for FedGKT (the banner and summary.json say it;
#: `global_acc`, with `eval.pooled_global`, is named by the plan's "pooled global test").
POOLED = (
    "pooled over the trained clients' local test splits (each client's extractor joined to "
    "the server model, BatchNorm statistics from the client's training data), not the "
    "global test set"
)


class FedGKTOptions(Options):
    temperature: float = Field(
        3.0, gt=0, allow_inf_nan=False, description="the distillation temperature T (> 0)"
    )
    alpha: float = Field(
        1.0, ge=0, allow_inf_nan=False, description="the weight of the KD term (>= 0)"
    )
    server_epochs: int = Field(
        20, ge=1, description="epochs of the server's training over a round's uploads"
    )
    distill_on_server: bool = Field(
        False, description="add alpha KD(server ‖ client logits) to the server's loss"
    )
    server_optimizer: Literal["sgd", "adam", "amsgrad"] = Field(
        "amsgrad", description="the server model's optimiser (one for the whole run)"
    )
    server_lr: float = Field(1e-3, gt=0, description="the server optimiser's learning rate")
    server_weight_decay: float = Field(
        1e-4, ge=0, description="the server optimiser's weight decay"
    )


@register_algorithm(
    "fedgkt",
    FedGKTOptions,
    needs="split",
    simulator_only="its server trains on all of a round's uploaded features and answers "
    "per-sample logits (a round-level server phase), which the Flower adapter does not "
    "carry yet",
)
def _make(
    family: ModelFamily, opts: FedGKTOptions, *, clients_per_round: int, train: LocalTraining
) -> tuple[Strategy, LocalRecipe]:
    split = split_family(family, "fedgkt")
    edge = split.side_spec("edge", 1)
    server = GKTServer(
        family,
        split.server_spec(edge),
        LocalTraining(
            optimizer=opts.server_optimizer,
            lr=opts.server_lr,
            weight_decay=opts.server_weight_decay,
            batch_size=train.batch_size,
        ),
        epochs=opts.server_epochs,
        temperature=opts.temperature,
        alpha=opts.alpha,
        distill=opts.distill_on_server,
        feature_channels=OUT_CHANNELS[0],
    )
    strategy = Strategy(
        family,
        train=train,
        sampler=UniformSampling(clients_per_round),
        assignment=one_spec(edge),
        aggregation=Aggregation(weighting=uniform),
        evaluation=Evaluation(
            global_eval=NoGlobalModel(),
            pooled_eval=LocalModel(
                fixed_spec(split.side_spec("whole")), stats_pass=True, present_only=True
            ),
        ),
        extras=Extras(
            server_phase=server,
            describe=lambda: {**opts.model_dump(mode="json"), "pooled_acc": POOLED},
        ),
    )
    recipe = LocalRecipe(
        loss_terms=(ServerLogitsKD(opts.alpha, opts.temperature),), upload=FeatureUpload()
    )
    return strategy, recipe
