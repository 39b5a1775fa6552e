"""ScalableFL: Nitta, Suzuki, Rodríguez Mulet, Yaguchi and Hirai, "Scalable Federated
Learning for Clients with Different Input Image Sizes and Numbers of Output Categories"
(arXiv 2311.08716 v1), §III (Algorithms 1 and 2) and §V; where the text is ambiguous, the
reading its tables support (below).

Reproduced:

- Architecture (§III-A): client j with input side H_j and K_j classes trains
  c_j = ceil(log2(H_j / H_0)) down-sampling stages of one global model, each
  kappa_j = log10(K_j) / log10(K_0) times as wide as the family's base widths (ceil, at
  least one channel; kappa may exceed 1 when K_j > K_0; the input channels are never
  scaled). The global model is the per-layer maximum over the clients (the scalable
  family's `global_spec`), so client weights are nested slices `G[:b_j, :a_j]` of its
  first c_j stages.
- Private BatchNorm (affine and running statistics) and private heads (FedBN + FedPer,
  FedAvg's `private_norm` and `private_head`): they stay on the client and never enter
  the global state.
- One round (Algorithm 1): the clients are grouped by (input size, number of classes)
  and `max(1, round(xi * n_group))` are sampled uniformly within each group (xi is
  `participation`, by default `clients_per_round` over the number of clients); each trains
  E mini-batches (`local_steps`) of momentum SGD with weight decay on convolution and
  linear weights only (Table VIII); the server averages every shared element over the
  sampled clients whose slice holds it, with weight 1 per client; uncovered elements (a
  stage no sampled client reaches) keep their value.
- Evaluation: every client's model with its private layers on its local test split (its
  classes, at its input size), reported per group as `groups["group=<H>px-<K>cls"]` and
  averaged as `local_acc` (there is no global model: `global_acc` is null).
- Comparisons of §V (option `variant`): `heterofl-max` and `heterofl-max-1` are §V's
  HeteroFL, the same pipeline with every client at the fixed depth c_max (or c_max - 1) and
  each group's widths chosen so that its model has the parameter count (shared and private)
  of its ScalableFL model (§V and Table VIII's hidden-channel ratios; no scaler, which §V
  does not mention and private BN makes irrelevant); `individual` trains each client's
  ScalableFL architecture alone.

Choices where the paper is silent:

- Depth counts halvings of the feature map (§III-A: c_j = ceil(log2(H_j / H_0)), read as the
  log of the ratio, as its example (128, 64, 32) -> (4, 3, 2) shows): a stage-cnn stage
  halves once; a ResNet with the ImageNet stem halves twice before its first stage (7x7/2
  conv and 3x3/2 max-pool, the paper's stage 1 and the pool of stage 2), so c stages are
  `stages = c - 1` residual stages there. H is the input's height. An input no larger than
  H0 still gets one stage (c = 0 would leave no model).
- K_j is the client's number of training classes, which must be exactly 0..K-1 (client
  views remap them, `data.groups`); a client with one class has kappa = 0 and is refused.
- The per-group count rounds halves up, n_group counts the group's clients at set-up, and
  a group with fewer clients available than its count trains those available.
- Table VIII's cosine decay over the rounds is `train.lr_schedule: {kind: cosine}`, the
  schedule every method shares (`hetfl.core.schedule`); by default the lr is constant, as in
  every other HetFL method. The optimiser (and its momentum) is fresh every round by default
  (HetFL's choice: the paper does not say); `train.keep_momentum` keeps each client's
  buffers as its private state instead.
- Private layers start at the client's own seeded initialisation (BN gamma = 1, beta = 0,
  fresh statistics) at its first participation.
- HeteroFL's widths: first one ratio for every stage, the nearest achievable count over
  every ratio that changes some layer's width (k / base for every slot); when that is
  still more than `match_tolerance` away, one ratio per stage, the nearest over every
  combination of per-stage channel counts up to `max_ratio` times the base. The count is
  an exact quadratic in the per-stage channel counts (every tensor is a product of at most
  two channel counts), fitted from a few meta-device builds and checked against a build.
  The remaining gap per group is in `plans` (`GroupPlan.gap`) and in the run's
  `summary.json` under "strategy" (`describe`).
- Individual training uses the federated runs' sampling, local steps and settings, so
  every client gets the same compute as under ScalableFL; the paper instead tunes a
  separate learning rate, weight decay and 5k to 100k iterations (Table VIII).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import combinations
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field

from hetfl.algorithms.base import Options, register_algorithm
from hetfl.algorithms.fedavg import FedAvg
from hetfl.algorithms.submodels import full_width_base
from hetfl.core.client import ClientHooks
from hetfl.core.spec import IndexMap, Spec
from hetfl.core.state import extract
from hetfl.core.strategy import Strategy, uniform_sample
from hetfl.core.training import LocalTraining
from hetfl.core.types import ClientInfo, EvalTask, ModelFamily, State
from hetfl.models.scalable import ARCHITECTURES
from hetfl.models.slim import channels

Variant = Literal["scalablefl", "heterofl-max", "heterofl-max-1", "individual"]
#: A client group: (input side H, number of classes K).
Group = tuple[int, int]


# -- the architecture rules (§III-A) ----------------------------------------------------------
def scaled_depth(size: int, base_size: int) -> int:
    """c = ceil(log2(H / H0)), in integers: the smallest c >= 1 with H0 * 2**c >= H."""
    c = 1
    while base_size * 2**c < size:
        c += 1
    return c


def width_ratio(classes: int, base_classes: int) -> float:
    """kappa = log10(K) / log10(K0)."""
    return math.log10(classes) / math.log10(base_classes)


def family_stages(base: Spec, halvings: int) -> int:
    """The family's `stages` whose model halves its input `halvings` times."""
    arch = ARCHITECTURES.get(base["family"])
    for stages in range(1, arch.max_stages + 1):
        if arch.min_side(base.replace(stages=stages)) == 2**halvings:
            return stages
    possible = [arch.min_side(base.replace(stages=s)) for s in range(1, arch.max_stages + 1)]
    raise ValueError(
        f"{base['family']} (stem {base.get('stem')}) cannot halve its input {halvings} "
        f"time(s): its models shrink inputs by {possible}; change the client's input size "
        "or base_size"
    )


