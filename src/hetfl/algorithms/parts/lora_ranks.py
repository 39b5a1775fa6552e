"""The options and set-up the heterogeneous-rank LoRA methods share (HetLoRA, FlexLoRA,
FLoRA): the ranks clients train, how each client gets one, the scale's α and the
pretrained base; the configured model wrapped in `hetfl.models.lora.LoRAFamily`.

A rank is a width on the adapters' inner axis, so a client's rank is chosen by the width
machinery (`hetfl.algorithms.parts.width_assignment.WidthAssignment`) over the levels
r / R, R the largest rank: `fixed` proportions in client-id order, `dynamic` draws per
round, or `declared` capacities (a client's `attrs["capacity"]`, a fraction of R, or
`capacities`) quantised down to a rank, as widths are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field, field_validator

from hetfl.algorithms.parts.method_registry import Options, WeightingOption
from hetfl.algorithms.parts.width_assignment import Capacities, Proportions, WidthAssignment
from hetfl.algorithms.parts.widths import check_levels
from hetfl.core.types import ModelFamily
from hetfl.models.lora import LoRAFamily, load_base_state

#: The ranks of the issue's study: {2, 4, 8, 16} across clients.
DEFAULT_RANKS = (2, 4, 8, 16)
#: α of the scale s = α / R (LoRA's α; Hu et al. set α to the first rank they try).
DEFAULT_ALPHA = 16.0


class LoRARankOptions(Options):
    """What every heterogeneous-rank LoRA method takes."""

    ranks: tuple[int, ...] = Field(
        DEFAULT_RANKS, description="the adapter ranks clients train; the largest is the global rank"
    )
    proportions: Proportions = None
    assignment: Literal["fixed", "dynamic", "declared"] = Field(
        "fixed",
        description="how a client's rank is chosen: fixed, dealt at set-up in proportion, "
        "smallest first by client id; dynamic, redrawn per client and round; declared, the "
        "client's capacity (a fraction of the largest rank) quantised down to a rank",
    )
    capacities: Capacities = None
    alpha: float = Field(
        DEFAULT_ALPHA,
        gt=0,
        allow_inf_nan=False,
        description="α of the adapters' scale α / R (R the largest rank), one scale for every "
        "client",
    )
    pretrained: str | None = Field(
        None,
        description="path of the base model's state dict (torch.save of model.state_dict()); "
        "unset: the base is the model's initialisation from seed 0",
    )
    weighting: WeightingOption = "samples"

    @field_validator("ranks")
    @classmethod
    def _ranks_are_distinct_positive(cls, ranks: tuple[int, ...]) -> tuple[int, ...]:
        if not ranks or any(r < 1 for r in ranks) or len(set(ranks)) != len(ranks):
            raise ValueError(f"ranks must be distinct integers >= 1, got {list(ranks)}")
        return ranks


@dataclass(frozen=True)
class RankSetup:
    """A method's LoRA family and its rank assignment."""

    family: LoRAFamily
    assignment: WidthAssignment


def rank_setup(family: ModelFamily, opts: LoRARankOptions, *, mergeable: bool = False) -> RankSetup:
    """The configured model under rank-R adapters (R = max rank) from the pretrained base
    (`mergeable`: with each client's own merged updates, FLoRA's), and the assignment of
    ranks r as the levels r / R."""
    top = max(opts.ranks)
    base = None if opts.pretrained is None else load_base_state(opts.pretrained)
    lora = LoRAFamily(family, max_rank=top, alpha=opts.alpha, pretrained=base, mergeable=mergeable)
    levels, proportions = check_levels([r / top for r in opts.ranks], opts.proportions)

    assignment = WidthAssignment(
        levels,
        proportions,
        lambda level: lora.spec_at(round(level * top)),
        mode=opts.assignment,
        capacities=opts.capacities,
    )
    return RankSetup(lora, assignment)
