"""The strategy of a method whose clients train architectures from a grid of candidates
(FedFA and its baselines FlexiFed and NeFL): what the three share, built once, so that a
comparison between them differs only in the parts each method brings (its map transforms,
its scaling, whether it evaluates after a statistics pass, which architecture is its
global model).

Shared: the assignment (`ArchitectureChoice` and its set-up query), the sampler, the
weighting and reducer from the options, plain averaging as the server update, every chosen
architecture evaluated (`ArchitectureModels`) and each client on its own
(`own_architecture`), and the non-IID treatment FedFA's paper applies to every method it
compares (Park and Joe-Wong, "Federated Learning with Flexible Architectures",
ECML-PKDD 2024, §5.1): with `label_split`, the logits of a client's absent classes zeroed
in training (`MaskedCrossEntropy`), its head rows only from the clients holding their
class (`LabelSplit`, after the method's own transforms) and its own evaluation masked.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hetfl.algorithms.parts.architecture_choice import (
    ArchitectureChoice,
    ArchitectureOptions,
    Candidate,
    ZicoQuery,
)
from hetfl.algorithms.parts.architecture_eval import ArchitectureModels, own_architecture
from hetfl.core.client.recipe import CrossEntropy, LocalRecipe
from hetfl.core.client.terms import MaskedCrossEntropy
from hetfl.core.server.evaluation import LocalModel
from hetfl.core.server.maps import LabelSplit, MapTransform
from hetfl.core.server.strategy import Aggregation, Evaluation, Extras, Strategy
from hetfl.core.server.weighting import Scaling, weighting
from hetfl.core.training import LocalTraining
from hetfl.core.types import ModelFamily


def architecture_strategy(
    family: ModelFamily,
    opts: ArchitectureOptions,
    choice: ArchitectureChoice,
    query: ZicoQuery | None,
    *,
    train: LocalTraining,
    clients_per_round: int,
    transforms: Sequence[MapTransform],
    stats_pass: bool,
    first: Callable[[Candidate], float] | None = None,
    scaling: Scaling | None = None,
) -> tuple[Strategy, LocalRecipe]:
    """The method's strategy and local recipe: its `transforms` (then the label split),
    its `scaling`, evaluation with or without a statistics pass, `first` naming the
    architecture `global_acc` scores (none: the global spec)."""
    chained = [*transforms, LabelSplit(family)] if opts.label_split else list(transforms)
    strategy = Strategy(
        family,
        train=train,
        sampler=opts.sampler(clients_per_round),
        assignment=choice,
        aggregation=Aggregation(
            weighting=weighting(opts.weighting),
            transforms=chained,
            scaling=scaling,
            reducer=opts.reducer.build(),
        ),
        evaluation=Evaluation(
            global_eval=ArchitectureModels(choice, first=first, stats_pass=stats_pass),
            local_eval=LocalModel(
                own_architecture(choice, stats_pass=stats_pass),
                stats_pass=stats_pass,
                label_mask=opts.label_split,
            ),
        ),
        extras=Extras(
            describe=choice.describe,
            trace_fields=choice.trace_fields,
            setup_query=query,
            setup_query_clients=choice.scored_clients,
        ),
    )
    forward = MaskedCrossEntropy() if opts.label_split else CrossEntropy()
    return strategy, LocalRecipe(forward=forward)