def parameter_count(family: ModelFamily, spec: Spec) -> int:
    """Parameters of the model for `spec` (shared and private alike; BatchNorm running
    statistics are buffers, not parameters), built on the meta device."""
    with torch.device("meta"):
        model = family.build(spec)
    return sum(p.numel() for p in model.parameters())


# -- parameter matching (§V, Table VIII) -----------------------------------------------------------
class ParameterCount:
    """The parameter count of `spec`'s model as a function of the channel counts of its
    `stages` width slots, exact: every tensor's size is a constant or a product of at most
    two slots' channel counts, so the count is a quadratic in them. With x_i = c_i - 1:

        P(x) = d + sum_i b_i x_i + sum_i a_ii x_i^2 + sum_{i<j} a_ij x_i x_j

    fitted from 1 + 2D + D(D-1)/2 builds around x = 0 and checked at one more point."""

    def __init__(self, family: ModelFamily, spec: Spec) -> None:
        self.family, self.spec = family, spec
        bases = getattr(ARCHITECTURES.get(spec["family"]).make, "BASE", None)
        if bases is None:
            raise ValueError(
                f"{spec['family']} declares no base widths (BASE), so its widths cannot be "
                "matched to a parameter count"
            )
        self.bases = np.array(bases[: spec["stages"]])
        dim = len(self.bases)

        def at(x: Mapping[int, int]) -> int:
            """The built count at x (slot -> x_i; other slots at x = 0)."""
            chans = np.ones(dim, dtype=np.int64)
            for i, v in x.items():
                chans[i] += v
            return parameter_count(family, self.spec_at(chans))

        self.d = at({})
        self.a = np.zeros((dim, dim), dtype=np.int64)
        self.b = np.zeros(dim, dtype=np.int64)
        for i in range(dim):
            p1, p2 = at({i: 1}), at({i: 2})
            self.a[i, i] = (p2 - 2 * p1 + self.d) // 2
            self.b[i] = p1 - self.d - self.a[i, i]
        for i, j in combinations(range(dim), 2):
            both = at({i: 1, j: 1})
            self.a[i, j] = both - self.d - self.b[i] - self.b[j] - self.a[i, i] - self.a[j, j]
        probe = np.array([3 + 2 * i for i in range(dim)], dtype=np.int64)
        if int(self(probe[None])[0]) != parameter_count(family, self.spec_at(probe)):
            raise ValueError(
                f"{spec['family']}: the parameter count is not a quadratic in the stage "
                "widths, so it cannot be matched exactly"
            )

    def spec_at(self, chans: np.ndarray) -> Spec:
        """The spec whose width slots have `chans` channels (unused slots follow the last)."""
        ratios = [int(c) / int(b) for c, b in zip(chans, self.bases, strict=True)]
        slots = len(self.spec["widths"])
        return self.spec.replace(widths=tuple(ratios + [ratios[-1]] * (slots - len(ratios))))

    def __call__(self, chans: np.ndarray) -> np.ndarray:
        """Counts for channel counts of shape (N, D)."""
        x = chans.astype(np.int64) - 1
        linear = x @ self.b + np.einsum("ni,ij,nj->n", x, np.triu(self.a), x)
        return self.d + linear


