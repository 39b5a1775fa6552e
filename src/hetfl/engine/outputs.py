"""The run-output contract (docs/contracts.md §1.7): `metrics.jsonl` rows and `summary.json`;
the per-client trace `clients.jsonl` is `hetfl.engine.trace`'s.

Every row has every key of `ROW_KEYS` (null where it does not apply), so other tools can
read any run without knowing its method. Both files of rows are `JsonLines`: appended as
rounds end, cleared on a fresh start, cut back to the checkpoint's round on resume.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

ROW_KEYS = (
    "round",
    "clients",
    "failed",
    "global_acc",
    "test_loss",
    "pooled_acc",
    "pooled_loss",
    "local_acc",
    "local_acc_stats",
    "local_acc_trained",
    "val_acc",
    "val_loss",
    "attack_success",
    "global_ppl",
    "local_ppl",
    "local_ppl_trained",
    "global_map",
    "local_map",
    "loss",
    "bytes_down",
    "bytes_up",
    "macs",
    "sim_time_s",
    "wall_time_s",
    "groups",
    "defence",
)
#: The metrics.jsonl keys a probe fills (`hetfl.core.probe`), null without one.
PROBE_METRICS = ("attack_success",)
#: Metrics where larger is better; every other scalar metric is better when smaller
#: (`attack_success` too: its best is its lowest, the defence's view).
HIGHER_IS_BETTER = (
    "global_acc",
    "pooled_acc",
    "local_acc",
    "local_acc_stats",
    "local_acc_trained",
    "val_acc",
    "global_map",
    "local_map",
)
#: The metrics.jsonl keys a target may watch (config `targets`, `hetfl compare --target`).
TARGET_METRICS = (
    "global_acc",
    "pooled_acc",
    "local_acc",
    "local_acc_trained",
    "val_acc",
    "loss",
    "test_loss",
    "val_loss",
    "global_ppl",
    "local_ppl",
    "local_ppl_trained",
    "global_map",
    "local_map",
)
#: How a time to a target is counted (`hetfl.paired`, a study's primary): in rounds, or in
#: simulated seconds (the run's `system:` clock), each with the label its rows carry.
CLOCKS = {"round": "rounds", "sim_time_s": "sim s"}
_BEST = (
    "global_acc",
    "pooled_acc",
    "local_acc",
    "local_acc_stats",
    "local_acc_trained",
    "test_loss",
    "loss",
    "val_acc",
    "val_loss",
    "attack_success",
    "global_ppl",
    "local_ppl",
    "local_ppl_trained",
    "global_map",
    "local_map",
)
#: What `best_by_val` reports of the row it selects.
_BY_VAL = ("round", "val_acc", "global_acc", "pooled_acc", "local_acc", "test_loss")


@dataclass(frozen=True)
class Target:
    metric: str
    value: float


def make_row(**values: Any) -> dict[str, Any]:
    unknown = set(values) - set(ROW_KEYS)
    if unknown:
        raise KeyError(f"not metrics.jsonl keys: {sorted(unknown)}")
    return {k: values.get(k) for k in ROW_KEYS}


class RowSink(Protocol):
    """Somewhere else the metrics rows go (experiment tracking: `hetfl.engine.tracking`),
    fed by `MetricsLog` with exactly the rows of `metrics.jsonl`."""

    def append(self, row: dict[str, Any]) -> None:
        """Record one new row."""

    def rewrite(self, rows: Sequence[dict[str, Any]]) -> None:
        """Replace everything recorded so far with `rows` (a fresh start: none; a resume:
        the rows `metrics.jsonl` keeps)."""

    def close(self) -> None:
        """Flush and release what the sink holds open."""


class JsonLines:
    """An append-only file of JSON rows, each with a `round`: appended as rounds end,
    removed on a fresh start, cut back to a checkpoint's round on resume."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def append(self, rows: Sequence[dict[str, Any]]) -> None:
        """Add rows, flushed at once (a run killed later keeps them)."""
        with open(self.path, "a") as fh:
            fh.write("".join(json.dumps(row) + "\n" for row in rows))
            fh.flush()

    def read(self) -> list[dict[str, Any]]:
        return read_metrics(self.path)

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)

    def truncate(self, last_round: int) -> list[dict[str, Any]]:
        """Keep rows up to `last_round` (a partial last line from a crash is dropped)."""
        rows = [r for r in self.read() if r["round"] <= last_round]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tmp.replace(self.path)
        return rows


