"""A declared study (`hetfl.config.study`) run, tracked and reported: `hetfl study run |
status | report`.

Each point (a method at a seed) runs into `<runs>/<study>/<method>-s<seed>` and, once
finished, its records (`summary.json`, `metrics.jsonl`) are copied into the repository's
`results/<study>/`, beside a ledger of the machine time each point took. The report is
computed from those records alone, so every number it publishes can be re-derived from
what the repository holds, and a test regenerates it to check that it still does.

Points run seed by seed (every method at the first seed, then the second), so a study cut
short by its budget or by the end of a working session holds the same seeds for every
method; a finished point is skipped and an interrupted one resumed from its checkpoint.
`run_study(..., seeds=...)` runs only some seeds' points, so that one study's seeds can run
in several processes or on several machines at once, each writing its own points' records
into the one folder (the ledger is updated under a file lock).
"""

from __future__ import annotations

import fcntl
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hetfl.config import ConfigError, RunConfig, load_raw, validate
from hetfl.config.study import Comparison, StudyConfig, load_study, point_config
from hetfl.engine.checkpoint import has_checkpoint
from hetfl.engine.outputs import CLOCKS, Target
from hetfl.paired import (
    PairedDifference,
    RatioReading,
    Rule,
    paired_differences,
    paired_rows,
    ratio_name,
    ratio_of,
    relative_differences,
    unit_of,
)
from hetfl.report import RunRecord, find_runs, format_table

#: The records of a point that the repository keeps (a few kB each for short runs).
RECORDS = ("summary.json", "metrics.jsonl")
LEDGER = "ledger.json"
REPORT = "report.md"
#: The test set a ratio's floor assumes where the points' configs leave `eval.test_samples`
#: unset (the whole test set, whose size only the data knows): Fashion-MNIST's and
#: CIFAR-10's 10,000 images, so a 0 is floored at 0.00005.
ASSUMED_TEST_IMAGES = 10_000


@dataclass(frozen=True)
class Study:
    """A loaded study and where its runs and records live."""

    config: StudyConfig
    runs_dir: Path  # <runs>/<study>: the run folders, checkpoints and all
    records_dir: Path  # results/<study>: what the repository keeps
    #: Each point's validated config, by point name: what `run_study` runs.
    configs: Mapping[str, RunConfig]

    def points(self) -> Iterator[tuple[str, int, str]]:
        """(method, seed, point name), seed by seed."""
        return _points(self.config)

    def ledger(self) -> dict[str, dict[str, float]]:
        path = self.records_dir / LEDGER
        return json.loads(path.read_text()) if path.exists() else {}

    def process_hours(self) -> float:
        """The wall-clock hours the study's runs took, as one process (the ledger's
        `wall_s`; `cpu_s`, this process's and its reaped children's CPU, is kept beside it
        for diagnosis: a fork server's workers are not its children)."""
        return sum(p["wall_s"] for p in self.ledger().values()) / 3600


def _points(config: StudyConfig) -> Iterator[tuple[str, int, str]]:
    """(method, seed, point name), seed by seed."""
    for seed in config.seeds:
        for method in config.methods:
            yield method, seed, f"{method}-s{seed}"


def open_study(
    path: Path, runs_root: Path = Path("runs/studies"), records_root: Path = Path("results")
) -> Study:
    """The study of `path`, each point's config validated now: a method that cannot be
    scored by the study's protocol is refused by name before anything runs."""
    config, base_path = load_study(path)
    base = load_raw(base_path)
    configs = {}
    for method, seed, name in _points(config):
        try:
            configs[name] = validate(point_config(config, base, method, seed, runs_root))
        except ConfigError as exc:
            raise ConfigError(
                f"study {config.name}: method {method!r} cannot run under the study's "
                f"protocol {config.protocol}: {exc}"
            ) from None
    return Study(config, runs_root / config.name, records_root / config.name, configs)


