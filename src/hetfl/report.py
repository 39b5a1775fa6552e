"""One job: reading run directories back, comparison tables (mean ± sd over seeds) and plots.

Runs are grouped by everything that identifies them except the seed: the sweep point name
with its `-s<seed>` part removed, so `fedavg-s0` and `fedavg-s1` form one row.

`select_by_validation` picks, for each algorithm, one swept setting by validation accuracy
(`hetfl compare --select val_acc`), so that the test metrics reported for it were not used
to choose it.

Beside the mean local accuracy, the table shows how it spreads over clients (`spread`), read
from each run's per-client trace `clients.jsonl` at the last round that evaluated clients
locally: the worst decile (the mean of the lowest ceil(n/10) of the n clients' local
accuracies) and the standard deviation over those clients (population: the clients
evaluated are the whole population reported), for all clients and per local-evaluation
group. Runs without a trace (written before it existed, or with `local_eval: none`) show "-".

Attacked runs under a defence (`summary.json`'s `defence`, `hetfl.engine.decisions`) get a
`malicious kept` column: the share of the malicious updates the defence decided on that it
let through, kept or clipped, over the run (mean ± sd over seeds).
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import methodcaller
from pathlib import Path
from typing import Any

from hetfl.engine.outputs import Target, reached_targets, read_metrics

_SEED = re.compile(r"-s\d+")


@dataclass
class RunRecord:
    path: Path
    group: str
    seed: int | None
    summary: dict[str, Any]
    rows: list[dict[str, Any]]
    #: The per-client trace (`clients.jsonl`); empty for runs written before it existed.
    clients: list[dict[str, Any]] = field(default_factory=list)


def load_run(path: Path) -> RunRecord:
    summary_path = path / "summary.json"
    if not summary_path.exists():
        raise FileNotFoundError(f"{path} is not a finished run (no summary.json)")
    summary = json.loads(summary_path.read_text())
    group = _SEED.sub("", path.name, count=1) if _SEED.search(path.name) else path.name
    metrics, clients = read_metrics(path / "metrics.jsonl"), read_metrics(path / "clients.jsonl")
    return RunRecord(path, group, summary.get("seed"), summary, metrics, clients)


def find_runs(paths: Sequence[Path]) -> list[RunRecord]:
    """Run directories among `paths`, looking one level down into sweep folders."""
    runs: list[RunRecord] = []
    for p in paths:
        if (p / "summary.json").exists():
            runs.append(load_run(p))
        elif p.is_dir():
            runs.extend(load_run(c) for c in sorted(p.iterdir()) if (c / "summary.json").exists())
        else:
            raise FileNotFoundError(f"{p} is neither a run directory nor a sweep folder")
    if not runs:
        raise FileNotFoundError("no finished runs found in " + ", ".join(map(str, paths)))
    return runs


def mean_sd(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    mean = statistics.fmean(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return mean, sd


@dataclass(frozen=True)
class Spread:
    """How local accuracy spreads over `n` clients: the mean of the worst decile (the
    lowest ceil(n/10) accuracies) and the population standard deviation."""

    worst_decile: float
    sd: float
    n: int


def spread(accs: Sequence[float]) -> Spread:
    """The `Spread` of some clients' local accuracies (at least one)."""
    k = math.ceil(len(accs) / 10)
    return Spread(statistics.fmean(sorted(accs)[:k]), statistics.pstdev(accs), len(accs))


def final_spreads(clients: Sequence[Mapping[str, Any]]) -> dict[str | None, Spread]:
    """The spread of local accuracies at the last round of the trace `clients` that
    evaluated any client locally: over every evaluated client (key None), and per
    local-evaluation group (the rows' `group`). Empty when no round did."""
    scored = [r for r in clients if r.get("local_acc") is not None]
    if not scored:
        return {}
    last = max(r["round"] for r in scored)
    at_last = [r for r in scored if r["round"] == last]
    by_group: dict[str | None, list[float]] = {None: [r["local_acc"] for r in at_last]}
    for r in at_last:
        if r.get("group") is not None:
            by_group.setdefault(r["group"], []).append(r["local_acc"])
    return {g: spread(accs) for g, accs in by_group.items()}


