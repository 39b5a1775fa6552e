"""One job: a study file (`studies/<name>.yaml`) to a validated, frozen `StudyConfig`.

A study is a comparison declared before its runs: the paper's claim quoted, the methods
and their configs, the one evaluation protocol every method is scored by, the primary
metric and reading, the claim's shape and margin, the seeds and the budget. Declaring
these first is what makes a verdict a test rather than a reading chosen after the numbers
were seen; `hetfl.study` runs, tracks and reports it.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from hetfl.config.loading import format_errors, load_raw, set_dotted
from hetfl.config.sections import ConfigError, _Strict
from hetfl.engine.outputs import CLOCKS, TARGET_METRICS

#: A method's name is its run folders' name before `-s<seed>`, which must be found
#: unambiguously: no `-s<digit>` inside it.
_NAME = re.compile(r"^(?!.*-s\d)[a-z0-9_.=-]+$")
_NAME_RULE = "lower-case letters, digits, '_', '.', '=' and '-', never '-s<digit>'"
#: Keys a study's protocol may set: how every method is scored, and nothing else.
PROTOCOL_PREFIXES = ("eval.", "targets")


class Comparison(_Strict):
    """A - B judged on the study's primary metric: a superiority claim ("A is better than
    B by more than the margin", 0 by default) or a non-inferiority claim ("A is no worse
    than B by more than the margin", which must then be declared).

    With `a_reference` and `b_reference` (each a method of the study, e.g. the clean run
    of an attacked one), each method is read relative to its reference on the same seed:
    A - B becomes (A - A's reference) - (B - B's reference), i.e. B's drop minus A's, a
    robustness claim ("A loses less than B"). `chance_points` (the accuracy of a guess, in
    points) then marks a cell where A and B both end within `SATURATED_POINTS` of it as
    saturated: the attack left nothing to compare."""

    a: str
    b: str
    shape: Literal["superiority", "non-inferiority"] = "superiority"
    margin_points: float = 0.0
    a_reference: str | None = None
    b_reference: str | None = None
    chance_points: float | None = Field(default=None, ge=0, le=100)

    @model_validator(mode="after")
    def _references_paired(self) -> Comparison:
        if (self.a_reference is None) != (self.b_reference is None):
            raise ValueError("a_reference and b_reference go together (each method's own)")
        if self.chance_points is not None and self.a_reference is None:
            raise ValueError("chance_points marks saturated cells of a comparison with references")
        return self

    def methods(self) -> tuple[str, ...]:
        """Every method the comparison reads."""
        refs = () if self.a_reference is None else (self.a_reference, self.b_reference)
        return (self.a, self.b, *(r for r in refs if r is not None))

    def label(self) -> str:
        if self.a_reference is None:
            return f"{self.a} vs {self.b}"
        return f"{self.a} vs {self.b}, each relative to {self.a_reference} / {self.b_reference}"


class Primary(_Strict):
    """The metric a verdict is read from, fixed before the runs: an accuracy of the
    metrics rows (or a sub-model's `p=<width>`) at the final round or at the round of best
    validation accuracy; or, with `target`, the time each method took to reach
    `metric >= target`, in rounds or in simulated seconds (`clock`; fewer is better; a run
    that never did is censored)."""

    metric: str
    at: Literal["final", "best val"] = "final"
    target: float | None = None
    clock: Literal["round", "sim_time_s"] = "round"

    @model_validator(mode="after")
    def _target_metric(self) -> Primary:
        if self.target is not None and self.metric not in TARGET_METRICS:
            raise ValueError(
                f"metric {self.metric!r} with a target: one of {', '.join(TARGET_METRICS)}"
            )
        return self

    def reading(self) -> tuple[str, str]:
        """The (metric, at) of the paired difference the verdict reads."""
        if self.target is None:
            return self.metric, self.at
        return f"{CLOCKS[self.clock]} to {self.metric}>={self.target:g}", "first reached"

    def describe(self) -> str:
        if self.target is None:
            return f"{self.metric} at {self.at}"
        return f"{CLOCKS[self.clock]} to {self.metric} >= {self.target:g}"


class StudyConfig(_Strict):
    name: str
    claim: str = Field(min_length=1)
    source: str = Field(min_length=1)
    base: str
    methods: dict[str, dict[str, Any]] = Field(min_length=2)
    protocol: dict[str, Any] = Field(default_factory=dict)
    primary: Primary
    comparisons: list[Comparison] = Field(min_length=1)
    seeds: list[int] = Field(min_length=3)
    budget_process_hours: float = Field(gt=0)
    pilot_sd_points: float | None = Field(default=None, ge=0)

    @field_validator("name")
    @classmethod
    def _plain_name(cls, name: str) -> str:
        if not _NAME.match(name):
            raise ValueError(_NAME_RULE)
        return name

    @field_validator("methods")
    @classmethod
    def _methods(cls, methods: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        for name, overrides in methods.items():
            if not _NAME.match(name):
                raise ValueError(f"{name!r}: {_NAME_RULE} (its run folders' name)")
            scoring = [k for k in overrides if k.startswith(PROTOCOL_PREFIXES) or k == "seed"]
            if scoring:
                raise ValueError(
                    f"{name} sets {', '.join(scoring)}: every method is scored by the study's "
                    "one protocol and runs the study's seeds"
                )
        return methods

    @field_validator("seeds")
    @classmethod
    def _distinct(cls, seeds: list[int]) -> list[int]:
        if len(set(seeds)) != len(seeds):
            raise ValueError(f"seeds repeat: {seeds}")
        return seeds

    @field_validator("protocol")
    @classmethod
    def _scoring_only(cls, protocol: dict[str, Any]) -> dict[str, Any]:
        other = [k for k in protocol if not k.startswith(PROTOCOL_PREFIXES)]
        if other:
            raise ValueError(
                f"{', '.join(other)}: a protocol sets how every method is scored (keys "
                f"starting {', '.join(PROTOCOL_PREFIXES)}); put training settings in `base` "
                "or a method"
            )
        return protocol

    @model_validator(mode="after")
    def _consistent(self) -> StudyConfig:
        for i, c in enumerate(self.comparisons):
            unknown = [m for m in c.methods() if m not in self.methods]
            if unknown:
                raise ValueError(
                    f"comparisons[{i}] names {', '.join(unknown)}, not a method of the study "
                    f"({', '.join(self.methods)})"
                )
            if c.a_reference is not None and self.primary.target is not None:
                raise ValueError(
                    f"comparisons[{i}]: a comparison relative to references reads an accuracy "
                    "at a round, not a time to a target"
                )
            if c.shape == "superiority" and c.margin_points < 0:
                raise ValueError(f"comparisons[{i}].margin_points: >= 0 for a superiority claim")
            if c.shape == "non-inferiority" and c.margin_points <= 0:
                raise ValueError(
                    f"comparisons[{i}]: a non-inferiority claim needs margin_points > 0, "
                    "declared before the runs"
                )
        return self


def load_study(path: Path) -> tuple[StudyConfig, Path]:
    """The study declared in `path`, and its base config's path (relative to the file)."""
    raw = load_raw(path)
    try:
        study = StudyConfig.model_validate(raw)
    except ValidationError as exc:
        message = format_errors(exc, raw).replace("invalid configuration", f"invalid study {path}")
        raise ConfigError(message) from None
    base = (path.resolve().parent / study.base).resolve()
    if not base.is_file():
        raise ConfigError(f"study {path}: base: no config file {base}")
    return study, base


def point_config(
    study: StudyConfig, base: Mapping[str, Any], method: str, seed: int, output_dir: Path
) -> dict[str, Any]:
    """The raw config of one point: the base, then the method's settings, then the
    protocol (which no method may change), then the seed, the study's name and folder.
    The base is copied whole: a method's nested setting never reaches another's point."""
    raw = copy.deepcopy({k: v for k, v in base.items() if k != "sweep"})
    for key, value in (*study.methods[method].items(), *study.protocol.items()):
        set_dotted(raw, key, value)
    raw.update(seed=seed, name=study.name, output_dir=str(output_dir))
    return raw
