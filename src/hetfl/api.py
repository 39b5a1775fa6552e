"""The method-building API in one place: what a method of one's own is built from and
registered with, whichever room of HetFL each part lives in (docs/api.md, docs/plugins.md).

A method is a `Strategy` composed from the server half's parts (sampling, assignment, map
transforms, weighting, a reducer, a server update, evaluation) and a `LocalRecipe` of the
client half's parts (loss terms, gradient transforms, projections), returned by a `make`
that `register_algorithm` names with its `Options` record; docs/contracts.md §1.3 lists
each part's protocol. An attack of one's own (`attack:`) is registered with
`register_attack` (docs/plugins.md, "An attack"). A plugin imports these names from here,
not from the rooms (`hetfl.core.server`, `hetfl.core.client`, `hetfl.algorithms.parts`,
`hetfl.attacks`), which may move.
"""

from hetfl.algorithms.parts.method_registry import (
    ALGORITHMS,
    AggregationOptions,
    Algorithm,
    Options,
    ReducerOptions,
    WeightingOption,
    register_algorithm,
)
from hetfl.attacks.poisoning import buffer_names
from hetfl.attacks.registry import ATTACKS, register_attack
from hetfl.core.client.recipe import LocalRecipe, LossTerm, TrainContext
from hetfl.core.client.terms import ClipGradNorm, ProximalTerm
from hetfl.core.client.wrappers import WRAPPERS, register_wrapper
from hetfl.core.kinds import KindOptions, choose
from hetfl.core.server.assign import (
    CyclicSampling,
    GroupQuotas,
    PerClient,
    PerGroup,
    UniformSampling,
    one_spec,
)
from hetfl.core.server.evaluation import LocalModel, WholeModel, own_spec
from hetfl.core.server.maps import Grouped, LabelSplit, NothingShared, private_layers
from hetfl.core.server.optimisers import ServerOptimizer, ServerOptSettings
from hetfl.core.server.reducers import REDUCERS, register_reducer
from hetfl.core.server.strategy import Aggregation, Capabilities, Evaluation, Extras, Strategy
from hetfl.core.server.update import (
    Averaged,
    NormalisedStep,
    Optimised,
    RoundResults,
    Scaled,
    pseudo_gradient,
)
from hetfl.core.server.weighting import by_samples, uniform, weighting
from hetfl.core.spec import Spec
from hetfl.core.state import Accumulator
from hetfl.core.training import LocalTraining
from hetfl.core.types import ClientInfo, ModelFamily

__all__ = [
    "ALGORITHMS",
    "ATTACKS",
    "REDUCERS",
    "WRAPPERS",
    "Accumulator",
    "Aggregation",
    "AggregationOptions",
    "Algorithm",
    "Averaged",
    "Capabilities",
    "ClientInfo",
    "ClipGradNorm",
    "CyclicSampling",
    "Evaluation",
    "Extras",
    "GroupQuotas",
    "Grouped",
    "KindOptions",
    "LabelSplit",
    "LocalModel",
    "LocalRecipe",
    "LocalTraining",
    "LossTerm",
    "ModelFamily",
    "NormalisedStep",
    "NothingShared",
    "Optimised",
    "Options",
    "PerClient",
    "PerGroup",
    "ProximalTerm",
    "ReducerOptions",
    "RoundResults",
    "Scaled",
    "ServerOptSettings",
    "ServerOptimizer",
    "Spec",
    "Strategy",
    "TrainContext",
    "UniformSampling",
    "WeightingOption",
    "WholeModel",
    "buffer_names",
    "by_samples",
    "choose",
    "one_spec",
    "own_spec",
    "private_layers",
    "pseudo_gradient",
    "register_algorithm",
    "register_attack",
    "register_reducer",
    "register_wrapper",
    "uniform",
    "weighting",
]