def _spread_columns(members: Sequence[RunRecord]) -> dict[str, str]:
    """`local_acc worst 10%` and `local_acc client sd` of each run's final evaluated round
    (mean ± sd over seeds), for all clients, then per local-evaluation group; named
    `local_map` for detection runs, whose trace holds each client's mAP there."""
    finals = [m.summary.get("final") or {} for m in members]
    score = "local_map" if all(f.get("local_map") is not None for f in finals) else "local_acc"
    spreads = [final_spreads(m.clients) for m in members]
    groups = sorted({g for s in spreads for g in s if g is not None}, reverse=True)
    columns = {}
    for g in [None, *groups]:
        suffix = "" if g is None else f" {g}"
        picked = [s.get(g) for s in spreads]
        worst = [None if p is None else p.worst_decile for p in picked]
        sds = [None if p is None else p.sd for p in picked]
        columns[f"{score} worst 10%{suffix}"] = _fmt(worst)
        columns[f"{score} client sd{suffix}"] = _fmt(sds)
    return columns


def _fmt(values: Sequence[float | None], scale: float = 1.0, digits: int = 4) -> str:
    present = [v * scale for v in values if v is not None and math.isfinite(v)]
    if not present:
        return "-"
    suffix = f" ({len(present)}/{len(values)})" if len(present) < len(values) else ""
    m, s = mean_sd(present)
    return f"{m:.{digits}f} ± {s:.{digits}f}{suffix}"


def comparison_rows(
    runs: Sequence[RunRecord], targets: Sequence[Target] | None = None
) -> list[dict[str, str]]:
    """One row per group of runs (mean ± sd over its seeds). The "to <target>" columns are
    each run's summary's targets, or, given `targets`, those levels found in each run's
    metrics rows: a target fixed after the runs (a fraction of a pilot's accuracy)."""
    groups: dict[str, list[RunRecord]] = {}
    for r in runs:
        groups.setdefault(r.group, []).append(r)
    rows = []
    for name, members in groups.items():
        final = [m.summary.get("final", {}) for m in members]
        best = [m.summary.get("best", {}) for m in members]
        row = {
            "run": name,
            "seeds": str(len(members)),
            "final global_acc": _fmt([f.get("global_acc") for f in final]),
            "best global_acc": _fmt([b.get("global_acc") for b in best]),
            "final local_acc": _fmt([f.get("local_acc") for f in final]),
            **_optional_column(final, "pooled_acc"),
            **_optional_column(final, "local_acc_stats"),
            **_optional_column(final, "local_acc_trained"),
            **_optional_column(final, "attack_success"),
            **_optional_column(final, "global_ppl"),
            **_optional_column(final, "local_ppl"),
            **_optional_column(final, "local_ppl_trained"),
            **_optional_column(final, "global_map"),
            **_optional_column(final, "local_map"),
            **_malicious_column(members),
            **_spread_columns(members),
            "rounds": _fmt([m.summary.get("rounds_completed") for m in members], digits=0),
            "MB sent": _fmt(
                [(f.get("bytes_down") or 0) + (f.get("bytes_up") or 0) for f in final], 1e-6, 1
            ),
            "sim s": _fmt([f.get("sim_time_s") for f in final], digits=1),
            "GMAC": _fmt([f.get("macs") for f in final], 1e-9, 2),
            **_group_columns(final),
        }
        reached = [
            m.summary.get("targets", []) if targets is None else reached_targets(m.rows, targets)
            for m in members
        ]
        for i, target in enumerate(reached[0]):
            label = f"{target['metric']}>={target['value']:g}"
            hits = [r[i] for r in reached]
            row[f"rounds to {label}"] = _fmt([h["round"] for h in hits], digits=1)
            row[f"MB to {label}"] = _fmt([h["bytes"] for h in hits], 1e-6, 1)
            row[f"sim s to {label}"] = _fmt([h.get("sim_time_s") for h in hits], digits=1)
            row[f"GMAC to {label}"] = _fmt([h.get("macs") for h in hits], 1e-9, 2)
        rows.append(row)
    return rows


