"""Declared architectures: each client trains one architecture from a named candidate list
(per-section depth `blocks`, per-section width), the set-up FedFA describes (Park and
Joe-Wong, "Federated Learning with Flexible Architectures", ECML-PKDD 2024, §4.1 and §5.1:
the server publishes the candidates, half of the clients are resource-limited and take the
smallest, the others choose by their budget) and under which its baselines, FlexiFed and
NeFL, are compared with it. Shared by the methods whose clients train architectures
(`ArchitectureAssignment`, `ArchitectureModels`, `own_tensors`).

Which client takes which candidate: a client declaring `attrs["architecture"]` (a
candidate's name) takes it; of the others, in client-id order, the first `limited` share
takes the smallest candidate (fewest parameters) and the rest are dealt the other
candidates in equal shares, in the order listed (`assign_in_proportion`; client ids are
exchangeable since partitions are drawn at random). HetFL's substitute, at this scale, for
the budget-driven choice (FedFA's ZiCo search), fixed for the run and re-derived on resume.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Annotated

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from hetfl.algorithms.width_assignment import assign_in_proportion
from hetfl.core.evaluation import Layout
from hetfl.core.init import build_model
from hetfl.core.roles import norm_tensor_names, tensor_roles
from hetfl.core.spec import Spec
from hetfl.core.state import extract
from hetfl.core.types import ClientInfo, EvalModel, ModelFamily


class Candidate(BaseModel):
    """One architecture a client may train."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(description="the architecture's name (groups, group-qualified tensors)")
    blocks: tuple[int, ...] = Field(description="residual blocks per section")
    width: float | tuple[float, ...] = Field(
        1.0, description="width ratio: one for every section, or one per section"
    )

    @field_validator("name")
    @classmethod
    def _plain_name(cls, name: str) -> str:
        if not name or any(c in name for c in "/+= "):
            raise ValueError(
                f"a candidate name must be non-empty without '/', '+', '=', ' '; got {name!r}"
            )
        return name


Candidates = Annotated[
    tuple[Candidate, ...],
    Field(
        min_length=1,
        description="the architectures clients train, each {name, blocks, width}; a client "
        "declaring attrs['architecture'] takes the one it names",
    ),
]
LimitedShare = Annotated[
    float,
    Field(
        ge=0,
        le=1,
        description="share of the clients not declaring an architecture that are "
        "resource-limited and take the smallest candidate (first in client-id order); the "
        "others are dealt the other candidates in equal shares",
    ),
]


def candidate_specs(
    family: ModelFamily, candidates: Sequence[Candidate], method: str, **changes: object
) -> dict[str, Spec]:
    """Each candidate's spec: the family's base with its blocks and widths (and `changes`,
    a method's normalisation), checked by building its map; names must be distinct and
    architectures different."""
    base = family.global_spec([])
    if "blocks" not in base:
        raise ValueError(
            f"{method} trains architectures of per-section depth: model.name must be a family "
            f"with residual blocks (preresnet), got {base.get('family')!r}"
        )
    specs: dict[str, Spec] = {}
    for c in candidates:
        if len(c.blocks) != len(base["blocks"]):
            raise ValueError(
                f"{method}: candidate {c.name!r} gives blocks {list(c.blocks)}; the model has "
                f"{len(base['blocks'])} sections, so give one count per section"
            )
        widths = (c.width,) * len(base["widths"]) if isinstance(c.width, float) else c.width
        if len(widths) != len(base["widths"]):
            raise ValueError(
                f"{method}: candidate {c.name!r} gives widths {list(widths)}; the model has "
                f"{len(base['widths'])} sections, so give one ratio, or one per section"
            )
        # Sections beyond the model's `stages` keep the base's values, so that candidates
        # differ only where they differ and the global spec of nested ones is the largest.
        used = range(base["stages"])
        spec = base.replace(
            blocks=tuple(c.blocks[i] if i in used else b for i, b in enumerate(base["blocks"])),
            widths=tuple(widths[i] if i in used else w for i, w in enumerate(base["widths"])),
            **changes,
        )
        family.index_map(spec)  # a spec no model can be built from raises here, naming it
        same = [n for n, s in specs.items() if s == spec]
        if c.name in specs or same:
            raise ValueError(
                f"{method}: candidate names must be distinct and architectures different; "
                f"{c.name!r} repeats {(same or [c.name])[0]!r}"
            )
        specs[c.name] = spec
    return specs


