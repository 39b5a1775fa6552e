"""FjORD: Horváth et al., "FjORD: Fair and Accurate Federated Learning under Heterogeneous
Targets with Ordered Dropout" (NeurIPS 2021), §3 (ordered dropout) and §3.2 (self-
distillation), following the authors' Flower baseline (adap/flower `baselines/fjord/`:
`fjord/strategy.py`, `fjord/models.py`, `fjord/od/layers/batch_norm.py`) where the text
leaves a detail open.

Reproduced: width levels P (default 0.2, 0.4, 0.6, 0.8, 1.0); each client has a tier
p_max (uniform allocation over the levels); per mini-batch it draws p uniformly from the
levels at or below p_max and trains the nested slice `[:ceil(p * out), :ceil(p * in)]`
(the same p for every layer); with `distill`, a forward pass at p_max with cross-entropy
plus the width-p pass with cross-entropy against the detached softmax of the p_max
output, both back-propagated before the step. Normalisation keeps one set of running
statistics per width with a shared affine sliced to the width. The server averages every
element over the clients whose tier covers it, weighted by sample counts (the paper's
band-by-band average, since the slices are nested), and evaluates every level's sub-model
on the test set (`groups`: `width=p`, the widest is `global_acc`).

`norm` (default `per-width`, the paper's and the baseline's) may be any normalisation of
`hetfl.algorithms.parts.width_norms` for comparisons on one network: `static` (evaluated after
a statistics pass), `per-capacity` (BatchNorm averaged within each tier, as FLANC's
authors run FjORD on ResNet-18) or `none` (FLANC's Fashion-MNIST CNN).

Choices where the paper is silent:

- tiers go to clients in id order, narrowest first, in the configured `proportions` (equal
  by default; client ids are exchangeable); for comparisons with FLANC, `assignment` also
  offers tiers redrawn every round (`dynamic`, `dynamic-all-levels`: FLANC's draw, until
  every level appears) and `declared` capacities quantised to the levels
  (`hetfl.algorithms.parts.width_assignment.WidthAssignment`);
- with `distill` and p = p_max the step is the plain p_max pass (distilling a model into
  itself adds nothing), as the baseline's code does;
- the width draw uses the client's round generator after its batch order is drawn, so
  a run is reproducible and independent of execution order;
- each pass is recorded with its width, so MACs count exactly what ran.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from pydantic import Field

from hetfl.algorithms.parts.method_registry import register_algorithm
from hetfl.algorithms.parts.option_records import PrivateLayerOptions
from hetfl.algorithms.parts.width_assignment import (
    Assignment,
    Capacities,
    Levels,
    Proportions,
    WidthAssignment,
    check_every_level_fits,
)
from hetfl.algorithms.parts.width_eval import level_models
from hetfl.algorithms.parts.width_norms import NormOption, level_norm
from hetfl.algorithms.parts.widths import check_levels, full_width_base
from hetfl.core.client.recipe import LocalRecipe, ModelCall, TrainContext
from hetfl.core.server.evaluation import GlobalEval, WholeModel
from hetfl.core.server.maps import private_layers
from hetfl.core.server.strategy import Aggregation, Evaluation, Strategy
from hetfl.core.server.weighting import weighting
from hetfl.core.training import LocalTraining
from hetfl.core.types import ModelFamily, PassRecord

DEFAULT_LEVELS = (0.2, 0.4, 0.6, 0.8, 1.0)


@dataclass(frozen=True)
class OrderedDropout:
    """A forward: a width drawn per mini-batch from `levels` (ascending) at or below the
    client's tier, passed to the model as `width=`; with `distill`, the p_max pass's
    cross-entropy plus the width-p pass's cross-entropy against the detached p_max softmax
    (§3.2). Outputs (B, C) of the width-p pass, loss (B,); one `PassRecord` per pass."""

    vectorises: ClassVar[str] = (
        "it draws a width per batch from the client's generator and records its passes"
    )
    levels: tuple[float, ...]
    distill: bool

    def __call__(
        self, model: ModelCall, x: torch.Tensor, y: torch.Tensor, ctx: TrainContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        spec = ctx.task.spec
        p_max = max(spec["widths"])
        allowed = [p for p in self.levels if p <= p_max + 1e-9]
        p = allowed[int(torch.randint(len(allowed), (1,), generator=ctx.generator))]
        batch = int(x.shape[0])
        if self.distill and p < p_max:
            teacher = model(x, width=p_max)
            student = model(x, width=p)
            soft = F.softmax(teacher.detach(), dim=1)
            kd = -(soft * F.log_softmax(student, dim=1)).sum(dim=1)
            ctx.passes.append(PassRecord(spec, "train", batch, 1, width=p_max))
            ctx.passes.append(PassRecord(spec, "train", batch, 1, width=p))
            return student, F.cross_entropy(teacher, y, reduction="none") + kd
        outputs = model(x, width=p)
        ctx.passes.append(PassRecord(spec, "train", batch, 1, width=p))
        return outputs, F.cross_entropy(outputs, y, reduction="none")


class FjORDOptions(PrivateLayerOptions):
    levels: Levels = DEFAULT_LEVELS
    proportions: Proportions = None
    distill: bool = Field(
        False,
        description="self-distillation (§3.2): each step also runs the client's widest width, "
        "whose softmax the width-p pass learns from",
    )
    assignment: Assignment = "fixed"
    capacities: Capacities = None
    norm: NormOption = "per-width"


def fjord_strategy(
    family: ModelFamily, opts: FjORDOptions, clients_per_round: int, train: LocalTraining
) -> Strategy:
    """Tiers by proportion, each level under `norm` (one set of running statistics per
    width); every level evaluated unless private layers leave no complete model."""
    levels, proportions = check_levels(opts.levels, opts.proportions)
    check_every_level_fits(opts.assignment, levels, clients_per_round)
    norm = level_norm(full_width_base(family, "fjord"), opts.norm, levels, scaler=False)
    assignment = WidthAssignment(
        levels, proportions, norm.train, mode=opts.assignment, capacities=opts.capacities
    )
    private = opts.private_norm or opts.private_head
    global_eval: GlobalEval = WholeModel() if private else level_models(assignment, norm)
    return Strategy(
        family,
        train=train,
        sampler=opts.sampler(clients_per_round),
        assignment=assignment,
        aggregation=Aggregation(
            weighting=weighting(opts.weighting),
            transforms=private_layers(family, norm=opts.private_norm, head=opts.private_head),
            reducer=opts.reducer.build(),
        ),
        evaluation=Evaluation(global_eval=global_eval),
    )


@register_algorithm(
    "fjord",
    FjORDOptions,
    needs="scalable",
)
def _make(
    family: ModelFamily, opts: FjORDOptions, *, clients_per_round: int, train: LocalTraining
) -> tuple[Strategy, LocalRecipe]:
    strategy = fjord_strategy(family, opts, clients_per_round, train)
    forward = OrderedDropout(tuple(sorted(opts.levels)), opts.distill)
    return strategy, LocalRecipe(forward=forward)