def _optional_column(final: Sequence[dict[str, Any]], key: str) -> dict[str, str]:
    """`final <key>` for a metric only some runs measure (`pooled_acc` of a method scored
    on its clients' own splits, `local_acc_stats` with
    `eval.stats_pass`, `local_acc_trained` with `eval.local_trained`, `attack_success` with a
    trigger attack, the perplexities of a language-model task), when some run of the group
    reports it."""
    values = [f.get(key) for f in final]
    return {f"final {key}": _fmt(values)} if any(v is not None for v in values) else {}


def malicious_through(record: Mapping[str, Any]) -> float | None:
    """The share of malicious updates a defence let through, kept or clipped: (kept +
    clipped) / (kept + clipped + dropped) of the malicious clients, over a run
    (`summary.json`'s `defence`) or one round (a metrics row's); None without a defence, an
    attack or any malicious update decided."""
    totals = record.get("defence") or {}
    kept, clipped, dropped = (totals.get(f"malicious_{d}") for d in ("kept", "clipped", "dropped"))
    if kept is None or clipped is None or dropped is None or not kept + clipped + dropped:
        return None
    return float(kept + clipped) / (kept + clipped + dropped)


def _malicious_column(members: Sequence[RunRecord]) -> dict[str, str]:
    """`malicious kept` (`malicious_through`) for groups whose runs report it."""
    values = [malicious_through(m.summary) for m in members]
    if all(v is None for v in values):
        return {}
    return {"malicious kept": _fmt(values)}


def _group_columns(final: Sequence[dict[str, Any]]) -> dict[str, str]:
    """`final <group>` for every group of the final metrics rows (each sub-model's
    accuracy: `width=0.5`, `capacity=mean`, ...; a detector group's mAP), widest-named
    first as sorted text."""
    names = sorted({g for f in final for g in f.get("groups") or {}}, reverse=True)
    entries = [[(f.get("groups") or {}).get(g) or {} for f in final] for g in names]
    return {
        f"final {g}": _fmt([e.get("acc", e.get("map")) for e in of_group])
        for g, of_group in zip(names, entries, strict=True)
    }


@dataclass(frozen=True)
class Selection:
    """The swept setting chosen for one algorithm: its group (point name without the
    seed), the mean and sd over its seeds of each run's best `val_acc`, and how many
    settings were candidates."""

    algorithm: str
    group: str
    val_acc: float
    val_acc_sd: float
    seeds: int
    candidates: int

    @property
    def setting(self) -> str:
        """The swept keys of the group (`lr=0.1`), without the algorithm's name."""
        return self.group.removeprefix(self.algorithm).lstrip("-") or "(its only setting)"


def algorithm_of(run: RunRecord) -> str:
    """The run's algorithm: from its summary, else the point name before `-s<seed>`."""
    if run.summary.get("algorithm"):
        return str(run.summary["algorithm"])
    found = _SEED.search(run.path.name)
    return run.path.name[: found.start()] if found else run.group


def _best_by_val(run: RunRecord) -> dict[str, Any] | None:
    """The run's row of highest validation accuracy (`summary.json` "best_by_val")."""
    chosen = run.summary.get("best_by_val")
    return chosen if isinstance(chosen, dict) else None


def select_by_validation(runs: Sequence[RunRecord]) -> tuple[list[RunRecord], list[Selection]]:
    """For each algorithm, the runs of the setting whose mean over seeds of the best
    validation accuracy is highest, the first in run order on ties. Every key swept
    besides `algorithm` and `seed` counts as a choice to tune. Runs without a validation
    accuracy are an error that names them."""
    missing = [str(r.path) for r in runs if _best_by_val(r) is None]
    if missing:
        raise ValueError(
            f"--select val_acc needs a validation accuracy in every run, and "
            f"{len(missing)} have none (run them with data.validation set, e.g. "
            f"data.validation=0.1): {', '.join(missing)}"
        )
    settings: dict[str, dict[str, list[RunRecord]]] = {}
    for r in runs:
        settings.setdefault(algorithm_of(r), {}).setdefault(r.group, []).append(r)
    chosen: list[RunRecord] = []
    selections = []
    for algorithm, groups in settings.items():
        scored = {g: mean_sd([_val_acc(m) for m in ms]) for g, ms in groups.items()}
        group = max(scored, key=lambda g: scored[g][0])  # max keeps the first of equal means
        chosen += groups[group]
        selections.append(
            Selection(algorithm, group, *scored[group], len(groups[group]), len(groups))
        )
    return chosen, selections


