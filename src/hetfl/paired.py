"""One job: the paired comparison of two methods over their shared seeds (`hetfl compare --paired`),
judged by a rule declared before the runs.

A and B each name an algorithm, or a point name without its seed (or its leading part:
`scalablefl-variant=individual`, for variants of one algorithm). Runs pair when they share
a setting (the rest of the point name: `kind=iid` in `flanc-s0-kind=iid` and
`heterofl-s0-kind=iid`) and a seed. For each accuracy metric (`global_acc`, `pooled_acc`,
`local_acc`, `local_acc_stats`, `local_acc_trained` and every sub-model's `groups` entry) at
the final round, and at each run's round of best validation accuracy where it has one;
for a language model each perplexity (`global_ppl`, `local_ppl`, `local_ppl_trained`) as
ln(B's / A's), in log points (x 100)
(`pooled_acc` pairs only with `pooled_acc`: clients' own splits are not the global test
set); and a backdoor's `attack_success` (the share of triggered test images classified as
its target, lower being better) negated, so that A - B is B's attack success minus A's, in
points, positive when A's is lower; the seed-by-seed differences d = A - B give a mean and
its 95 % confidence interval (Student's t, n - 1 degrees of freedom). The verdict reads the
interval against the claim (`Rule`):

- superiority, "A is better than B" by more than a margin m >= 0 (default 0): `holds` when
  the whole interval is above m, `fails` when it is below m;
- non-inferiority, "A is no worse than B by more than m" (m > 0, declared by the study):
  `holds` when the whole interval is above 0 (A is better), `non-inferior` when it is above
  -m, `fails` when it is below -m;
- `tie` otherwise: the interval holds the margin, and the design cannot tell;
- `inconclusive` with fewer than 3 seeds, whatever the interval (with 2 seeds the 95 %
  interval is 12.7 standard errors to each side: no verdict is worth printing).

Each comparison also states the smallest true difference its design detects with 80 %
power at the interval's level, (t(0.975, n - 1) + t(0.80, n - 1)) s / sqrt(n) (the usual
approximation of the paired t-test's power), with s the declared pilot spread of the
differences where the study gives one, else the observed spread, labelled so. A "tie" with
a detectable effect of 7 points says the design was too small, not that the methods are
equal.

Time to a target (rounds to reach it, fewer is better) pairs the same way, d = rounds of B
- rounds of A (positive: A is faster). A run that never reaches the target is censored:
its time is known only to exceed the rounds it ran, which stand in for it. A verdict is
kept only where every censored time is on the side it already favours (A faster with only
B's runs censored, A slower with only A's: the unknown later times would move the mean
further its way), and is `inconclusive` otherwise; the censored seeds are reported, never
averaged away.

A method's sub-models of one size pair whatever the method calls them: `capacity=p`
(FLANC) and `width=p` (HeteroFL, FjORD) are both reported as `p=p`.

A comparison whose attacked runs (those with malicious clients, `summary.json`'s
`attack.malicious`) have any element beyond a coverage-aware rule's breakdown point in any
round (`summary.json`'s `breakdown.max_share` > 0, `hetfl.engine.breakdown`) is marked
"beyond breakdown (X % of elements)" beside its verdict, X the largest such share among
them: there attackers can be half or more of some element's coverage and no rule can hold,
so a target stated "where attackers are below half of every element's coverage" does not
apply to it, whatever the verdict. Any element counts: the condition is "every element".
Records without the key (older ones, rules that do not count) are not marked.

A lower-is-better share may also be read as a ratio (`RatioReading`, a study's `reading:
ratio`): each value floored, then negated in log as a perplexity is, so that A - B is ln(B's /
A's) in log points under the metric's name with " ratio" after it (`ratio_name`), and "A's
attack success is at most 2x B's" is a non-inferiority claim with margin ln 2 = 69.31 log
points. The floor keeps an attack success of 0 (no triggered image called the target) from
making the log infinite: half of one test image, so that 0 reads as less than one image.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, cast

from hetfl.engine.outputs import CLOCKS, PROBE_METRICS, Target, reached_targets
from hetfl.report import RunRecord, algorithm_of

#: How far an interval's bound may pass the margin and still be on it: accuracies are
#: ratios of counts, and 0.5 - 0.49 is 0.010000000000000009 in floating point.
ROUNDING = 1e-12
#: The accuracies (and a detector's mAPs, read the same way) a paired comparison reads
#: from a metrics row (beside its `groups`).
METRICS = (
    "global_acc",
    "pooled_acc",
    "local_acc",
    "local_acc_stats",
    "local_acc_trained",
    "global_map",
    "local_map",
)
#: The perplexities it reads (language models), each as its negative natural log, so that
#: A - B is ln(B's perplexity / A's) and positive when A is better, as for accuracies; x 100
#: it is in "log points" (about a per-cent difference for small ones), and exp of a mean
#: difference is the geometric mean of the ratios a paper's perplexity table reports.
PERPLEXITIES = ("global_ppl", "local_ppl", "local_ppl_trained")
#: The shares where lower is better (a backdoor's attack success, the probes' metrics),
#: each read negated: A - B is B's minus A's, in points, positive when A's is lower.
LOWER_IS_BETTER = PROBE_METRICS
READ = METRICS + LOWER_IS_BETTER + PERPLEXITIES
#: Fewer shared seeds than this give no verdict.
MIN_SEEDS = 3
#: The confidence level of the interval, and the power the detectable effect is stated at.
LEVEL, POWER = 0.95, 0.80
Shape = Literal["superiority", "non-inferiority"]
SHAPES: tuple[Shape, ...] = ("superiority", "non-inferiority")
Verdict = Literal["holds", "non-inferior", "tie", "fails", "inconclusive", "saturated"]


@dataclass(frozen=True)
class RatioReading:
    """`metric` (a `LOWER_IS_BETTER` share) also read as a log ratio, each value floored at
    `floor` (half of one test image) so that a 0 stays finite."""

    metric: str
    floor: float

    def __post_init__(self) -> None:
        if self.metric not in LOWER_IS_BETTER:
            raise ValueError(
                f"a ratio reads a lower-is-better share ({', '.join(LOWER_IS_BETTER)}), "
                f"not {self.metric!r}"
            )
        if not 0 < self.floor < 1:
            raise ValueError(f"a ratio's floor is a share in (0, 1), not {self.floor}")

    @property
    def name(self) -> str:
        return ratio_name(self.metric)


def ratio_name(metric: str) -> str:
    """The name a share read as a log ratio goes by (`attack_success ratio`)."""
    return f"{metric} ratio"


@dataclass(frozen=True)
class Rule:
    """The claim a comparison tests, declared before its runs: its shape, its margin (in
    the metric's unit: accuracy as a fraction), and the seed-to-seed spread of the
    differences a pilot measured (None: the observed spread, labelled so)."""

    shape: Shape = "superiority"
    margin: float = 0.0
    pilot_sd: float | None = None

    def __post_init__(self) -> None:
        if self.shape not in SHAPES:
            raise ValueError(f"claim {self.shape!r}: one of {', '.join(SHAPES)}")
        if self.shape == "superiority" and not self.margin >= 0:
            raise ValueError(f"a superiority claim's margin is >= 0, not {self.margin}")
        if self.shape == "non-inferiority" and not self.margin > 0:
            raise ValueError(
                "a non-inferiority claim needs its margin (how much worse A may be than B, "
                f"> 0) declared before the runs, not {self.margin}"
            )
        if self.pilot_sd is not None and not self.pilot_sd >= 0:
            raise ValueError(f"the pilot spread is >= 0, not {self.pilot_sd}")

    @classmethod
    def in_points(cls, shape: str, margin: float, pilot_sd: float | None = None) -> Rule:
        """The rule with its margin and pilot spread given in accuracy points, as a study
        file and `hetfl compare` take them."""
        pilot = None if pilot_sd is None else pilot_sd / 100
        return cls(cast(Shape, shape), margin / 100, pilot)  # __post_init__ checks the shape

    def describe(self, scale: float = 100.0, unit: str = "points") -> str:
        """The claim in words, its margin in `unit` (accuracy points by default)."""
        m = f"{scale * self.margin:g} {unit}"
        if self.shape == "superiority":
            return f"A better than B by more than {m} (superiority)"
        return f"A no worse than B by more than {m} (non-inferiority)"


#: Time to a target is judged as a superiority claim of A being faster, margin 0: the
#: declared rule's margin and spread are in accuracy, not rounds.
TIME_RULE = Rule()


@dataclass(frozen=True)
class PairedDifference:
    """A - B for one setting, metric and round choice, seed by seed (`diffs`), judged by
    `rule`; `censored` counts the seeds whose A and whose B run never reached a target
    (time-to-target comparisons only)."""

    setting: str
    metric: str
    at: str  # "final", "best val", or "first reached" for a target
    diffs: tuple[float, ...]
    rule: Rule = Rule()
    censored: tuple[int, int] = (0, 0)
    #: A relative comparison whose A and B both ended at chance (`relative_differences`).
    saturated: bool = False
    #: The largest share of elements beyond the breakdown point among the cell's attacked
    #: runs (`breakdown_share`), None where none has any.
    beyond: float | None = None

    @property
    def mark(self) -> str:
        """What the cell's verdict is read beside: "beyond breakdown (X % of elements)", or
        "" for a cell with no attacked run beyond the breakdown point."""
        if self.beyond is None:
            return ""
        return f"beyond breakdown ({100 * self.beyond:.3g} % of elements)"

    @property
    def n(self) -> int:
        return len(self.diffs)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.diffs)

    @property
    def sd(self) -> float:
        """The observed seed-to-seed spread of the differences (0 for one seed)."""
        return statistics.stdev(self.diffs) if self.n > 1 else 0.0

    @property
    def se(self) -> float:
        return self.sd / math.sqrt(self.n)

    @property
    def interval(self) -> tuple[float, float]:
        """The 95 % confidence interval of the mean difference (Student's t, n - 1
        degrees of freedom); NaN for one seed."""
        if self.n < 2:
            return math.nan, math.nan
        half = _t(0.5 + LEVEL / 2, self.n - 1) * self.se
        return self.mean - half, self.mean + half

    @property
    def detectable(self) -> float:
        """The smallest true difference (from the margin) this design detects with 80 %
        power at the interval's level, from the declared pilot spread where there is one,
        else the observed spread (`detectable_from`); NaN for one seed."""
        if self.n < 2:
            return math.nan
        sd = self.sd if self.rule.pilot_sd is None else self.rule.pilot_sd
        df = self.n - 1
        return (_t(0.5 + LEVEL / 2, df) + _t(POWER, df)) * sd / math.sqrt(self.n)

    @property
    def detectable_from(self) -> str:
        return "observed" if self.rule.pilot_sd is None else "pilot"

    @property
    def verdict(self) -> Verdict:
        if self.saturated:
            return "saturated"
        if self.n < MIN_SEEDS:
            return "inconclusive"
        verdict = interval_verdict(*self.interval, self.rule)
        a_censored, b_censored = self.censored
        if not (a_censored or b_censored):
            return verdict
        # a censored time stands in for a later one: a verdict stands only where the
        # unknown later times would move the mean further its way
        if (verdict == "holds" and not a_censored) or (verdict == "fails" and not b_censored):
            return verdict
        return "inconclusive"


def interval_verdict(low: float, high: float, rule: Rule) -> Verdict:
    if rule.shape == "superiority":
        if low > rule.margin + ROUNDING:
            return "holds"
        if high < rule.margin - ROUNDING:
            return "fails"
        return "tie"
    if low > ROUNDING:
        return "holds"
    if low > -rule.margin + ROUNDING:
        return "non-inferior"
    if high < -rule.margin - ROUNDING:
        return "fails"
    return "tie"


def _t(q: float, df: int) -> float:
    """Student's t quantile (scipy, imported when a comparison is judged)."""
    from scipy.stats import t

    return float(t.ppf(q, df))


def paired_difference(
    setting: str,
    metric: str,
    at: str,
    a: Sequence[float],
    b: Sequence[float],
    rule: Rule = Rule(),
) -> PairedDifference:
    """The difference of paired scores `a` and `b` (seed by seed, at least one pair)."""
    diffs = tuple(x - y for x, y in zip(a, b, strict=True))
    if not diffs:
        raise ValueError("a paired difference needs at least one pair")
    return PairedDifference(setting, metric, at, diffs, rule)


def breakdown_share(runs: Iterable[RunRecord]) -> float | None:
    """The largest `breakdown.max_share` of `summary.json` among the attacked `runs` (with
    malicious clients) where it is above 0; None where none is (a run without the key, an
    older record or a rule that does not count, is not beyond)."""
    shares = [
        float(share)
        for r in runs
        if (r.summary.get("attack") or {}).get("malicious")
        and isinstance(share := (r.summary.get("breakdown") or {}).get("max_share"), int | float)
        and share > 0
    ]
    return max(shares, default=None)


def _size_name(group: str) -> str:
    """A sub-model's group under one name whichever method reports it (`p=0.5`)."""
    for prefix in ("capacity=", "width="):
        if group.startswith(prefix):
            return "p=" + group.removeprefix(prefix)
    return group


def _negated_log(value: Any, floor: float = 0.0) -> float | None:
    """-ln(value) of a lower-is-better positive reading (a perplexity, or a floored share
    read as a ratio), so that A - B is ln(B's / A's); None where there is none to take."""
    if not isinstance(value, int | float) or not math.isfinite(value):
        return None
    value = max(float(value), floor)
    return -math.log(value) if value > 0 else None


def _scores(row: Mapping[str, Any], ratio: RatioReading | None = None) -> dict[str, float]:
    """The accuracies (mAPs), negated attack successes and negated log perplexities of one
    metrics row, by metric name (missing ones left out), and `ratio`'s negated log: every
    one higher is better."""
    out = {m: float(row[m]) for m in METRICS if isinstance(row.get(m), int | float)}
    out |= {m: -float(row[m]) for m in LOWER_IS_BETTER if isinstance(row.get(m), int | float)}
    logs = [(m, m, 0.0) for m in PERPLEXITIES]
    if ratio is not None:
        logs.append((ratio.name, ratio.metric, ratio.floor))
    for name, m, floor in logs:
        if (score := _negated_log(row.get(m), floor)) is not None:
            out[name] = score
    for group, entry in (row.get("groups") or {}).items():
        score = entry.get("acc", entry.get("map")) if isinstance(entry, Mapping) else None
        if isinstance(score, int | float):  # a group's accuracy, or a detector group's mAP
            out[_size_name(group)] = float(score)
    return out


def _rows_of(
    run: RunRecord, ratio: RatioReading | None = None
) -> Iterator[tuple[str, dict[str, float]]]:
    """The run's final scores, then those of its round of best validation accuracy."""
    yield "final", _scores(run.summary.get("final") or {}, ratio)
    best = run.summary.get("best_by_val")
    if isinstance(best, Mapping):
        row = next((r for r in run.rows if r.get("round") == best.get("round")), best)
        yield "best val", _scores(row, ratio)


def _time_to(run: RunRecord, target: Target, clock: str = "round") -> tuple[float, bool]:
    """When `run` first met `target`, by `clock` (a `CLOCKS` key), or, where it never
    did, how long it ran (a lower bound of the time it would have taken) and True:
    censored. A run without a simulated clock has no simulated time: an error naming it."""
    if not run.rows or run.rows[-1].get(clock) is None:
        raise ValueError(f"{run.path}: no {clock} in its metrics rows to count a target by")
    (hit,) = reached_targets(run.rows, [target])
    if hit["round"] is None:
        return float(run.rows[-1][clock]), True
    return float(hit[clock]), False


def _setting(run: RunRecord, name: str) -> str | None:
    """The run's setting as a member of `name` (an algorithm, or a point name without its
    seed, or its leading part: `scalablefl-variant=individual`), None when not a member."""
    if run.group == name or run.group.startswith(name + "-"):
        return run.group.removeprefix(name).lstrip("-") or "(its only setting)"
    if algorithm_of(run) == name:
        return run.group
    return None


def paired_differences(
    runs: Sequence[RunRecord],
    a: str,
    b: str,
    rule: Rule = Rule(),
    targets: Sequence[Target] = (),
    clock: str = "round",
    ratio: RatioReading | None = None,
) -> list[PairedDifference]:
    """Every setting, metric and round choice that `a` and `b` (each an algorithm, or a
    point name without its seed, or its leading part) share over at least one seed, in
    the order the settings first appear, judged by `rule` (with `ratio`, its metric's log
    ratio too, after the other metrics); then, per target, the rounds each took to reach it
    (`TIME_RULE`). A name no run has is an error naming those there are."""
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
        a_rows = [dict(_rows_of(a_runs[s], ratio)) for s in seeds]
        b_rows = [dict(_rows_of(b_runs[s], ratio)) for s in seeds]
        beyond = breakdown_share([*(a_runs[s] for s in seeds), *(b_runs[s] for s in seeds)])
        for at in ("final", "best val"):
            if not all(at in r for r in a_rows + b_rows):
                continue
            shared = set.intersection(*(set(r[at]) for r in a_rows + b_rows))
            logs = [ratio.name] if ratio is not None and ratio.name in shared else []
            groups = sorted(shared - set(READ) - set(logs), reverse=True)  # widest first
            for metric in [m for m in READ if m in shared] + logs + groups:
                d = paired_difference(
                    setting,
                    metric,
                    at,
                    [r[at][metric] for r in a_rows],
                    [r[at][metric] for r in b_rows],
                    rule,
                )
                out.append(replace(d, beyond=beyond))
        for target in targets:
            a_times = [_time_to(a_runs[s], target, clock) for s in seeds]
            b_times = [_time_to(b_runs[s], target, clock) for s in seeds]
            out.append(
                PairedDifference(
                    setting,
                    f"{CLOCKS[clock]} to {target.metric}>={target.value:g}",
                    "first reached",
                    tuple(tb - ta for (ta, _), (tb, _) in zip(a_times, b_times, strict=True)),
                    TIME_RULE,
                    (sum(c for _, c in a_times), sum(c for _, c in b_times)),
                    beyond=beyond,
                )
            )
    return out


#: How close to chance (in points) both methods' means must end for a relative cell to be
#: saturated.
SATURATED_POINTS = 5.0


def relative_differences(
    runs: Sequence[RunRecord],
    a: tuple[str, str],
    b: tuple[str, str],
    rule: Rule = Rule(),
    chance_points: float | None = None,
    ratio: RatioReading | None = None,
) -> list[PairedDifference]:
    """(A - A's reference) - (B - B's reference), seed by seed, for every setting, metric
    and round choice the four share (`a` and `b` are (method, reference) pairs): B's drop
    minus A's (with `ratio`, its metric's log ratio too). With `chance_points`, a cell where
    A's and B's means both end within `SATURATED_POINTS` of chance is marked saturated (an
    accuracy's cell: an attack success or a log ratio has no chance level in accuracy
    points)."""
    seeds = set.intersection(
        *({int(r.seed) for r in runs if r.seed is not None and _setting(r, n)} for n in (*a, *b))
    )
    mine = [r for r in runs if r.seed is not None and int(r.seed) in seeds]
    if not seeds:
        return []

    def between(x: str, y: str) -> list[PairedDifference]:
        return paired_differences(mine, x, y, rule, ratio=ratio)

    raw = {(d.setting, d.metric, d.at): d for d in between(a[0], b[0])}
    b_drops = {(d.setting, d.metric, d.at): d for d in between(*b)}
    out = []
    for d in between(*a):
        key = (d.setting, d.metric, d.at)
        other, across = b_drops.get(key), raw.get(key)
        if other is None or other.n != d.n or across is None:
            continue
        diffs = tuple(x - y for x, y in zip(d.diffs, other.diffs, strict=True))
        saturated = False
        if (
            chance_points is not None
            and unit_of(d.metric) == "points"
            and d.metric not in LOWER_IS_BETTER
        ):
            a_mean = _mean_score(mine, a[0], d.metric, d.at)
            b_mean = a_mean - across.mean
            saturated = all(100 * m <= chance_points + SATURATED_POINTS for m in (a_mean, b_mean))
        beyond = max((x for x in (d.beyond, other.beyond) if x is not None), default=None)
        out.append(replace(d, diffs=diffs, saturated=saturated, beyond=beyond))
    return out


def _mean_score(runs: Sequence[RunRecord], name: str, metric: str, at: str) -> float:
    scores = [dict(_rows_of(r)).get(at, {}).get(metric) for r in runs if _setting(r, name)]
    return statistics.fmean(x for x in scores if x is not None)


def unit_of(metric: str) -> str:
    """The unit a difference of `metric` is printed in (x 100)."""
    ratios = {ratio_name(m) for m in LOWER_IS_BETTER}
    return "log points" if metric in PERPLEXITIES or metric in ratios else "points"


def ratio_of(d: PairedDifference) -> str:
    """The geometric mean ratio a log-point difference stands for: B's over A's for a
    perplexity (above 1: A better), A's over B's for a share read as a ratio (as the claim
    "at most 2x B's" reads); "" for a difference in points."""
    if d.metric in PERPLEXITIES:
        return f"B/A {math.exp(d.mean):.3f}"
    if unit_of(d.metric) == "log points":
        return f"A/B {math.exp(-d.mean):.3f}"
    return ""


def paired_rows(differences: Sequence[PairedDifference]) -> list[dict[str, str]]:
    """Table rows: accuracy differences, intervals and detectable effects in accuracy
    points, times in rounds (positive: A reached the target sooner)."""
    rows = []
    for d in differences:
        is_time = d.at == "first reached"
        scale, sign = (1.0, "{:+.1f}") if is_time else (100.0, "{:+.2f}")
        low, high = d.interval
        seeds = str(d.n)
        if any(d.censored):
            seeds += f" (censored: A {d.censored[0]}, B {d.censored[1]})"
        difference = sign.format(scale * d.mean)
        if d.metric not in PERPLEXITIES and (ratio := ratio_of(d)):  # a share's ratio
            difference += f" ({ratio})"
        rows.append(
            {
                "setting": d.setting,
                "metric": d.metric,
                "at": d.at,
                "seeds": seeds,
                "A - B": difference,
                "95% interval": "-"
                if d.n < 2
                else f"[{sign.format(scale * low)}, {sign.format(scale * high)}]",
                "detectable (80%)": "-"
                if d.n < 2
                else f"{scale * d.detectable:.2f} ({d.detectable_from})",
                "verdict": f"{d.verdict}, {d.mark}" if d.mark else d.verdict,
            }
        )
    return rows
