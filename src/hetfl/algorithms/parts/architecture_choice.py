"""One job: which architecture each client trains, for FedFA and the baselines it is compared with
(Park and Joe-Wong, "Federated Learning with Flexible Architectures", ECML-PKDD 2024, §5.1
and Algorithm 1, lines 1-3): the server publishes candidates, each client declares one, and
the global model has the largest width of every layer and the largest depth of every
section among the declared ones. FedFA, FlexiFed and NeFL all assign through
`ArchitectureChoice`: with the same seed, options and clients, each puts the same clients on
the same architectures, a like-for-like comparison (the draws come from the run's seed;
candidates are priced and scored as architectures: `ArchitectureChoice.architecture`).

A candidate is one depth for every section and one width multiplier for every layer
(`Candidate`). The paper's candidate tables are images no text reproduces, so the grid is a
project default: depths {2, 3, 4} x widths {1/4, 1/2, 3/4, 1} (FlexiFed's at one width).
On MobileNetV2 (§5.1: per-stage repeat counts of at least 2) a depth d caps each stage at
its own repeats, min(d, n) blocks (`hetfl.models.scalable.depth_blocks`, a HetFL choice):
its one-block stages keep one, and d = 4 is its own full depth.

A client's architecture, in this order (`ArchitectureChoice.setup_seeded`):
1. the one it declares itself (`attrs["architecture"]`, a candidate's label);
2. the smallest candidate (fewest MACs per sample) for a resource-limited client: as in
   §5.1, half of the clients, here a seeded random half (`limited_share`);
3. else, among the candidates whose forward MACs per sample fit its budget, the best by
   the ZiCo proxy it computed on its own data (`choice: zico`, `ZicoQuery`) or a seeded
   random one (`choice: random`). The budget is what it declares (`attrs["macs_budget"]`),
   else `budgets[i]` for the i-th client in id order, else (a HetFL choice: the paper
   states none) drawn uniformly between the smallest and the largest candidate's cost.

A client claiming the largest model (a malicious client of an attacked run, as FedFA's
threat model has it, §5) is chosen for as every client is, then given the largest candidate
(most MACs per sample) by `hetfl.core.server.assign.LargestClaims` (`give_largest`), so
that every other client gets the architecture it gets in the clean run.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch
from pydantic import Field, model_validator
from torch import nn

from hetfl.algorithms.parts.method_registry import AggregationOptions
from hetfl.algorithms.parts.widths import full_width_base
from hetfl.algorithms.parts.zico import zico
from hetfl.core.init import build_model, initialize
from hetfl.core.pixels import model_inputs
from hetfl.core.pricing import PassPricing
from hetfl.core.spec import Spec
from hetfl.core.types import ClientData, ClientInfo, ModelFamily, PassRecord
from hetfl.models.scalable import depth_blocks

Choice = Literal["zico", "random"]
#: The ZiCo scores a client declares, by candidate label (`ZicoQuery`).
ZICO_ATTR = "zico"
#: The mini-batches ZiCo is computed over (the brief's B = 2).
ZICO_BATCHES = 2
#: The normalisation a candidate is priced and scored at, whichever method trains it
#: (`ArchitectureChoice.architecture`): static BatchNorm, no scaler, no step sizes. ZiCo runs
#: in training mode at initialisation, where static and running-statistics BatchNorm
#: compute the same and NeFL's step sizes are 1: the architecture as every method starts it.
ARCHITECTURE_NORMALISATION: Mapping[str, Any] = {"bn": "static", "scaler": False}


class _Draw(NamedTuple):
    info: ClientInfo
    budget: float | None
    own: torch.Generator


@dataclass(frozen=True)
class Candidate:
    """One depth for every section (capped by a stage's own repeats where the family has
    them: `depth_blocks`) and one width multiplier for every layer."""

    depth: int
    width: float

    @property
    def label(self) -> str:
        return f"d{self.depth}-w{self.width:g}"


def candidate_grid(
    depths: Sequence[int], widths: Sequence[float], *, grafting: bool = False
) -> list[Candidate]:
    """Every (depth, width) pair, shallowest and narrowest first, checked: depths >= 1,
    widths in (0, 1], and with `grafting` (FedFA's Algorithm 2) the rule that a section is
    grafted from an identity block, so no depth of 1 beside a deeper candidate."""
    if not depths or not widths:
        raise ValueError("depths and widths must each list at least one value")
    if any(not isinstance(d, int) or d < 1 for d in depths):
        raise ValueError(f"depths must be integers >= 1, got {list(depths)}")
    if any(not (math.isfinite(w) and 0 < w <= 1) for w in widths):
        raise ValueError(
            f"widths must be multipliers in (0, 1], got {list(widths)}; use 1 for full width"
        )
    if grafting and 1 in depths and max(depths) > 1:
        raise ValueError(
            f"depths {sorted(depths)}: a client of depth 1 has no identity block to graft into "
            "the deeper blocks of a section (its one block strides or projects); use depths >= 2"
        )
    return [
        Candidate(d, float(w))
        for d, w in itertools.product(sorted(set(depths)), sorted(set(widths)))
    ]


class ArchitectureOptions(AggregationOptions):
    """The options of a method whose clients train architectures from a grid of
    candidates (FedFA and its baselines): the same fields and defaults for each, so that
    the same options give the same assignment whichever method trains it, and the same
    non-IID treatment (`label_split`), which the FedFA paper applies to every method it
    compares ("clients zero-out logits for absent classes", §5.1)."""

    depths: list[int] = Field(
        [2, 3, 4],
        description="candidate depths, blocks in every section (mobilenetv2, efficientnetv2-s "
        "and -tiny: min(depth, n) in a stage of n repeats, full at 4, 15 and 3)",
    )
    widths: list[float] = Field(
        [0.25, 0.5, 0.75, 1.0], description="candidate width multipliers, in (0, 1]"
    )
    choice: Choice = Field(
        "zico",
        description="how a client that is not resource-limited picks among the candidates "
        "within its budget: zico, the best ZiCo proxy on its own data (simulator only), or "
        "random, a seeded draw",
    )
    limited_share: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="share of clients, drawn from the seed, that take the smallest candidate",
    )
    budgets: list[float] | None = Field(
        None,
        description="each client's budget in forward MACs per sample, in client id order "
        "(a client's declared macs_budget wins); unset: drawn between the cheapest and the "
        "dearest candidate",
    )
    label_split: bool = Field(
        True,
        description="logits of a client's absent classes zeroed in training and only its own "
        "classes' head rows aggregated (a no-op where a client holds every class)",
    )

    @model_validator(mode="after")
    def _candidates_are_valid(self) -> ArchitectureOptions:
        candidate_grid(self.depths, self.widths)
        if self.budgets is not None and any(not b > 0 for b in self.budgets):
            raise ValueError(f"budgets must be positive MACs per sample, got {self.budgets}")
        return self


class ArchitectureChoice:
    """The assignment of architectures (module docstring); a `SeededAssignment`.

    `spec(candidate)` is what a client trains: `base` (the family's full-width spec) at the
    candidate's depth and width with the method's `normalisation` (FedFA's static BatchNorm,
    NeFL's step sizes). `architecture(candidate)` is the same at
    `ARCHITECTURE_NORMALISATION`, whatever the method: candidates are priced (MACs at the
    base's input shape, hence budgets and the smallest) and scored (ZiCo) there, so the
    choice depends on the architectures alone and is the same under every method. `macs`
    prices them (the cost model that charges the clients, injected by the face)."""

    def __init__(
        self,
        family: ModelFamily,
        base: Spec,
        candidates: Sequence[Candidate],
        *,
        method: str,
        choice: Choice,
        macs: PassPricing,
        normalisation: Mapping[str, Any] = ARCHITECTURE_NORMALISATION,
        budgets: Sequence[float] | None = None,
        limited_share: float = 0.5,
    ) -> None:
        if "blocks" not in base:
            raise ValueError(
                f"{method} trains architectures of a depth per section: model.name must be a "
                f"family of residual blocks (preresnet, resnet18, mobilenetv2, efficientnetv2-s, "
                f"efficientnetv2-tiny), got "
                f"{base.get('family')!r}"
            )
        self.family, self.base, self.candidates = family, base, list(candidates)
        self.method, self.normalisation = method, dict(normalisation)
        self.pricing = macs
        self.choice, self.budgets, self.limited_share = choice, budgets, limited_share
        self.by_label = {c.label: c for c in self.candidates}
        self.by_spec = {self.spec(c): c for c in self.candidates}
        self.chosen: dict[int, Candidate] = {}
        self.budget_of: dict[int, float | None] = {}
        self._macs: dict[Candidate, int] = {}
        self._global: Spec | None = None

    def _at(self, candidate: Candidate, normalisation: Mapping[str, Any]) -> Spec:
        # Slots beyond `stages` keep the base's values, as `family.global_spec` does: a global
        # spec that is a candidate is then that candidate's spec, tensor groups included.
        used = range(self.base["stages"])
        return self.base.replace(
            blocks=depth_blocks(self.base, candidate.depth),
            widths=tuple(
                candidate.width if i in used else w for i, w in enumerate(self.base["widths"])
            ),
            **normalisation,
        )

    def spec(self, candidate: Candidate) -> Spec:
        """The candidate as the method's clients train it."""
        return self._at(candidate, self.normalisation)

    def architecture(self, candidate: Candidate) -> Spec:
        """The candidate as it is priced and scored, whatever the method (class docstring)."""
        return self._at(candidate, ARCHITECTURE_NORMALISATION)

    def candidate_at(self, spec: Spec) -> Candidate | None:
        """The candidate whose spec `spec` is; None for another spec (a global spec that
        no candidate is, when the chosen ones are not nested)."""
        return self.by_spec.get(spec)

    def macs(self, candidate: Candidate) -> int:
        """Forward MACs of one sample through the candidate's architecture."""
        if candidate not in self._macs:
            record = PassRecord(self.architecture(candidate), "forward", 1, 1)
            self._macs[candidate] = self.pricing.pass_macs(record, self.base["input_shape"])
        return self._macs[candidate]

    def setup(self, clients: Sequence[ClientInfo]) -> None:
        raise TypeError("ArchitectureChoice draws at set-up: call setup_seeded(clients, generator)")

    def setup_seeded(self, clients: Sequence[ClientInfo], generator: torch.Generator) -> None:
        """Each client's architecture (module docstring), from `_draws`."""
        self.chosen, self.budget_of, self._global = {}, {}, None
        for draw in self._draws(clients, generator):
            cid = draw.info.cid
            declared = draw.info.attrs.get("architecture")
            if declared is not None:
                self.chosen[cid] = self._declared(cid, declared)
            elif draw.budget is None:
                self.chosen[cid] = self.smallest()
            else:
                self.budget_of[cid] = draw.budget
                self.chosen[cid] = self._best_within(draw.info, draw.budget, draw.own)

    def scored_clients(
        self, clients: Sequence[ClientInfo], generator: torch.Generator
    ) -> dict[int, dict[str, float]]:
        """The clients whose ZiCo scores `setup_seeded(clients, generator)` reads, each told
        its MACs budget: under `choice: zico`, those that neither declare an architecture
        nor are resource-limited and whose budget fits more than one candidate (the same
        draws, so the same clients and budgets); the set-up query asks no other (half the
        clients, by default). Told its budget, a client scores only the candidates within
        it (`ZicoQuery`), the only scores its choice reads (Algorithm 1, line 2: each
        client picks within its own resources), ~38 % of the 12-candidate grid's MACs."""
        if self.choice != "zico":
            return {}
        return {
            d.info.cid: {"macs_budget": d.budget}
            for d in self._draws(clients, generator)
            if d.budget is not None
            and "architecture" not in d.info.attrs
            and sum(self.macs(c) <= d.budget for c in self.candidates) > 1
        }

    def _draws(self, clients: Sequence[ClientInfo], generator: torch.Generator) -> list[_Draw]:
        """Each client in id order with its budget (None: declared or resource-limited)
        and its own generator: the limited share from one permutation, then for each
        client a generator of its own (its budget, its random pick), so that what one
        client declares never shifts another's draws."""
        ordered = sorted(clients, key=lambda c: c.cid)
        order = torch.randperm(len(ordered), generator=generator).tolist()
        limited = {ordered[i].cid for i in order[: int(len(ordered) * self.limited_share)]}
        draws = []
        for i, info in enumerate(ordered):
            own = torch.Generator().manual_seed(
                int(torch.randint(2**62, (1,), generator=generator))
            )
            plain = info.attrs.get("architecture") is None and info.cid not in limited
            draws.append(_Draw(info, self._budget(info, i, own) if plain else None, own))
        return draws

    def _declared(self, cid: int, label: Any) -> Candidate:
        if label not in self.by_label:
            raise ValueError(
                f"client {cid} declares architecture {label!r}, not a candidate; allowed: "
                f"{', '.join(self.by_label)}"
            )
        return self.by_label[label]

    def smallest(self) -> Candidate:
        """The candidate with the fewest MACs per sample (the shallower, then the narrower,
        on a tie)."""
        return min(self.candidates, key=lambda c: (self.macs(c), c.depth, c.width))

    def largest(self) -> Candidate:
        """The candidate with the most MACs per sample (the deeper, then the wider, on a tie)."""
        return max(self.candidates, key=lambda c: (self.macs(c), c.depth, c.width))

    def largest_spec(self) -> Spec:
        """The largest candidate's spec (`KnowsLargest`)."""
        return self.spec(self.largest())

    def give_largest(self, cid: int) -> None:
        """Client `cid` trains the largest candidate whatever its budget (a claim,
        `LargestClaims`): it has no budget of its own."""
        self.chosen[cid] = self.largest()
        self.budget_of.pop(cid, None)
        self._global = None

    def _budget(self, info: ClientInfo, i: int, own: torch.Generator) -> float:
        declared = info.attrs.get("macs_budget")
        if declared is None and self.budgets is not None:
            if i >= len(self.budgets):
                raise ValueError(
                    f"budgets lists {len(self.budgets)} value(s) but client {info.cid} is client "
                    f"{i + 1} in id order; give one budget per client, or leave budgets out"
                )
            declared = self.budgets[i]
        if declared is not None:
            return float(declared)
        costs = [self.macs(c) for c in self.candidates]
        low, high = min(costs), max(costs)
        return low + float(torch.rand(1, generator=own, dtype=torch.float64)) * (high - low)

    def _best_within(self, info: ClientInfo, budget: float, own: torch.Generator) -> Candidate:
        fits = [c for c in self.candidates if self.macs(c) <= budget]
        if not fits:
            cheapest = min(self.macs(c) for c in self.candidates)
            raise ValueError(
                f"client {info.cid}'s budget of {budget:,.0f} MACs per sample fits no candidate: "
                f"the smallest costs {cheapest:,}; raise the budget or add a smaller candidate "
                "(a smaller depth or width)"
            )
        if self.choice == "random":
            return fits[int(torch.randint(len(fits), (1,), generator=own))]
        if len(fits) == 1:  # nothing to compare: the client is not asked (`scored_clients`)
            return fits[0]
        scores = info.attrs.get(ZICO_ATTR)
        if not isinstance(scores, Mapping) or any(c.label not in scores for c in fits):
            raise ValueError(
                f"choice 'zico': client {info.cid} has no ZiCo score for every candidate "
                f"within its budget ({', '.join(c.label for c in fits)}); the simulator asks "
                "each client at set-up; elsewhere use choice: random or declare the architecture"
            )
        return max(fits, key=lambda c: (float(scores[c.label]), -self.macs(c)))

    # -- the assignment's verbs -------------------------------------------------------------
    def candidate_of(self, info: ClientInfo) -> Candidate:
        if info.cid not in self.chosen:
            raise KeyError(
                f"client {info.cid} was not known at set-up; {self.method}'s architectures are "
                "chosen then"
            )
        return self.chosen[info.cid]

    def spec_of(self, info: ClientInfo) -> Spec:
        return self.spec(self.candidate_of(info))

    def spec_in_round(self, round: int, info: ClientInfo, rng: torch.Generator) -> Spec:
        return self.spec_of(info)

    def possible_specs(self) -> list[Spec]:
        return [self.spec(c) for _, c in sorted(self.chosen.items())]

    def global_spec(self) -> Spec:
        """The largest width of every layer and depth of every section among the clients'
        architectures (Algorithm 1, line 3), once set-up has chosen them."""
        if self._global is None:
            if not self.chosen:
                raise RuntimeError(
                    "the architectures are chosen at set-up; call setup_seeded first"
                )
            self._global = self.family.global_spec(self.possible_specs())
        return self._global

    def used(self) -> list[Candidate]:
        """The candidates some client chose, smallest first."""
        return sorted(set(self.chosen.values()), key=lambda c: (c.depth, c.width))

    def describe(self) -> dict[str, Any]:
        """Every candidate with its forward MACs per sample and the clients that chose it
        (for `summary.json` and the start banner, a row per candidate)."""
        return {
            "architectures": {
                c.label: {
                    "macs": self.macs(c),
                    "clients": [cid for cid, chosen in sorted(self.chosen.items()) if chosen == c],
                }
                for c in self.candidates
            }
        }

    def trace_fields(self, info: ClientInfo, task: object = None) -> dict[str, Any]:
        """A client's architecture and, if it chose within one, its budget (the per-client
        trace)."""
        return {"arch": self.candidate_of(info).label, "macs_budget": self.budget_of.get(info.cid)}

    def extra_state(self) -> dict[str, Any]:
        """Each client's label, under `<method>_architectures` (`fedfa_architectures`)."""
        return {f"{self.method}_architectures": {str(c): x.label for c, x in self.chosen.items()}}

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        labels = state[f"{self.method}_architectures"]
        saved = {int(cid): self.by_label.get(label) for cid, label in labels.items()}
        if saved != self.chosen:
            raise ValueError(
                f"the checkpoint's {self.method} architectures differ from the ones set-up chose "
                "again (a changed candidate list, budgets or client data?); resume with the "
                "run's config"
            )


class ZicoQuery:
    """A client's answer at set-up: the ZiCo score (`hetfl.algorithms.parts.zico`) of every
    candidate's architecture (`ArchitectureChoice.architecture`: the same scores under every
    method) within the MACs budget it declares or is told (`scored_clients`; every
    candidate without one), each at a seeded initialisation, over `ZICO_BATCHES`
    mini-batches of `batch_size` drawn from its own training data (`SetupQuery`).

    It keeps the architectures, not the choice, so that it travels to an executor's
    workers as a few specs; its `key` is what the scores depend on besides the client's
    data and generator (every architecture, the batches, torch's version), under which
    an engine may keep them across runs.

    Each candidate's model is built once per copy of the query (`_model`; a copy pickles
    without them) and re-initialised in place for every client: building it again costs
    more than the two mini-batches it is scored on, and `initialize` resets every
    parameter and statistic, so a reused model is exactly a fresh one."""

    def __init__(self, family: ModelFamily, choice: ArchitectureChoice, batch_size: int) -> None:
        self.family, self.batch_size = family, batch_size
        self.architectures = {c.label: choice.architecture(c) for c in choice.candidates}
        self.macs = {c.label: choice.macs(c) for c in choice.candidates}
        self.instead = (
            f"use options.{choice.method}.choice: random, or give every node its architecture "
            "(--attr architecture=LABEL)"
        )
        self.key: str | None = json.dumps(
            {
                "query": "zico",
                "batches": ZICO_BATCHES,
                "batch_size": batch_size,
                "torch": torch.__version__,
                "architectures": {k: repr(v) for k, v in self.architectures.items()},
            },
            sort_keys=True,
        )
        self._models: dict[str, nn.Module] = {}

    def __getstate__(self) -> dict[str, Any]:
        """A copy travels without the models: the process that receives it builds its own."""
        return {**self.__dict__, "_models": {}}

    def _model(self, label: str, seed: int, device: torch.device) -> nn.Module:
        """Candidate `label`'s model at the initialisation `seed` draws, on `device`: built on
        the first call and re-initialised in place after, on the CPU, where the generator
        draws (a copy goes to another device)."""
        model = self._models.get(label)
        if model is None:
            model = self._models[label] = build_model(self.family, self.architectures[label])
        initialize(model, torch.Generator().manual_seed(seed))
        return model if device.type == "cpu" else copy.deepcopy(model).to(device)

    def __call__(
        self, info: ClientInfo, data: ClientData, generator: torch.Generator
    ) -> dict[str, Any]:
        n = data.n_train
        if n < 2 * ZICO_BATCHES:
            raise ValueError(
                f"choice 'zico': client {info.cid} holds {n} training samples, too few for "
                f"{ZICO_BATCHES} mini-batches of two; use choice: random"
            )
        order = torch.randperm(n, generator=generator).to(data.x_train.device)
        size = min(self.batch_size, n // ZICO_BATCHES)
        batches = [
            (model_inputs(data.x_train[idx], data.pixels), data.y_train[idx])
            for idx in (order[b * size : (b + 1) * size] for b in range(ZICO_BATCHES))
        ]
        seed = int(torch.randint(2**62, (1,), generator=generator))
        device = data.x_train.device
        scores = {
            label: zico(self._model(label, seed, device).train(), batches)
            for label in self._within(info.attrs.get("macs_budget"))
        }
        return {ZICO_ATTR: scores}

    def _within(self, budget: Any) -> list[str]:
        """The candidates a client with `budget` MACs per sample scores (every one without a
        budget): the ones its choice compares (`ArchitectureChoice._best_within`, the same
        test). Each is scored at the one seeded initialisation and over the same batches
        whichever others are scored, so its score does not depend on the budget."""
        if budget is None:
            return list(self.architectures)
        return [label for label in self.architectures if self.macs[label] <= float(budget)]


def architecture_choice(
    family: ModelFamily,
    opts: ArchitectureOptions,
    *,
    method: str,
    normalisation: Mapping[str, Any],
    batch_size: int,
    macs: PassPricing,
) -> tuple[ArchitectureChoice, ZicoQuery | None]:
    """The assignment `opts` describes on `family`'s full-width model, with the method's
    `normalisation`, its candidates priced by `macs`, and the set-up query its choice
    needs: ZiCo's over mini-batches of `batch_size` (the run's), or none."""
    choice = ArchitectureChoice(
        family,
        full_width_base(family, method),
        candidate_grid(opts.depths, opts.widths),
        method=method,
        choice=opts.choice,
        macs=macs,
        normalisation=normalisation,
        budgets=opts.budgets,
        limited_share=opts.limited_share,
    )
    return choice, None if opts.choice == "random" else ZicoQuery(family, choice, batch_size)