def run_study(study: Study, show_progress: bool = True, seeds: Sequence[int] | None = None) -> int:
    """Run every point not yet recorded (of `seeds` only, where given), resuming
    interrupted ones, until the points are done or the budget is spent; returns the number
    of those points still pending. The budget is the whole study's: points another process
    recorded meanwhile count against it before each point starts."""
    from hetfl.runner import run_one

    cfg = study.config
    if seeds is not None and (unknown := sorted(set(seeds) - set(cfg.seeds))):
        raise ConfigError(
            f"study {cfg.name}: seed(s) {unknown} not among its declared seeds {list(cfg.seeds)}"
        )
    recorded = _recorded(study)
    pending = [
        p for p in study.points() if p[2] not in recorded and (seeds is None or p[1] in seeds)
    ]
    check_scorable(study, pending, show_progress)
    for i, (_, _, name) in enumerate(pending):
        used = study.process_hours()
        if used >= cfg.budget_process_hours:
            print(
                f"study {cfg.name}: budget spent ({used:.2f} of {cfg.budget_process_hours} "
                f"process-hours); {len(pending) - i} point(s) not run",
                file=sys.stderr,
            )
            return len(pending) - i
        if name in _recorded(study):  # recorded meanwhile by another process (`seeds`)
            continue
        run_dir = study.runs_dir / name
        resume = has_checkpoint(run_dir / "checkpoints")
        label = f"[{cfg.name} {i + 1}/{len(pending)} {name}] "
        wall, cpu = time.monotonic(), _cpu_s()
        run_one(
            study.configs[name],
            run_dir,
            resume=resume,
            show_progress=show_progress,
            label=label,
            executor="auto",
        )
        _record(study, name, run_dir, time.monotonic() - wall, _cpu_s() - cpu)
    return 0


def check_scorable(
    study: Study, points: Sequence[tuple[str, int, str]], show_progress: bool = True
) -> None:
    """Each method of `points` set up once (its first point's config) before any point
    runs, so that a method the protocol's evaluation plan cannot score
    (`hetfl.engine.evaluation_plan.build_plan`: no global model under
    `eval.require_global_test`, static BatchNorm with `eval.global_stats_pass: off`) is
    refused by name now, not after the other methods' runs have spent the budget. Set-up
    can take minutes (FedFA's ZiCo queries, kept in the cache the points then read), so it
    shows its progress as a run does."""
    from hetfl.runner import build_simulation

    firsts: dict[str, str] = {}
    for method, _, name in points:
        firsts.setdefault(method, name)
    for method, name in firsts.items():
        with tempfile.TemporaryDirectory() as scratch:
            sim = build_simulation(
                study.configs[name],
                Path(scratch),
                show_progress=show_progress,
                label=f"[{study.config.name} set-up check {method}] ",
            )
            try:
                sim.setup()
            except ValueError as exc:
                raise ConfigError(
                    f"study {study.config.name}: method {method!r} cannot be scored by the "
                    f"study's protocol {study.config.protocol}: {exc}"
                ) from None
            finally:
                sim.executor.close()


