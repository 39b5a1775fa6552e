"""The reducer kinds a method's `reducer` option chooses from: an open registry
(`hetfl.core.kinds`) of `REDUCERS`, each kind a name, its typed options and a function
building the `ReducerFactory` (`hetfl.core.state`) the strategy reduces through.

Built in:

- `mean`: the `Accumulator`'s weighted mean (the method's weighting), no options;
- `median`: the coordinate-wise median over the clients covering each element, no options;
- `trimmed-mean`: the coordinate-wise trimmed mean, option `trim` (the fraction dropped at
  each end, in [0, 0.5]), required;
- `coverage-median`, `coverage-trimmed-mean`: the same statistics with a trim that follows
  each element's coverage and the declared malicious `fraction` (required, in [0, 0.5)),
  and a warning, once, where attackers can be half or more of an element's coverage
  (`hetfl.core.server.robust.CoverageReducer`); `median` and `trimmed-mean` are their naive
  baselines.

- `norm-clip`: updates clipped to `bound` (a positive number, or `median`: the round's
  median update norm), then the weighted mean; `trained-norm-clip`, the same with each
  update's norm measured on what the client trained (each of its tensors once, where it
  was downloaded from, before the method's scaling), not on the upload FedFA's grafting
  repeats and α rescales;
- `krum` (option `f`) and `multi-krum` (`f`, and `m`, 1 <= m <= n − f, default n − f):
  Blanchard et al.'s selection (NeurIPS 2017, §4) over the elements both clients cover,
  then the weighted mean of the kept clients; a round with n <= 2f + 2 valid results takes
  the median (`hetfl.core.server.defences`); `coverage-krum` and `coverage-multi-krum`, the
  same options, score each client within the cells of elements the same clients cover
  (`hetfl.core.server.cell_krum`), where `krum` and `multi-krum` are the naive baselines,
  and warn, once, where f Byzantine clients can be half or more of an element's coverage.

`median` and `trimmed-mean` are Yin et al.'s estimators (ICML 2018, §3, Definitions 1
and 2), unweighted (`hetfl.core.server.robust`). A config writes
`reducer: {kind: trimmed-mean, trim: 0.1}`, or the bare name of a kind without required
options (`reducer: median`).

A robust defence registers its own kind with `register_reducer` on the function that builds
its factory from its options, without editing this module:

    class KrumOptions(KindOptions):
        f: int = Field(ge=0)

    @register_reducer("krum", KrumOptions)
    def _krum(options: KrumOptions) -> ReducerFactory: ...

(its summary goes in `hetfl.catalogue.REDUCERS`; the registering module must be imported
before a config naming the kind is validated). Whatever the kind, the strategy calls it for
every reduction of a round, on what it reduces: after FedFA's per-tensor scaling, and for
FedNova the normalised deltas.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Annotated, Any, TypeVar

from pydantic import Field, PlainSerializer, PlainValidator, field_validator

from hetfl import catalogue
from hetfl.core.kinds import Chosen, Kind, KindOptions, choose, register_kind
from hetfl.core.registry import Registry
from hetfl.core.server.cell_krum import cell_scores
from hetfl.core.server.defences import ClippingReducer, KrumReducer, check_krum
from hetfl.core.server.robust import (
    Breakdown,
    CoordinateReducer,
    CoverageReducer,
    median,
    trimmed_mean,
)
from hetfl.core.state import Accumulator, ReducerFactory

REDUCERS: Registry[Kind[ReducerFactory]] = Registry("reducer")

Build = TypeVar("Build", bound=Callable[..., ReducerFactory])


def register_reducer(
    name: str,
    options: type[KindOptions] = KindOptions,
    *,
    summary: str | None = None,
    summaries: Mapping[str, str] = catalogue.REDUCERS,
) -> Callable[[Build], Build]:
    """Registers the decorated `build(options) -> ReducerFactory` in `REDUCERS` as `name`
    with its `options` model and its `summary` (a plugin's) or else its summary from
    `summaries` (the catalogue); returns it unchanged."""

    def register(build: Build) -> Build:
        register_kind(REDUCERS, name, options, build, summaries=summaries, summary=summary)
        return build

    return register


#: A method option choosing a reducer: validated by `choose` at the config edge, written
#: back as `{kind: name, ...options}`.
ReducerChoice = Annotated[
    Chosen[ReducerFactory],
    PlainValidator(partial(choose, REDUCERS)),
    PlainSerializer(Chosen.describe),
]


class TrimmedMeanOptions(KindOptions):
    trim: float = Field(ge=0.0, le=0.5, description="the fraction dropped at each end")


@register_reducer("mean")
def _mean(options: Any) -> ReducerFactory:
    return Accumulator


@register_reducer("median")
def _median(options: Any) -> ReducerFactory:
    return partial(CoordinateReducer, statistic=median)


@register_reducer("trimmed-mean", TrimmedMeanOptions)
def _trimmed_mean(options: TrimmedMeanOptions) -> ReducerFactory:
    return partial(CoordinateReducer, statistic=trimmed_mean(options.trim))


class CoverageOptions(KindOptions):
    fraction: float = Field(
        ge=0.0,
        lt=0.5,
        allow_inf_nan=False,
        description="the declared malicious fraction: up to ceil(fraction x n) of a "
        "round's n clients may attack",
    )


@register_reducer("coverage-median", CoverageOptions)
def _coverage_median(options: CoverageOptions) -> ReducerFactory:
    return partial(CoverageReducer, fraction=options.fraction, trim=False, breakdown=Breakdown())


@register_reducer("coverage-trimmed-mean", CoverageOptions)
def _coverage_trimmed_mean(options: CoverageOptions) -> ReducerFactory:
    return partial(CoverageReducer, fraction=options.fraction, trim=True, breakdown=Breakdown())


class ClipOptions(KindOptions):
    bound: float | str = Field(
        description="the largest update norm kept: a positive number, or median (the "
        "round's median update norm)"
    )

    @field_validator("bound")
    @classmethod
    def _bound(cls, v: float | str) -> float | str:
        if v == "median" or (isinstance(v, int | float) and 0 < v < float("inf")):
            return v
        raise ValueError(f"bound must be a positive number or 'median', got {v!r}")


class KrumOptions(KindOptions):
    f: int = Field(ge=0, description="the most Byzantine clients a round tolerates")

    def check_clients_per_round(self, n: int) -> None:
        """ValueError unless n > 2f + 2, checked at set-up against the clients per round."""
        check_krum(self.f, n)


class MultiKrumOptions(KrumOptions):
    m: int | None = Field(None, ge=1, description="clients kept, 1 <= m <= n - f (default: n - f)")

    def check_clients_per_round(self, n: int) -> None:
        """Krum's n > 2f + 2, and 1 <= m <= n - f: keeping more than the n − f clients that
        may all be honest keeps a Byzantine one whenever f of them are (Blanchard et al.,
        §4, Multi-Krum)."""
        super().check_clients_per_round(n)
        if self.m is not None and self.m > n - self.f:
            raise ValueError(
                f"Multi-Krum keeps m = {self.m} clients, more than n - f = {n} - {self.f} = "
                f"{n - self.f}: it would keep a Byzantine client whenever f are present; set "
                f"m to at most {n - self.f} (or leave it out for n - f)"
            )


@register_reducer("norm-clip", ClipOptions)
def _norm_clip(options: ClipOptions) -> ReducerFactory:
    return partial(ClippingReducer, bound=options.bound)


@register_reducer("trained-norm-clip", ClipOptions)
def _trained_norm_clip(options: ClipOptions) -> ReducerFactory:
    return partial(
        ClippingReducer, bound=options.bound, measure="trained", kind="trained-norm-clip"
    )


@register_reducer("krum", KrumOptions)
def _krum(options: KrumOptions) -> ReducerFactory:
    return partial(KrumReducer, f=options.f, m=1, kind="krum")


@register_reducer("multi-krum", MultiKrumOptions)
def _multi_krum(options: MultiKrumOptions) -> ReducerFactory:
    return partial(KrumReducer, f=options.f, m=options.m, kind="multi-krum")


@register_reducer("coverage-krum", KrumOptions)
def _coverage_krum(options: KrumOptions) -> ReducerFactory:
    return partial(
        KrumReducer,
        f=options.f,
        m=1,
        kind="coverage-krum",
        scores=cell_scores,
        breakdown=Breakdown(),
    )


@register_reducer("coverage-multi-krum", MultiKrumOptions)
def _coverage_multi_krum(options: MultiKrumOptions) -> ReducerFactory:
    return partial(
        KrumReducer,
        f=options.f,
        m=options.m,
        kind="coverage-multi-krum",
        scores=cell_scores,
        breakdown=Breakdown(),
    )