def _val_acc(run: RunRecord) -> float:
    """The run's best validation accuracy (of a run `select_by_validation` accepted)."""
    return float(run.summary["best_by_val"]["val_acc"])


def selection_rows(
    runs: Sequence[RunRecord], targets: Sequence[Target] | None = None
) -> tuple[list[dict[str, str]], list[Selection]]:
    """The comparison rows of the settings `select_by_validation` chooses, led by the
    validation accuracy they were chosen by and the test accuracies at each run's round of
    best validation accuracy. The test-picked "best global_acc" column is left out: it is
    each run's best round on the test set itself."""
    chosen, selections = select_by_validation(runs)
    members: dict[str, list[RunRecord]] = {}
    for r in chosen:
        members.setdefault(r.group, []).append(r)
    rows = []
    for row in comparison_rows(chosen, targets):
        at_val = [_best_by_val(m) or {} for m in members[row["run"]]]
        row.pop("best global_acc")
        lead = {k: row.pop(k) for k in ("run", "seeds")}
        rows.append(
            {
                **lead,
                "best val_acc": _fmt([b.get("val_acc") for b in at_val]),
                "global_acc at best val": _fmt([b.get("global_acc") for b in at_val]),
                "local_acc at best val": _fmt([b.get("local_acc") for b in at_val]),
                **row,
            }
        )
    return rows, selections


def format_table(rows: Sequence[dict[str, str]]) -> str:
    """A Markdown table (also readable as plain text)."""
    if not rows:
        return "(no runs)"
    cols = list(dict.fromkeys(k for r in rows for k in r))
    widths = {c: max(len(c), *(len(r.get(c, "")) for r in rows)) for c in cols}
    line = "| " + " | ".join(c.ljust(widths[c]) for c in cols) + " |"
    sep = "| " + " | ".join("-" * widths[c] for c in cols) + " |"
    body = ["| " + " | ".join(r.get(c, "").ljust(widths[c]) for c in cols) + " |" for r in rows]
    return "\n".join([line, sep, *body])


def write_comparison(sweep_dir: Path, runs: Sequence[RunRecord]) -> str:
    table = format_table(comparison_rows(runs))
    (sweep_dir / "comparison.md").write_text(table + "\n")
    return table


# -- plots ----------------------------------------------------------------------------------
def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


_AXES = {
    "round": ("round", lambda r: r["round"]),
    "bytes": ("MB sent (down + up)", lambda r: (r["bytes_down"] + r["bytes_up"]) / 1e6),
    "sim_time": ("simulated time (s)", lambda r: r["sim_time_s"]),
}


def plot_run(run_dir: Path) -> list[Path]:
    """`plots/` of one run: accuracy against round, bytes and (with profiles) simulated time."""
    rows = read_metrics(run_dir / "metrics.jsonl")
    if not rows:
        return []
    out_dir = run_dir / "plots"
    out_dir.mkdir(exist_ok=True)
    record = RunRecord(run_dir, run_dir.name, None, {}, rows)
    written = []
    for axis in _AXES:
        if axis == "sim_time" and rows[0]["sim_time_s"] is None:
            continue
        path = out_dir / f"accuracy_vs_{axis}.png"
        plot_runs([record], path, x=axis)
        written.append(path)
    return written


#: The curves `comparison_figure` draws, each where a run reports it: name, line style, the value
#: of a metrics row.
_CURVES: tuple[tuple[str, str, Callable[[Mapping[str, Any]], Any]], ...] = (
    ("global_acc", "-", methodcaller("get", "global_acc")),
    ("pooled_acc", "-", methodcaller("get", "pooled_acc")),
    ("local_acc", "--", methodcaller("get", "local_acc")),
    ("local_acc_trained", ":", methodcaller("get", "local_acc_trained")),
    ("attack_success", "-.", methodcaller("get", "attack_success")),
    ("global_map", "-", methodcaller("get", "global_map")),
    ("local_map", "--", methodcaller("get", "local_map")),
    ("malicious kept", "x:", malicious_through),
)
#: The perplexity curves of a language-model task, drawn on their own (log) axis.
_PERPLEXITY_CURVES: tuple[tuple[str, str, Callable[[Mapping[str, Any]], Any]], ...] = (
    ("global_ppl", "-", methodcaller("get", "global_ppl")),
    ("local_ppl", "--", methodcaller("get", "local_ppl")),
    ("local_ppl_trained", ":", methodcaller("get", "local_ppl_trained")),
)