@dataclass(frozen=True)
class Match:
    """The widths found for a parameter target and the count they give."""

    widths: tuple[float, ...]
    params: int
    per_stage: bool


def match_parameters(
    family: ModelFamily,
    spec: Spec,
    target: int,
    *,
    tolerance: float = 0.01,
    max_ratio: float = 4.0,
    max_spread: float = 1.5,
    max_grid: int = 4_000_000,
) -> Match:
    """Widths for `spec`'s depth, classes and input whose model's parameter count is nearest
    to `target`.

    First one ratio for every stage, over every ratio in (0, max_ratio] that changes some
    stage's channel count. When that misses `target` by more than `tolerance` (relative),
    one ratio per stage, with the ratios within a factor `max_spread` of each other (so no
    stage is starved to fit the count), replaces it if it comes nearer; this enumerates the
    first D-1 stages' channel counts (when they number at most `max_grid`) and solves the
    last stage's. Ties go to the first candidate found (the narrowest single ratio)."""
    count = ParameterCount(family, spec)
    tops = [channels(max_ratio, int(b)) for b in count.bases]
    ratios = sorted(
        {k / int(b) for b, top in zip(count.bases, tops, strict=True) for k in range(1, top + 1)}
    )
    ratios = [r for r in ratios if r <= max_ratio]
    chans = np.array([[channels(r, int(b)) for b in count.bases] for r in ratios])
    gaps = np.abs(count(chans) - target)
    best = int(np.argmin(gaps))
    found = chans[best]
    widths = (ratios[best],) * len(spec["widths"])
    if gaps[best] > tolerance * target and math.prod(tops[:-1]) <= max_grid:
        per_stage = _nearest_per_stage(count, tops, target, max_spread)
        if per_stage is not None and abs(int(count(per_stage[None])[0]) - target) < gaps[best]:
            found, widths = per_stage, tuple(count.spec_at(per_stage)["widths"])
    params = parameter_count(family, spec.replace(widths=widths))
    if params != int(count(found[None])[0]):
        raise RuntimeError(f"parameter count model disagrees with a build at {found.tolist()}")
    return Match(widths, params, per_stage=len(set(widths)) > 1)


