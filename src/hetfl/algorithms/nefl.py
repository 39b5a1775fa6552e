"""NeFL: Kang et al., "NeFL: Nested Model Scaling for Federated Learning with System
Heterogeneous Clients" (2023), as the authors' code runs it (honggkang/nested-federated-
learning: `utils/NeFedAvg.py`, `models/blocks.py` `BasicBlockM`, `NeFL-pre-resnet.py`),
and as FedFA compares against it (Park and Joe-Wong, "Federated Learning with Flexible
Architectures", ECML-PKDD 2024, §2.1 and §5: the width-and-depth scenario).

Reproduced: sub-models of one Pre-ResNet scaled in width by nested slices
(`[:ceil(r * out), :ceil(r * in)]`) and in depth by skipping the last blocks of each
section; a learnable scalar step size per residual block multiplies its residual branch
(`x + s_l f_l(x)`, starting at 1: `hetfl.models.blocks.StepSize`); the "inconsistent"
parameters, every BatchNorm tensor (affine and running statistics) and the step sizes,
are kept per sub-model under group-qualified names (`<sub-model>/<name>`) and averaged
only among the clients that trained that sub-model (uniformly); every other weight is
averaged uniformly over the clients whose sub-model covers each element, elements no
client covered keeping their value (`NeFedAvg`). The largest sub-model (most parameters)
with its own BatchNorm and step sizes is the global model (`global_acc`); every
sub-model is evaluated (`arch=<name>`, as the code tests each), and each client on its
own (`local_acc`). Which client trains which sub-model: the declared architectures of
`hetfl.algorithms.architectures` (the code deals them by device class in client-id
order), the set-up FedFA's comparison uses.

Choices where the code differs or is silent:
- a skipped block is absent from the sub-model (not built, not sent, not priced) where the
  code keeps it with its step size frozen at 0: the outputs are the same, since a skipped
  block is never a section's first and its shortcut is the identity;
- BatchNorm's `num_batches_tracked` is averaged like the other statistics (the code sums
  it); with BatchNorm's momentum it affects nothing;
- each client's optimiser state is not kept between rounds unless `train.keep_momentum`
  says so (the pre-trained script keeps it).
"""

from __future__ import annotations

from hetfl.algorithms.architectures import (
    ArchitectureAssignment,
    ArchitectureModels,
    Candidate,
    Candidates,
    LimitedShare,
    candidate_specs,
    own_tensors,
    parameter_count,
)
from hetfl.algorithms.base import AggregationOptions, WeightingOption, register_algorithm
from hetfl.core.evaluation import OwnModel
from hetfl.core.local.parts import LocalRecipe
from hetfl.core.maps import Grouped
from hetfl.core.server_update import Averaged
from hetfl.core.strategy import Strategy
from hetfl.core.training import LocalTraining
from hetfl.core.types import ModelFamily
from hetfl.core.weighting import weighting

DEFAULT_CANDIDATES = (
    Candidate(name="small", blocks=(1, 1, 1, 1), width=0.5),
    Candidate(name="medium", blocks=(1, 2, 2, 1), width=0.75),
    Candidate(name="large", blocks=(2, 2, 2, 2), width=1.0),
)


class NeFLOptions(AggregationOptions):
    weighting: WeightingOption = "uniform"
    architectures: Candidates = DEFAULT_CANDIDATES
    limited: LimitedShare = 0.5


@register_algorithm("nefl", NeFLOptions, needs="scalable")
def _make(
    family: ModelFamily, opts: NeFLOptions, *, clients_per_round: int, train: LocalTraining
) -> tuple[Strategy, LocalRecipe]:
    """Sub-models with step sizes and BatchNorm, theirs kept per sub-model."""
    specs = candidate_specs(family, opts.architectures, "nefl", bn="batch", step_size=True)
    assignment = ArchitectureAssignment(family, specs, limited=opts.limited)
    per_submodel = own_tensors(family, assignment.arch_of, roles=("step_size",))
    largest = ArchitectureModels(assignment, first=lambda spec: parameter_count(family, spec))
    strategy = Strategy(
        family,
        train=train,
        sampler=opts.sampler(clients_per_round),
        assignment=assignment,
        transforms=[Grouped(per_submodel)],
        weighting=weighting(opts.weighting),
        server_update=Averaged(),
        global_eval=largest,
        local_eval=OwnModel(group=lambda info: f"local arch={assignment.name(info)}"),
        trace_fields=assignment.trace_fields,
        reducer=opts.reducer.build(),
    )
    return strategy, LocalRecipe()