def plot_runs(runs: Sequence[RunRecord], out: Path, x: str = "round") -> Path:
    """`comparison_figure` of `runs` written as a PNG to `out`; returns `out`."""
    plt = _pyplot()
    fig = comparison_figure(runs, x)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def comparison_figure(runs: Sequence[RunRecord], x: str = "round") -> Any:
    """Accuracy curves of several runs in one figure, titled with what it compares. Each
    group (a method or sweep setting) has one colour for all its curves, told apart by line
    style; the seeds of a group are drawn as their mean, with a band from their lowest to
    their highest value, which the legend names. Rounds are ticked at whole numbers. A
    backdoored run's `attack_success` (a share of test images too) is drawn dash-dotted, and
    a defended, attacked run's share of malicious updates let through (`malicious kept`)
    dotted with crosses."""
    plt = _pyplot()
    label_x, get_x = _AXES[x]
    groups: dict[str, list[RunRecord]] = {}
    for r in runs:
        groups.setdefault(r.group, []).append(r)
    if x == "sim_time" and not any(r["sim_time_s"] is not None for m in runs for r in m.rows):
        raise ValueError(
            "these runs have no simulated time: configure device profiles "
            "(system.preset or system.profiles) to record sim_time_s"
        )
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colour = {name: palette[i % len(palette)] for i, name in enumerate(groups)}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    banded: set[str] = set()
    drawn = _draw_curves(ax, _CURVES, groups, get_x, colour, banded)
    perplexity_ax = ax.twinx()
    if _draw_curves(perplexity_ax, _PERPLEXITY_CURVES, groups, get_x, colour, banded):
        perplexity_ax.set_yscale("log")
        perplexity_ax.set_ylabel("perplexity (log scale)")
        perplexity_ax.legend(fontsize=8, loc="upper center")
    else:
        perplexity_ax.remove()
    ax.set_xlabel(label_x)
    if x == "round":
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    shares = [m for m in ("attack_success", "malicious kept") if m in drawn]
    ax.set_ylabel(", ".join(["accuracy", *(m.replace("_", " ") for m in shares)]))
    ax.set_title(f"{', '.join(groups)}: accuracy against {label_x}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _draw_curves(
    ax: Any,
    curves: Sequence[tuple[str, str, Callable[[Mapping[str, Any]], Any]]],
    groups: Mapping[str, Sequence[RunRecord]],
    get_x: Callable[[Mapping[str, Any]], Any],
    colour: Mapping[str, str],
    banded: set[str],
) -> set[str]:
    """Each group's mean curve of each of `curves` it reports, with a band over its seeds
    (the legend names a group's band once: `banded` holds those named); returns the
    metrics drawn."""
    drawn: set[str] = set()
    for metric, style, value in curves:
        for name, members in groups.items():
            series = [
                [
                    (get_x(row), value(row))
                    for row in m.rows
                    if value(row) is not None and get_x(row) is not None
                ]
                for m in members
            ]
            series = [s for s in series if s]
            if not series:
                continue
            n = min(len(s) for s in series)
            xs = [statistics.fmean(s[i][0] for s in series) for i in range(n)]
            ys = [[s[i][1] for s in series] for i in range(n)]
            mean = [statistics.fmean(v) for v in ys]
            ax.plot(xs, mean, style, color=colour[name], label=f"{name} {metric}")
            drawn.add(metric)
            if len(series) > 1:
                lo, hi = [min(v) for v in ys], [max(v) for v in ys]
                band = (
                    None
                    if name in banded
                    else f"{name}: lines the mean of {len(series)} seeds, band lowest to highest"
                )
                banded.add(name)
                ax.fill_between(xs, lo, hi, color=colour[name], alpha=0.2, label=band)
    return drawn