def parameter_count(family: ModelFamily, spec: Spec) -> int:
    """The trainable parameters of `spec`'s model (built on the meta device)."""
    with torch.device("meta"):
        return sum(p.numel() for p in build_model(family, spec).parameters())


class ArchitectureAssignment:
    """Each client's candidate (module docstring), fixed for the run: an `Assignment`
    (`hetfl.core.assign`). `name_of` holds it by client id; `arch_of(spec)` names a spec."""

    def __init__(self, family: ModelFamily, specs: Mapping[str, Spec], *, limited: float) -> None:
        self.specs, self.limited = dict(specs), limited
        sizes = {n: parameter_count(family, s) for n, s in self.specs.items()}
        self.smallest = min(self.specs, key=lambda n: (sizes[n], list(self.specs).index(n)))
        self.sizes = sizes
        self.name_of: dict[int, str] = {}

    def setup(self, clients: Sequence[ClientInfo]) -> None:
        names = list(self.specs)
        self.name_of = {}
        dealt = []
        for info in sorted(clients, key=lambda c: c.cid):
            declared = info.attrs.get("architecture")
            if declared is None:
                dealt.append(info.cid)
            elif declared in self.specs:
                self.name_of[info.cid] = declared
            else:
                raise ValueError(
                    f"client {info.cid} declares architecture {declared!r}, which is not a "
                    f"candidate (candidates: {names}); declare one of them"
                )
        others = [n for n in names if n != self.smallest]
        order = [self.smallest, *others]
        rest = [(1 - self.limited) / len(others)] * len(others) if others else []
        shares = [self.limited, *rest] if others else [1.0]
        level = assign_in_proportion(dealt, [float(i) for i in range(len(order))], shares)
        self.name_of.update({cid: order[int(i)] for cid, i in level.items()})

    def arch_of(self, spec: Spec) -> str | None:
        """The candidate a spec is; None for another spec (the global spec, when the
        candidates are not nested: its tensors then keep their plain names, which no
        client trains)."""
        return next((n for n, s in self.specs.items() if s == spec), None)

    def spec_of(self, info: ClientInfo) -> Spec:
        """A client's candidate (the smallest for a client unknown at set-up)."""
        return self.specs[self.name(info)]

    def spec_in_round(self, round: int, info: ClientInfo, rng: torch.Generator) -> Spec:
        return self.spec_of(info)

    def possible_specs(self) -> list[Spec]:
        return [self.specs[self.name_of[cid]] for cid in sorted(self.name_of)]

    def used(self) -> list[str]:
        """The candidates some client trains, in the order listed."""
        taken = set(self.name_of.values())
        return [n for n in self.specs if n in taken]

    def name(self, info: ClientInfo) -> str:
        """A client's candidate's name."""
        return self.name_of.get(info.cid, self.smallest)

    def trace_fields(self, info: ClientInfo, task: object) -> dict[str, str]:
        """The client's architecture, for its rows of the per-client trace."""
        return {"arch": self.name(info)}


class ArchitectureModels:
    """Every architecture some client trains, on the global test set (named and grouped
    `arch=<name>`), `first` first: its model is `global_acc`'s. Each is read through the
    spec's shared map, so group-qualified tensors (`hetfl.core.maps.Grouped`) load as its
    own."""

    def __init__(self, assignment: ArchitectureAssignment, first: Callable[[Spec], float]) -> None:
        self.assignment, self.first = assignment, first

    def eval_models(self, layout: Layout, state: Mapping[str, torch.Tensor]) -> list[EvalModel]:
        specs = self.assignment.specs
        names = sorted(self.assignment.used(), key=lambda n: -self.first(specs[n]))
        return [
            EvalModel(
                name=f"arch={n}",
                spec=specs[n],
                tensors=extract(state, layout.shared_map(specs[n])),
                group=f"arch={n}",
            )
            for n in names
        ]


def own_tensors(
    family: ModelFamily, group_of: Callable[[Spec], str | None], roles: Sequence[str]
) -> Callable[[Spec], dict[str, str]]:
    """A `hetfl.core.maps.Grouped` rule: a spec's normalisation tensors and those of the
    given roles (`hetfl.core.roles.tensor_roles`) go to the group `group_of(spec)` (none
    where it is None)."""

    def rule(spec: Spec) -> dict[str, str]:
        group = group_of(spec)
        if group is None:
            return {}
        with torch.device("meta"):
            model = build_model(family, spec)
        own = norm_tensor_names(model)
        own |= {n for n, role in tensor_roles(model).items() if role in roles}
        return {n: group for n in sorted(own)}

    return rule
