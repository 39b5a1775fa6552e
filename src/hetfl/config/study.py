"""One job: a study file (`studies/<name>.yaml`) to a validated, frozen `StudyConfig`.

A study is a comparison declared before its runs: the paper's claim quoted, the methods
and their configs, the one evaluation protocol every method is scored by, the primary
metric and reading, the claim's shape and margin, the seeds and the budget. Declaring
these first is what makes a verdict a test rather than a reading chosen after the numbers
were seen; `hetfl.study` runs, tracks and reports it.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from hetfl.config.loading import format_errors, load_raw, set_dotted
from hetfl.config.sections import ConfigError, _Strict
from hetfl.engine.outputs import CLOCKS, TARGET_METRICS
from hetfl.paired import LOWER_IS_BETTER, READ, ratio_name

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
    saturated: the attack left nothing to compare.

    `metric` names the comparison's own metric (read at the primary's `at`; default the
    primary's reading). `reading: ratio` reads a lower-is-better share (a backdoor's
    `attack_success`) as the log of A's over B's, negated like a perplexity, so that "A's
    attack success is at most r times B's" is a non-inferiority claim with `margin_ratio`
    r > 1 (ln r, in log points)."""

    a: str
    b: str
    shape: Literal["superiority", "non-inferiority"] = "superiority"
    margin_points: float = 0.0
    a_reference: str | None = None
    b_reference: str | None = None
    chance_points: float | None = Field(default=None, ge=0, le=100)
    metric: str | None = None
    reading: Literal["difference", "ratio"] = "difference"
    margin_ratio: float | None = Field(default=None, gt=1)

    @model_validator(mode="after")
    def _references_paired(self) -> Comparison:
        if (self.a_reference is None) != (self.b_reference is None):
            raise ValueError("a_reference and b_reference go together (each method's own)")
        if self.chance_points is not None and self.a_reference is None:
            raise ValueError("chance_points marks saturated cells of a comparison with references")
        return self

    @model_validator(mode="after")
    def _reading(self) -> Comparison:
        if self.metric is not None and self.metric not in READ and not self.metric.startswith("p="):
            raise ValueError(
                f"metric {self.metric!r}: one of {', '.join(READ)} or a sub-model's p=<size>"
            )
        if self.reading == "difference" and self.margin_ratio is not None:
            raise ValueError("margin_ratio is the margin of `reading: ratio`; use margin_points")
        if self.reading == "ratio":
            if self.metric not in LOWER_IS_BETTER:
                raise ValueError(
                    "reading: ratio reads a share where lower is better, named as the "
                    f"comparison's metric ({', '.join(LOWER_IS_BETTER)}), not {self.metric!r}: "
                    "a perplexity is already read as a log ratio, an accuracy as a difference"
                )
            if self.margin_points != 0:
                raise ValueError(
                    "a ratio reading's margin is margin_ratio (A's over B's, > 1), "
                    "not margin_points"
                )
        return self

    @property
    def margin(self) -> float:
        """The claim's margin in the reading's points: ln(margin_ratio) x 100 log points for a
        ratio (69.31 for 2x), else margin_points."""
        if self.margin_ratio is not None:
            return 100 * math.log(self.margin_ratio)
        return self.margin_points

    def methods(self) -> tuple[str, ...]:
        """Every method the comparison reads."""
        refs = () if self.a_reference is None else (self.a_reference, self.b_reference)
        return (self.a, self.b, *(r for r in refs if r is not None))

    def label(self) -> str:
        """The comparison in a report: its methods, and its own metric where it names one
        (another comparison of the same methods may read the primary)."""
        pair = f"{self.a} vs {self.b}"
        if self.metric is not None:
            pair += f" on {ratio_name(self.metric) if self.reading == 'ratio' else self.metric}"
        if self.a_reference is None:
            return pair
        return f"{pair}, each relative to {self.a_reference} / {self.b_reference}"


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
            if c.shape == "non-inferiority" and c.margin <= 0:
                declared = "margin_ratio > 1" if c.reading == "ratio" else "margin_points > 0"
                raise ValueError(
                    f"comparisons[{i}]: a non-inferiority claim needs {declared}, "
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