def _cpu_s() -> float:
    """CPU seconds of this process and its finished children (the executor's workers)."""
    own, children = (
        resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _recorded(study: Study) -> set[str]:
    """The points whose records and time the repository's folder holds."""
    ledger = study.ledger()
    return {
        name
        for _, _, name in study.points()
        if name in ledger and all((study.records_dir / name / f).exists() for f in RECORDS)
    }


def _record(study: Study, name: str, run_dir: Path, wall_s: float, cpu_s: float) -> None:
    """Copy the finished point's records into the repository's folder, then its time into
    the ledger: read and rewritten under an exclusive lock, so that processes running other
    seeds of the study never drop each other's entries, and written whole (a temporary file
    renamed), so an interrupted write never leaves half a ledger."""
    target = study.records_dir / name
    target.mkdir(parents=True, exist_ok=True)
    for f in RECORDS:
        shutil.copyfile(run_dir / f, target / f)
    folder = os.open(study.records_dir, os.O_RDONLY)  # the lock: no file left behind
    try:
        fcntl.flock(folder, fcntl.LOCK_EX)
        entry = {"wall_s": round(wall_s, 1), "cpu_s": round(cpu_s, 1)}
        ledger = {**study.ledger(), name: entry}
        tmp = study.records_dir / f"{LEDGER}.tmp"
        tmp.write_text(json.dumps(dict(sorted(ledger.items())), indent=1) + "\n")
        tmp.replace(study.records_dir / LEDGER)
    finally:
        os.close(folder)  # closing releases the lock


def status_lines(study: Study) -> list[str]:
    """One line per point (recorded, interrupted with a checkpoint, or pending) and the
    budget used."""
    cfg, ledger, recorded = study.config, study.ledger(), _recorded(study)
    lines = []
    for _, _, name in study.points():
        if name in recorded:
            lines.append(f"  {name}: recorded ({ledger[name]['wall_s'] / 3600:.3f} process-hours)")
        elif has_checkpoint(study.runs_dir / name / "checkpoints"):
            lines.append(f"  {name}: interrupted (resumes from its checkpoint)")
        else:
            lines.append(f"  {name}: pending")
    head = (
        f"study {cfg.name}: {len(recorded)} of {len(lines)} points recorded, "
        f"{study.process_hours():.3f} of {cfg.budget_process_hours} process-hours"
    )
    return [head, *lines]


def _records(study: Study) -> list[RunRecord]:
    """The study's recorded runs: none while its folder holds no run record yet (a study
    declared before its runs, whose folder may hold only its report)."""
    folder = study.records_dir
    if not folder.is_dir() or not any((d / "summary.json").exists() for d in folder.iterdir()):
        return []
    return find_runs([folder])


def ratio_floor(study: Study) -> tuple[float, str]:
    """The floor of a share read as a ratio, half of one of the test images the points are
    scored on (`eval.test_samples`, one for every point: the protocol's), and the words the
    verdict line says it in; `ASSUMED_TEST_IMAGES` where the configs leave it unset."""
    sizes = {config.eval.test_samples for config in study.configs.values()}
    if None in sizes or not sizes:
        n, assumed = ASSUMED_TEST_IMAGES, " (eval.test_samples unset: assumed)"
    else:
        n, assumed = max(s for s in sizes if s is not None), ""
    return 0.5 / n, f"each floored at {0.5 / n:g}, half of one of {n:,} test images{assumed}"


def compared(study: Study) -> list[tuple[Comparison, list[PairedDifference]]]:
    """Each declared comparison with every paired difference its records give (none
    until both methods have one), the records read once."""
    runs, (floor, _) = _records(study), ratio_floor(study)
    return [(c, _differences(runs, c, study.config, floor)) for c in study.config.comparisons]


def _reading(cfg: StudyConfig, c: Comparison) -> tuple[str, str]:
    """The (metric, at) the comparison's verdict reads: its own metric (as a ratio, with
    `reading: ratio`) at the primary's round, or the primary's reading."""
    if c.metric is None:
        return cfg.primary.reading()
    return (ratio_name(c.metric) if c.reading == "ratio" else c.metric), cfg.primary.at


def _verdict_of(
    cfg: StudyConfig, c: Comparison, found: list[PairedDifference]
) -> PairedDifference | None:
    """The difference the comparison's verdict reads, None before a record."""
    return next((d for d in found if (d.metric, d.at) == _reading(cfg, c)), None)


def _differences(
    runs: list[RunRecord], c: Comparison, cfg: StudyConfig, floor: float
) -> list[PairedDifference]:
    """Every paired difference of the comparison's two methods in `runs` (none until both
    have a record), judged by its declared claim; a ratio reading's values floored at
    `floor`."""
    rule = Rule.in_points(c.shape, c.margin, cfg.pilot_sd_points)
    ratio = None if c.metric is None or c.reading != "ratio" else RatioReading(c.metric, floor)
    mine = [r for r in runs if r.group in c.methods()]
    if {r.group for r in mine} != set(c.methods()):
        return []
    if c.a_reference is not None and c.b_reference is not None:
        pairs = (c.a, c.a_reference), (c.b, c.b_reference)
        return relative_differences(mine, *pairs, rule, c.chance_points, ratio)
    target = cfg.primary.target
    targets = [] if target is None else [Target(cfg.primary.metric, target)]
    return paired_differences(mine, c.a, c.b, rule, targets, cfg.primary.clock, ratio)


def verdict_lines(study: Study) -> list[str]:
    """The sentence per comparison that README.md and docs/results.md quote verbatim."""
    return _verdict_lines(study.config, compared(study), ratio_floor(study)[1])


def _claim(c: Comparison, d: PairedDifference, unit: str) -> str:
    """The comparison's claim in words; a ratio's margin also as the ratio declared."""
    claim = d.rule.describe(unit=unit)
    if c.margin_ratio is None:
        return claim
    if c.shape == "non-inferiority":
        return f"{claim}: A/B at most {c.margin_ratio:g}"
    return f"{claim}: A/B below 1/{c.margin_ratio:g}"


def _verdict_lines(
    cfg: StudyConfig, found: list[tuple[Comparison, list[PairedDifference]]], floored: str
) -> list[str]:
    """One line per comparison; `floored` says a ratio reading's floor."""
    lines = []
    for c, every in found:
        label, d = c.label(), _verdict_of(cfg, c, every)
        if d is None:
            lines.append(f"{cfg.name}, {label}: no shared seed recorded yet")
            continue
        timed = d.at == "first reached"
        scale, unit = (1.0, CLOCKS[cfg.primary.clock]) if timed else (100.0, unit_of(d.metric))
        claim = "A reaches it sooner than B" if timed else _claim(c, d, unit)
        low, high = (scale * x for x in d.interval)
        censored = f", censored A {d.censored[0]}, B {d.censored[1]}" if any(d.censored) else ""
        if not timed and (ratio := ratio_of(d)):  # the geometric mean ratio
            ratio_read = c.reading == "ratio"
            censored += (
                f", {d.metric} {ratio}, {floored}" if ratio_read else f", perplexity ratio {ratio}"
            )
        mark = f", {d.mark}" if d.mark else ""
        reading = f"{d.metric} at {d.at}" if c.metric is not None else cfg.primary.describe()
        interval = "no interval at 1 seed" if d.n < 2 else f"95% interval [{low:+.2f}, {high:+.2f}]"
        lines.append(
            f"{cfg.name}, {label} ({claim}, {reading}, {d.n} seeds{censored}): "
            f"**{d.verdict}**{mark}, A - B {scale * d.mean:+.2f} {unit}, {interval}"
        )
    return lines


def report_text(study: Study) -> str:
    """The study's report, from its records alone: the declaration, the machine time, the
    verdict on each declared comparison, then every metric both methods report (not the
    primary reading, so not a verdict on the claim)."""
    cfg, found = study.config, compared(study)
    done, total = len(_recorded(study)), len(list(study.points()))
    primary = [(c.label(), d) for c, e in found if (d := _verdict_of(cfg, c, e)) is not None]
    lines = [
        f"# Study `{cfg.name}`",
        "",
        "Generated by `hetfl study report` from the records in this folder; do not edit.",
        "",
        f"- **Claim** ({cfg.source}): {cfg.claim}",
        "- **Methods**: " + ", ".join(f"`{m}` {o}" for m, o in cfg.methods.items()),
        f"- **Base config**: `{cfg.base}`",
        f"- **Evaluation protocol** (every method): {cfg.protocol or 'the base config as it is'}",
        f"- **Primary metric**: {cfg.primary.describe()}",
        f"- **Seeds**: {cfg.seeds}; **budget** {cfg.budget_process_hours} process-hours, "
        f"**used** {study.process_hours():.3f} ({done} of {total} points recorded)",
        "",
        "## Verdicts",
        "",
        *[f"- {line}" for line in _verdict_lines(cfg, found, ratio_floor(study)[1])],
    ]
    if primary:
        rows = paired_rows([d for _, d in primary])
        labels = [label for label, _ in primary]
        labelled = [{"comparison": c, **r} for c, r in zip(labels, rows, strict=True)]
        lines += ["", format_table(labelled)]
    for c, every in found:
        if every:
            lines += ["", f"## Every metric, {c.label()} (secondary readings)", ""]
            lines.append(format_table(paired_rows(every)))
    return "\n".join(lines) + "\n"


def write_report(study: Study) -> Path:
    study.records_dir.mkdir(parents=True, exist_ok=True)
    path = study.records_dir / REPORT
    path.write_text(report_text(study))
    return path