class MetricsLog:
    """`metrics.jsonl` (`JsonLines`, truncated to a checkpoint's round on resume); every
    `sinks` entry receives the same rows and the same truncation."""

    def __init__(self, path: Path, sinks: Sequence[RowSink] = ()) -> None:
        self.path = path
        self.lines = JsonLines(path)
        self.sinks = tuple(sinks)

    def append(self, row: dict[str, Any]) -> None:
        self.lines.append([row])
        for sink in self.sinks:
            sink.append(row)

    def read(self) -> list[dict[str, Any]]:
        return self.lines.read()

    def clear(self) -> None:
        """A fresh start: no rows, here or in any sink."""
        self.lines.clear()
        for sink in self.sinks:
            sink.rewrite([])

    def truncate(self, last_round: int) -> list[dict[str, Any]]:
        """Keep rows up to `last_round`; the sinks are rewritten from the kept rows."""
        rows = self.lines.truncate(last_round)
        for sink in self.sinks:
            sink.rewrite(rows)
        return rows

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line cut short by a kill: everything after it is not trusted
    return rows


def summarise(
    rows: Sequence[dict[str, Any]],
    targets: Sequence[Target],
    info: dict[str, Any],
    *,
    failures: Mapping[str, int],
    rounds_aggregated: int,
    defence: Mapping[str, Any] | None = None,
    breakdown: Mapping[str, Any] | None = None,
    phases: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Final and best of each metric, the row selected by validation accuracy
    (`best_by_val`), when each target was first reached, the excluded clients counted by
    kind (`hetfl.core.types.FailureKind`), how many rounds aggregated any client's
    result, a defence's totals (`hetfl.engine.decisions.defence_summary`; None
    without one), a coverage-aware rule's elements beyond its breakdown point
    (`hetfl.engine.breakdown.breakdown_summary`; None without one) and each phase's wall
    and CPU seconds (`hetfl.engine.phases.PhaseLog`; kept out of the metrics rows, which
    the golden fixtures pin)."""
    final = dict(rows[-1]) if rows else {}
    best: dict[str, float | None] = {}
    for key in _BEST:
        values = [r[key] for r in rows if _is_number(r.get(key))]
        if not values:
            best[key] = None
        else:
            best[key] = max(values) if key in HIGHER_IS_BETTER else min(values)
    return {
        **info,
        "rounds_completed": final.get("round", 0),
        "final": final,
        "best": best,
        "best_by_val": best_by_val(rows),
        "targets": reached_targets(rows, targets),
        "failures": dict(sorted(failures.items())),
        "rounds_aggregated": rounds_aggregated,
        "defence": None if defence is None else dict(defence),
        "breakdown": None if breakdown is None else dict(breakdown),
        "phases": None if phases is None else dict(phases),
    }


#: The exit status of `hetfl run`, `hetfl resume` and `hetfl serve` when a run reached its
#: last round without aggregating any client's result: it ran, but nothing was learned.
NOTHING_AGGREGATED_EXIT = 3


def nothing_aggregated(summary: Mapping[str, Any]) -> str | None:
    """Why a finished run learned nothing (no round aggregated any client), or None.

    A summary without `rounds_aggregated` (written before it existed) is not judged.
    """
    if summary.get("rounds_aggregated") != 0:
        return None
    failures = summary.get("failures") or {}
    counts = ", ".join(f"{n} {kind}" for kind, n in failures.items()) or "none"
    return (
        f"no round aggregated any client's result in {summary.get('rounds_completed')} rounds "
        f"(failures: {counts}), so the global model never trained; each client's reason "
        "is printed as a warning when it fails"
    )


def best_by_val(rows: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The round, validation accuracy and test metrics of the row with the highest
    `val_acc` (the earliest on ties), or None without validation: a model chosen by
    validation, whose test metrics are then an unbiased report (`best` picks each test
    metric's best round on the test set itself, which is no model selection)."""
    scored = [r for r in rows if _is_number(r.get("val_acc"))]
    if not scored:
        return None
    chosen = max(scored, key=lambda r: r["val_acc"])  # max keeps the first of equal values
    return {k: chosen.get(k) for k in _BY_VAL}


def reached_targets(
    rows: Sequence[dict[str, Any]], targets: Sequence[Target]
) -> list[dict[str, Any]]:
    """For each target, the round, simulated time, bytes and MACs of the first row that
    meets it (None where none does): `summary.json`'s "targets", and `hetfl compare
    --target` for a level chosen after the runs."""
    reached = []
    for t in targets:
        hit = next((r for r in rows if _meets(r.get(t.metric), t)), None)
        reached.append(
            {
                "metric": t.metric,
                "value": t.value,
                "round": None if hit is None else hit["round"],
                "sim_time_s": None if hit is None else hit["sim_time_s"],
                "bytes": None if hit is None else hit["bytes_down"] + hit["bytes_up"],
                "macs": None if hit is None else hit["macs"],
            }
        )
    return reached


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _meets(v: Any, target: Target) -> bool:
    if not _is_number(v):
        return False
    return v >= target.value if target.metric in HIGHER_IS_BETTER else v <= target.value


def write_json(path: Path, payload: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    tmp.replace(path)
