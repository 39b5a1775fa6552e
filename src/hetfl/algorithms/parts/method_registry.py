"""The algorithm registry: each method module registers its strategy, its local-training
recipe and its typed options, so that the CLI, the config validator and the tests can
enumerate them.

A method registers with one decorator per name on its `make` function,
`@register_algorithm(name, OptionsClass)`; methods that share a `make` (FedAvg, FedBN,
FedPer) stack one decorator per name. Registering a name twice is an error. A built-in
method's one-line summary is written once, in `hetfl.catalogue` (what `hetfl list` prints
without importing torch), and read from there at registration: a name missing from the
catalogue cannot register. A plugin's method (`hetfl.core.plugins`, docs/plugins.md)
carries its own, `register_algorithm(name, Options, summary="...")`.

An algorithm's options are a pydantic model (validated at the config edge, unknown keys
refused); `make` turns them into explicit constructor arguments — a method never sees the
whole config.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from hetfl import catalogue
from hetfl.core.client.recipe import LocalRecipe
from hetfl.core.kinds import choose
from hetfl.core.pricing import PassPricing, SplitPricing
from hetfl.core.registry import Registry
from hetfl.core.server.assign import CyclicSampling, UniformSampling
from hetfl.core.server.reducers import REDUCERS, ReducerChoice
from hetfl.core.server.strategy import Strategy
from hetfl.core.server.weighting import WeightingName
from hetfl.core.training import LocalTraining
from hetfl.core.types import ModelFamily

#: The kind of model a method requires (`Algorithm.needs`).
ModelKind = Literal["any", "scalable", "composed", "split"]

#: The `weighting` option with its description, for every method that weights clients (a
#: method that changes its default keeps the description).
WeightingOption = Annotated[
    WeightingName,
    Field(
        description="each client's weight in the average: samples, its training-sample count "
        "(FedAvg's p_k), or uniform, 1 each"
    ),
]


class Options(BaseModel):
    """Base of every algorithm's options: frozen, unknown keys refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ReducerOptions(Options):
    """How a method that averages client tensors reduces them: `reducer`, a kind of
    `hetfl.core.server.reducers.REDUCERS` with its own options, `{kind: trimmed-mean, trim: 0.1}`,
    or a bare kind name, `median`; `mean`, the weighted mean, by default. Every reduction of
    a round uses it, FedNova's normalised deltas included. The trimmed mean's `trim` belongs
    to the reducer: a `trim` beside `reducer` (the earlier form) is refused with the new one."""

    reducer: ReducerChoice = Field(
        default_factory=partial(choose, REDUCERS, "mean"),
        description="how every reduction of a round combines the clients' tensors: mean, "
        "weighted by the method's weighting, or a robust kind such as median or trimmed-mean "
        "(unweighted)",
    )

    @model_validator(mode="before")
    @classmethod
    def _trim_is_the_reducers(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and "trim" in data:
            raise ValueError(
                "trim is an option of the trimmed-mean reducer, not of the method; write "
                f"reducer: {{kind: trimmed-mean, trim: {data['trim']!r}}}"
            )
        return data


class AggregationOptions(ReducerOptions):
    """The reducer, the clients' weights (`hetfl.core.server.weighting`): by training-sample
    count (FedAvg's p_k, the default) or `uniform`, and how clients are sampled:
    `uniform`, afresh each round (FedAvg's Algorithm 1), or `cyclic`, uniformly without
    replacement across rounds (`hetfl.core.server.assign.CyclicSampling`)."""

    weighting: WeightingOption = "samples"
    sampling: Literal["uniform", "cyclic"] = Field(
        "uniform",
        description="how a round's clients are drawn: uniform, afresh each round, or cyclic, "
        "without replacement across rounds (each client once before any twice)",
    )

    def sampler(self, clients_per_round: int) -> UniformSampling | CyclicSampling:
        if self.sampling == "cyclic":
            return CyclicSampling(clients_per_round)
        return UniformSampling(clients_per_round)


@dataclass(frozen=True)
class Algorithm:
    """`make(family, options, clients_per_round=..., train=...)` -> (strategy, local recipe).

    `needs` names the kind of model the method requires, so that a config pairing it with
    another fails at validation: `scalable` for methods that slice sub-models or keep
    normalisation private, `composed` for FLANC's composed layers, `split` for split
    learning (a model cut into modules, `hetfl.models.resnet_cifar`), `any` otherwise.

    `simulator_only`, when set, says why the method runs in the simulator only (split
    learning's per-batch exchange with the server, FedGKT's round-level server phase):
    `hetfl serve` and the Flower server refuse it before anything starts, with this
    reason (`hetfl.core.simulator_only.refuse_simulator_only`).

    `needs_costs` marks a method that plans from the cost model (DTFL's tier scheduler): its
    `make` also takes `costs`, a `hetfl.core.pricing.SplitPricing` the face builds from
    the run's device profiles, and a run without profiles cannot build it. `needs_macs`
    marks a method that prices its candidate models by their MACs (FedFA's architecture
    choice): its `make` also takes `macs`, a `hetfl.core.pricing.PassPricing` the face
    builds from the model family (`hetfl.systems.costs.MacCounter`).
    """

    name: str
    summary: str
    options: type[Options]
    make: Callable[..., tuple[Strategy, LocalRecipe]]
    needs: ModelKind = "any"
    simulator_only: str | None = None
    needs_costs: bool = False
    needs_macs: bool = False

    def build(
        self,
        family: ModelFamily,
        options: dict[str, Any] | Options | None,
        *,
        clients_per_round: int,
        train: LocalTraining,
        costs: SplitPricing | None = None,
        macs: PassPricing | None = None,
    ) -> tuple[Strategy, LocalRecipe]:
        """The method's strategy and recipe; `costs` reaches `make` only when the method
        `needs_costs`, `macs` only when it `needs_macs`, and each must then be given."""
        opts = options if isinstance(options, Options) else self.options(**(options or {}))
        priced: dict[str, SplitPricing | PassPricing] = {}
        if self.needs_costs:
            if costs is None:
                raise ValueError(
                    f"{self.name} plans from the clients' simulated times and the cost model: "
                    "add a system: section with device profiles (e.g. system: {preset: dtfl})"
                )
            priced["costs"] = costs
        if self.needs_macs:
            if macs is None:
                raise ValueError(
                    f"{self.name} prices its candidate models by their MACs: pass "
                    "macs=hetfl.systems.costs.MacCounter(family)"
                )
            priced["macs"] = macs
        return self.make(family, opts, clients_per_round=clients_per_round, train=train, **priced)


ALGORITHMS: Registry[Algorithm] = Registry("algorithm")


Make = TypeVar("Make", bound=Callable[..., tuple[Strategy, LocalRecipe]])


def register_algorithm(
    name: str,
    options: type[Options],
    *,
    needs: ModelKind = "any",
    simulator_only: str | None = None,
    needs_costs: bool = False,
    needs_macs: bool = False,
    summary: str | None = None,
    summaries: Mapping[str, str] = catalogue.ALGORITHMS,
) -> Callable[[Make], Make]:
    """Registers the decorated `make` in `ALGORITHMS` as `name`, with its `summary` (a
    plugin's) or else its summary from `summaries` (the catalogue, for a built-in method),
    and returns it unchanged, so decorators stack: one per name that `make` builds. `needs`,
    `simulator_only`, `needs_costs` and `needs_macs` are `Algorithm`'s. A taken name raises
    ValueError; a name without a summary, KeyError."""
    if summary is None:
        if name not in summaries:
            raise KeyError(
                f"algorithm {name!r} has no summary in hetfl.catalogue.ALGORITHMS; add its "
                "one-line summary there (what `hetfl list` prints), or, in a plugin, pass "
                "it: register_algorithm(name, Options, summary='...')"
            )
        summary = summaries[name]
    described = summary

    def register(make: Make) -> Make:
        algorithm = Algorithm(
            name, described, options, make, needs, simulator_only, needs_costs, needs_macs
        )
        ALGORITHMS.register(name, algorithm)
        return make

    return register