def _nearest_per_stage(
    count: ParameterCount, tops: list[int], target: int, spread: float
) -> np.ndarray | None:
    """The channel counts c (c_i in 1..tops[i], ratios c_i / base_i within a factor `spread`
    of each other) whose count is nearest to `target`, or None if no c qualifies. Every
    combination of the first D-1 stages is tried; the count grows with the last stage's
    channels, so for each the nearest last count is next to the quadratic's root, moved
    into the range the spread allows."""
    last = len(tops) - 1
    bases = count.bases.astype(np.float64)
    axes = [np.arange(1, t + 1) for t in tops[:-1]]
    # (N, D): every combination of the first D-1 stages, the last stage at 1 channel
    grid = np.ones((math.prod(tops[:-1]), last + 1), dtype=np.int64)
    if axes:
        grid[:, :-1] = np.stack(np.meshgrid(*axes, indexing="ij"), -1).reshape(-1, last)
    head = grid[:, :last] / bases[:last]  # (N, D-1) ratios
    widest = head.max(axis=1, initial=0.0)
    narrowest = head.min(axis=1, initial=np.inf)
    eps = 1e-9
    lo = np.maximum(np.ceil(widest / spread * bases[last] - eps), 1)
    hi = np.minimum(np.floor(narrowest * spread * bases[last] + eps), tops[-1])
    ok = (lo <= hi) & (widest <= narrowest * spread + eps)
    if not ok.any():
        return None
    grid, lo, hi = grid[ok], lo[ok].astype(np.int64), hi[ok].astype(np.int64)
    # the count as a function of the last stage's x = c - 1: const + lin * x + quad * x^2
    rest = target - count(grid).astype(np.float64)
    lin = count.b[last] + (grid[:, :last] - 1) @ count.a[:last, last]
    quad = float(count.a[last, last])
    with np.errstate(invalid="ignore"):
        root = (-lin + np.sqrt(lin**2 + 4 * quad * rest)) / (2 * quad) if quad else rest / lin
    floor = np.floor(np.nan_to_num(root, nan=0.0)).astype(np.int64) + 1
    candidates = []
    for shift in (-1, 0, 1, 2):
        cand = grid.copy()
        cand[:, last] = np.clip(floor + shift, lo, hi)
        candidates.append(cand)
    stacked = np.concatenate(candidates)
    return stacked[int(np.argmin(np.abs(count(stacked) - target)))]


# -- the strategy ------------------------------------------------------------------------------
@dataclass(frozen=True)
class GroupPlan:
    """One client group's model: `depth` halvings (ScalableFL's c), its spec, its parameter
    count and the ScalableFL count it was matched to (`target`; equal for ScalableFL)."""

    size: int
    classes: int
    clients: int
    depth: int
    spec: Spec
    params: int
    target: int
    per_stage: bool = False

    @property
    def name(self) -> str:
        return f"group={self.size}px-{self.classes}cls"

    @property
    def gap(self) -> float:
        """Relative parameter-count difference to the target."""
        return (self.params - self.target) / self.target


