"""FLANC: Mei, Guo, Zhou and Patel, "Resource-Adaptive Federated Learning with All-In-One
Neural Composition" (NeurIPS 2022), following its supplement (§1.2 models, §2-3 the two
forms of the composed kernel, §4.2 and §5 pre-clustering of capacities, Table 1
hyper-parameters) and the authors' code (HarukiYqM/All-In-One-Neural-Composition:
`trainer_FL.py`, `model/cnn_flanc.py`, `model/resnet18_flanc.py`) where the text is silent.

Reproduced: every composed layer's width-p kernel is a shared neural basis V times
capacity-specific coefficients U_p (the `composed-*` model families, `hetfl.models.flanc`);
a client of capacity p receives the bases and capacity p's own tensors (coefficients,
stem, shortcuts, normalisation, classifier) and nothing of other capacities; it trains
cross-entropy plus the orthogonality penalty λ Σ mean((B Bᵀ - I)²) over the banks
(`OrthogonalityPenalty`; λ = 0.1 for Fashion-MNIST, 10 otherwise in Table 1); the server
averages the bases uniformly over all of the round's clients, and every other tensor
uniformly within its capacity group (an absent group keeps its tensors), so that each
capacity is a model of its own sharing only the bases; every capacity's model is tested on
the global test set (`groups["capacity=p"]`, the widest is `global_acc`, their mean under
`groups["capacity=mean"]`).

Capacities (`capacity`):
- `dynamic-all-levels` (default): each round the sampled clients draw levels uniformly,
  redrawn until every level appears: the code's setting (`trainer_FL.py: train`, "we
  sample all model size for all methods"), which needs at least as many clients per round
  as levels;
- `dynamic`: each client draws its level every round, independently;
- `declared`: a client's continuous capacity (`attrs["capacity"]`, or `capacities` in
  client id order) is quantised to the largest level not above it, for the whole run
  (supplement §4.2, §5 and Table 3).

Choices where the paper is silent: weights are uniform, not by sample count (the code's
`sync`); under a dynamic draw a client is judged locally by the widest model (it has no
capacity of its own), under `declared` by its own.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from hetfl.algorithms.parts.method_registry import ReducerOptions, register_algorithm
from hetfl.algorithms.parts.width_assignment import (
    Capacities,
    Levels,
    WidthAssignment,
    check_every_level_fits,
)
from hetfl.algorithms.parts.width_eval import LevelModels, own_level
from hetfl.algorithms.parts.widths import check_levels
from hetfl.core.client.recipe import LocalRecipe
from hetfl.core.client.regularisers import OrthogonalityPenalty
from hetfl.core.server.assign import UniformSampling
from hetfl.core.server.evaluation import LocalModel
from hetfl.core.server.strategy import Aggregation, Evaluation, Extras, Strategy
from hetfl.core.server.weighting import weighting
from hetfl.core.training import LocalTraining
from hetfl.core.types import ClientInfo, ModelFamily
from hetfl.models.flanc import ComposedFamily

DEFAULT_LEVELS = (0.25, 0.5, 0.75, 1.0)
#: The orthogonality weight of the authors' code (`--lambdaR 10`; Table 1: 10 for CIFAR and
#: Shakespeare, 0.1 for Fashion-MNIST).
DEFAULT_LAMBDA = 10.0
Capacity = Literal["dynamic-all-levels", "dynamic", "declared"]


class FLANCOptions(ReducerOptions):
    levels: Levels = DEFAULT_LEVELS
    capacity: Capacity = Field(
        "dynamic-all-levels",
        description="how a client's capacity is chosen: dynamic-all-levels, the round's "
        "clients redrawn together until every level appears; dynamic, redrawn per client and "
        "round; declared, the client's capacity quantised down to a level",
    )
    capacities: Capacities = None
    lambda_orth: float = Field(
        DEFAULT_LAMBDA,
        ge=0,
        allow_inf_nan=False,
        description="λ, the weight of the bases' orthogonality penalty (Table 1: 0.1 for "
        "Fashion-MNIST, 10 otherwise)",
    )


def capacity_name(p: float) -> str:
    """The name (and group) of capacity p's evaluated model: `capacity=p`."""
    return f"capacity={p:g}"


def composed_family(family: ModelFamily) -> ComposedFamily:
    if not isinstance(family, ComposedFamily):
        raise ValueError(
            "flanc composes its kernels from shared bases: set model.name to one of the "
            "composed families (composed-cnn, composed-resnet18, composed-rnn); the "
            "configured model has plain layers"
        )
    return family


@register_algorithm("flanc", FLANCOptions, needs="composed")
def _make(
    family: ModelFamily, opts: FLANCOptions, *, clients_per_round: int, train: LocalTraining
) -> tuple[Strategy, LocalRecipe]:
    composed = composed_family(family)
    levels, _ = check_levels(opts.levels, None)
    check_every_level_fits(opts.capacity, levels, clients_per_round)
    for p in levels:
        composed.spec_at(p)  # refuses a level whose widths do not compose (S_p/R1)
    level_spec = composed.spec_at
    assignment = WidthAssignment(
        levels, None, level_spec, mode=opts.capacity, capacities=opts.capacities
    )
    widest = max(levels)

    def local_level(info: ClientInfo) -> float:
        return widest if assignment.dynamic else assignment.level(info)

    strategy = Strategy(
        family,
        train=train,
        sampler=UniformSampling(clients_per_round),
        assignment=assignment,
        aggregation=Aggregation(weighting=weighting("uniform"), reducer=opts.reducer.build()),
        evaluation=Evaluation(
            global_eval=LevelModels(
                assignment.trained_levels,
                level_spec,
                level_spec,
                stats_pass=False,
                name=capacity_name,
                mean_group="capacity=mean",
            ),
            local_eval=LocalModel(
                own_level(local_level, level_spec, level_spec, lambda p: f"local capacity={p:g}")
            ),
        ),
        extras=Extras(
            describe=lambda: {
                "levels": list(levels),
                "capacity": opts.capacity,
                "lambda_orth": opts.lambda_orth,
            }
        ),
    )
    return strategy, LocalRecipe(loss_terms=(OrthogonalityPenalty(opts.lambda_orth),))
