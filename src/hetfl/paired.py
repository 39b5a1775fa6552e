"""The paired comparison of two methods over their shared seeds (`hetfl compare --paired`),
with a decision rule fixed before the runs.

A and B each name an algorithm, or a point name without its seed (or its leading part:
`scalablefl-variant=individual`, for variants of one algorithm). Runs pair when they share
a setting (the rest of the point name: `kind=iid` in `flanc-s0-kind=iid` and
`heterofl-s0-kind=iid`) and a seed. For each accuracy
metric (`global_acc`, `local_acc`, `local_acc_stats` and every sub-model's `groups` entry)
at the final round, and at each run's round of best validation accuracy where it has one,
the seed-by-seed differences d = A - B give a mean, a standard error (sample standard
deviation / sqrt(n)) and a verdict on the claim "A is better than B":

- `holds`: the mean is >= 0 and beyond the band max(1 point, 2 standard errors);
- `tie`: the mean is within the band either way;
- `fails`: the mean is below minus the band.

One seed has no standard error: its band is the 1-point floor alone, and the row says n = 1.
A method's sub-models of one size pair whatever the method calls them: `capacity=p`
(FLANC) and `width=p` (HeteroFL, FjORD) are both reported as `p=p`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from hetfl.report import RunRecord, algorithm_of

#: The band's floor: one accuracy point.
ONE_POINT = 0.01
#: How far a mean may pass the band and still be on it: accuracies are ratios of counts,
#: and 0.5 - 0.49 is 0.010000000000000009 in floating point.
ROUNDING = 1e-12
#: The accuracies a paired comparison reads from a metrics row (beside its `groups`).
METRICS = ("global_acc", "local_acc", "local_acc_stats", "local_acc_trained")
Verdict = Literal["holds", "tie", "fails"]


@dataclass(frozen=True)
class PairedDifference:
    """A - B for one setting, metric and round choice, over `n` shared seeds."""

    setting: str
    metric: str
    at: str  # "final" or "best val"
    n: int
    mean: float
    se: float

    @property
    def band(self) -> float:
        """What the mean must exceed to count: max(1 point, 2 standard errors)."""
        return max(ONE_POINT, 2 * self.se)

    @property
    def verdict(self) -> Verdict:
        """holds, tie or fails; a mean on the band (to within float rounding of the
        accuracies, 1e-12) is a tie."""
        if abs(self.mean) <= self.band + ROUNDING:
            return "tie"
        return "holds" if self.mean > 0 else "fails"


def paired_difference(
    setting: str, metric: str, at: str, a: Sequence[float], b: Sequence[float]
) -> PairedDifference:
    """The difference of paired scores `a` and `b` (seed by seed, at least one pair)."""
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else 0.0
    return PairedDifference(setting, metric, at, len(diffs), statistics.fmean(diffs), se)


def _size_name(group: str) -> str:
    """A sub-model's group under one name whichever method reports it (`p=0.5`)."""
    for prefix in ("capacity=", "width="):
        if group.startswith(prefix):
            return "p=" + group.removeprefix(prefix)
    return group


def _scores(row: Mapping[str, Any]) -> dict[str, float]:
    """The accuracies of one metrics row, by metric name (missing ones left out)."""
    out = {m: float(row[m]) for m in METRICS if isinstance(row.get(m), int | float)}
    for group, entry in (row.get("groups") or {}).items():
        if isinstance(entry, Mapping) and isinstance(entry.get("acc"), int | float):
            out[_size_name(group)] = float(entry["acc"])
    return out


def _rows_of(run: RunRecord) -> Iterator[tuple[str, dict[str, float]]]:
    """The run's final scores, then those of its round of best validation accuracy."""
    yield "final", _scores(run.summary.get("final") or {})
    best = run.summary.get("best_by_val")
    if isinstance(best, Mapping):
        row = next((r for r in run.rows if r.get("round") == best.get("round")), best)
        yield "best val", _scores(row)


def _setting(run: RunRecord, name: str) -> str | None:
    """The run's setting as a member of `name` (an algorithm, or a point name without its
    seed, or its leading part: `scalablefl-variant=individual`), None when not a member."""
    if run.group == name or run.group.startswith(name + "-"):
        return run.group.removeprefix(name).lstrip("-") or "(its only setting)"
    if algorithm_of(run) == name:
        return run.group
    return None


def paired_differences(runs: Sequence[RunRecord], a: str, b: str) -> list[PairedDifference]:
    """Every setting, metric and round choice that `a` and `b` (each an algorithm, or a
    point name without its seed, or its leading part) share over at least one seed, in
    the order the settings first appear. A name no run has is an error naming those
    there are."""
    by: dict[str, dict[str, dict[int, RunRecord]]] = {a: {}, b: {}}
    for name in (a, b):
        for r in runs:
            setting = _setting(r, name)
            if setting is not None and r.seed is not None:
                by[name].setdefault(setting, {})[int(r.seed)] = r
        if not by[name]:
            present = sorted({algorithm_of(r) for r in runs} | {r.group for r in runs})
            raise ValueError(
                f"--paired {a} {b}: no runs of {name!r} among the runs given (algorithms "
                f"and settings found: {', '.join(present)})"
            )
    out = []
    for setting, a_runs in by[a].items():
        b_runs = by[b].get(setting, {})
        seeds = sorted(set(a_runs) & set(b_runs))
        if not seeds:
            continue
        a_rows = [dict(_rows_of(a_runs[s])) for s in seeds]
        b_rows = [dict(_rows_of(b_runs[s])) for s in seeds]
        for at in ("final", "best val"):
            if not all(at in r for r in a_rows + b_rows):
                continue
            shared = set.intersection(*(set(r[at]) for r in a_rows + b_rows))
            groups = sorted(shared - set(METRICS), reverse=True)  # widest first
            for metric in [m for m in METRICS if m in shared] + groups:
                out.append(
                    paired_difference(
                        setting,
                        metric,
                        at,
                        [r[at][metric] for r in a_rows],
                        [r[at][metric] for r in b_rows],
                    )
                )
    return out


def paired_rows(differences: Sequence[PairedDifference]) -> list[dict[str, str]]:
    """Table rows, differences and bands in accuracy points."""
    return [
        {
            "setting": d.setting,
            "metric": d.metric,
            "at": d.at,
            "seeds": str(d.n),
            "A - B (points)": f"{100 * d.mean:+.2f}",
            "se": "-" if d.n == 1 else f"{100 * d.se:.2f}",
            "band": f"{100 * d.band:.2f}",
            "verdict": d.verdict,
        }
        for d in differences
    ]