class ScalableFL(FedAvg):
    name = "scalablefl"

    def __init__(
        self,
        family: ModelFamily,
        *,
        clients_per_round: int,
        train: LocalTraining,
        base_size: int = 8,
        base_classes: int = 10,
        participation: float | None = None,
        variant: Variant = "scalablefl",
        match_tolerance: float = 0.01,
        max_ratio: float = 4.0,
        max_spread: float = 1.5,
    ) -> None:
        """Each group samples `participation` of its clients; None takes
        `clients_per_round` over the number of clients. Weight decay applies to
        convolution and linear weights only (Table VIII), whatever `train` says."""
        super().__init__(
            family,
            clients_per_round=clients_per_round,
            train=replace(train, decay_norm_and_bias=False),
            weighting="uniform",
            private_norm=True,
            private_head=True,
        )
        if base_size < 1 or base_classes < 2:
            raise ValueError(
                f"base_size must be >= 1 and base_classes >= 2, got {base_size}, {base_classes}"
            )
        if participation is not None and not 0 < participation <= 1:
            raise ValueError(f"participation must be in (0, 1], got {participation}")
        if variant not in ("scalablefl", "heterofl-max", "heterofl-max-1", "individual"):
            raise ValueError(f"unknown variant {variant!r}")
        self.base_size, self.base_classes = base_size, base_classes
        self.participation, self.variant = participation, variant
        self.match_tolerance, self.max_ratio = match_tolerance, max_ratio
        self.max_spread = max_spread
        self.base = full_width_base(family, self.name).replace(bn="batch", scaler=False)
        arch = ARCHITECTURES.get(self.base["family"])
        sides = {arch.min_side(self.base.replace(stages=s)) for s in range(1, arch.max_stages + 1)}
        if len(sides) < arch.max_stages:
            raise ValueError(
                f"scalablefl sets each client's depth, but {self.base['family']} has a fixed "
                "depth; use stage-cnn, resnet18 or preresnet"
            )
        self.plans: dict[Group, GroupPlan] = {}
        self.group_of: dict[int, Group] = {}
        self.xi = 1.0 if participation is None else participation  # set in `setup` if None

    # -- groups and their models --------------------------------------------------------------
    def group_key(self, info: ClientInfo) -> Group:
        """(H, K) of a client, checked: labels 0..K-1, K >= 2."""
        classes = len(info.labels)
        if info.labels != tuple(range(classes)):
            raise ValueError(
                f"client {info.cid}: scalablefl needs labels 0..K-1 (a K-way private head), "
                f"got {info.labels}; give clients class subsets with data.groups"
            )
        if classes < 2:
            raise ValueError(
                f"client {info.cid} has {classes} class: its width ratio log10(K) / log10(K0) "
                "is 0, so it has no model; give every client at least 2 classes"
            )
        return int(info.input_shape[1]), classes

    def scaled_spec(self, shape: tuple[int, ...], group: Group) -> Spec:
        """ScalableFL's spec for a group: depth from the input size, width from the classes."""
        size, classes = group
        depth = scaled_depth(size, self.base_size)
        return self.base.replace(
            input_shape=tuple(shape),
            num_classes=classes,
            stages=family_stages(self.base, depth),
            widths=(width_ratio(classes, self.base_classes),) * len(self.base["widths"]),
        )

    def setup(
        self,
        clients: Sequence[ClientInfo],
        generator: torch.Generator,
        rounds: int | None = None,
    ) -> None:
        self.group_of = {c.cid: self.group_key(c) for c in clients}
        if self.participation is None:
            self.xi = min(1.0, self.clients_per_round / len(clients))
        sizes = Counter(self.group_of.values())
        shapes = {self.group_of[c.cid]: tuple(c.input_shape) for c in clients}
        scaled = {g: self.scaled_spec(shapes[g], g) for g in sorted(sizes)}
        depths = {g: scaled_depth(g[0], self.base_size) for g in scaled}
        fixed = {"heterofl-max": 0, "heterofl-max-1": 1}.get(self.variant)
        plans = {}
        for g, spec in scaled.items():
            target = parameter_count(self.family, spec)
            plan = GroupPlan(g[0], g[1], sizes[g], depths[g], spec, target, target)
            if fixed is not None:
                depth = max(depths.values()) - fixed
                if depth < 1:
                    raise ValueError(f"{self.variant} needs a depth >= 1; c_max is {depth + fixed}")
                at_depth = spec.replace(stages=family_stages(self.base, depth))
                found = match_parameters(
                    self.family,
                    at_depth,
                    target,
                    tolerance=self.match_tolerance,
                    max_ratio=self.max_ratio,
                    max_spread=self.max_spread,
                )
                plan = GroupPlan(
                    g[0],
                    g[1],
                    sizes[g],
                    depth,
                    at_depth.replace(widths=found.widths),
                    found.params,
                    target,
                    found.per_stage,
                )
            plans[g] = plan
        self.plans = plans
        super().setup(clients, generator, rounds)

    def describe(self) -> dict[str, Any]:
        """Each group's model: depth (halvings), width ratios, parameters, and for the
        HeteroFL comparison the ScalableFL count it was matched to and the gap left."""
        return {
            "variant": self.variant,
            "groups": {
                plan.name: {
                    "clients": plan.clients,
                    "depth": plan.depth,
                    "widths": [round(w, 6) for w in plan.spec["widths"]],
                    "params": plan.params,
                    "target": plan.target,
                    "gap": round(plan.gap, 6),
                }
                for plan in self.plans.values()
            },
        }

    def group_for(self, info: ClientInfo) -> Group:
        return self.group_of.get(info.cid) or self.group_key(info)

    def plan_of(self, info: ClientInfo) -> GroupPlan:
        group = self.group_for(info)
        if group not in self.plans:
            raise KeyError(
                f"client {info.cid} is in group {group}, which no client had at set-up; the "
                "global model was sized for the groups known then"
            )
        return self.plans[group]

    def spec_for(self, info: ClientInfo) -> Spec:
        return self.plan_of(info).spec

    def index_map_for(self, spec: Spec) -> IndexMap:
        """The shared slices (private BN and head removed); nothing for individual training."""
        return [] if self.variant == "individual" else super().index_map_for(spec)

    # -- round verbs ------------------------------------------------------------------------------
    def group_quota(self, group: Group) -> int:
        """max(1, round(xi * n_group)), halves rounded up."""
        return max(1, math.floor(self.xi * self.plans[group].clients + 0.5))

    def sample(
        self, round: int, available: Sequence[ClientInfo], rng: torch.Generator
    ) -> list[ClientInfo]:
        by_group: dict[Group, list[ClientInfo]] = {}
        for info in available:
            by_group.setdefault(self.group_for(info), []).append(info)
        chosen = [
            info
            for g in sorted(by_group)
            for info in uniform_sample(by_group[g], self.group_quota(g), rng)
        ]
        return sorted(chosen, key=lambda c: c.cid)

    def eval_task(self, info: ClientInfo, evaluated: Mapping[str, State] | None = None) -> EvalTask:
        plan = self.plan_of(info)
        imap = self.index_map_for(plan.spec)
        return EvalTask(
            cid=info.cid,
            spec=plan.spec,
            payload=extract(self.global_state, imap),
            index_map=imap,
            group=plan.name,
        )


class ScalableFLOptions(Options):
    base_size: int = Field(8, ge=1, description="H0: the side of the last feature map")
    base_classes: int = Field(10, ge=2, description="K0: the classes of width ratio 1")
    participation: float | None = Field(
        None, gt=0, le=1, description="xi: share of each group sampled (default: per round)"
    )
    variant: Variant = "scalablefl"
    match_tolerance: float = Field(0.01, ge=0, description="heterofl: one ratio if this close")
    max_ratio: float = Field(4.0, gt=0, description="heterofl: widest ratio considered")
    max_spread: float = Field(
        1.5, ge=1, description="heterofl: per-stage ratios within this factor"
    )


@register_algorithm(
    "scalablefl",
    "ScalableFL (Nitta et al. 2023): depth from input size, width from classes, "
    "private BN and heads",
    ScalableFLOptions,
    needs_scalable=True,
)
def _make(
    family: ModelFamily,
    opts: ScalableFLOptions,
    *,
    clients_per_round: int,
    train: LocalTraining,
) -> tuple[Strategy, ClientHooks]:
    strategy = ScalableFL(family, clients_per_round=clients_per_round, train=train, **dict(opts))
    return strategy, ClientHooks()
