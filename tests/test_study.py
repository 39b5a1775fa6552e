"""Studies declared before their runs: validated at the edge, run resumably point by point,
their records kept, and a report computed from the records alone. The repository's own
studies regenerate to the reports and verdict lines it publishes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetfl.cli import main
from hetfl.config import ConfigError
from hetfl.study import REPORT, open_study, report_text, run_study, verdict_lines

REPO = Path(__file__).resolve().parents[1]

BASE = """
name: base
algorithm: fedavg
data:
  dataset: digits
  num_clients: 4
  partition: {kind: iid}
  test_per_client: 10
model: {name: linear}
train: {rounds: 2, clients_per_round: 4, batch_size: 32, lr: 0.5}
eval: {every: 1, local_eval: none}
executor: sequential
"""

STUDY = """
name: tiny
claim: '"FedProx is no worse than FedAvg" (a test claim)'
source: a test
base: base.yaml
methods:
  fedprox: {algorithm: fedprox, options.fedprox.mu: 0.01}
  fedavg: {algorithm: fedavg}
protocol: {eval.every: 1, eval.stats_pass: false}
primary: {metric: global_acc, at: final}
comparisons:
  - {a: fedprox, b: fedavg, shape: non-inferiority, margin_points: 5}
seeds: [0, 1, 2]
budget_process_hours: 1
"""

#: Configs here may name plugin files; their registrations must not outlive the test.
pytestmark = pytest.mark.usefixtures("plugins_unloaded")


def _study(tmp_path: Path, text: str = STUDY) -> Path:
    (tmp_path / "base.yaml").write_text(BASE)
    path = tmp_path / "study.yaml"
    path.write_text(text)
    return path


def _args(tmp_path: Path, action: str) -> list[str]:
    runs, results = tmp_path / "runs", tmp_path / "results"
    return ["study", action, str(tmp_path / "study.yaml"), "--runs", str(runs),
            "--results", str(results), "--quiet"]  # fmt: skip


def test_a_study_runs_every_point_keeps_its_records_and_reports_from_them(tmp_path, capsys):
    _study(tmp_path)
    assert main(_args(tmp_path, "run")) == 0
    out = capsys.readouterr().out
    records = tmp_path / "results" / "tiny"
    points = sorted(p.name for p in records.iterdir() if p.is_dir())
    assert points == [f"{m}-s{s}" for m in ("fedavg", "fedprox") for s in range(3)]
    for point in points:
        summary = json.loads((records / point / "summary.json").read_text())
        assert summary["seed"] == int(point[-1]) and summary["rounds_completed"] == 2
        run = tmp_path / "runs" / "tiny" / point
        assert (records / point / "metrics.jsonl").read_bytes() == (
            run / "metrics.jsonl"
        ).read_bytes()
    ledger = json.loads((records / "ledger.json").read_text())
    assert set(ledger) == set(points) and all(v["wall_s"] > 0 for v in ledger.values())
    assert (records / REPORT).read_text() in out
    (line,) = verdict_lines(open_study(tmp_path / "study.yaml", tmp_path / "runs", records.parent))
    assert line.startswith(
        "tiny, fedprox vs fedavg (A no worse than B by more than 5 points (non-inferiority), "
        "global_acc at final, 3 seeds): **"
    )
    # the records alone make the report: the run folders gone, the same text
    study = open_study(tmp_path / "study.yaml", tmp_path / "runs", records.parent)
    for run in (tmp_path / "runs" / "tiny").iterdir():
        (run / "summary.json").unlink()
    assert report_text(study) == (records / REPORT).read_text()
    # a second run has nothing left to do
    assert main(_args(tmp_path, "run")) == 0
    assert json.loads((records / "ledger.json").read_text()) == ledger
    assert main(_args(tmp_path, "status")) == 0
    status = capsys.readouterr().out
    assert "tiny: 6 of 6 points recorded" in status and "fedavg-s2: recorded" in status


def test_the_budget_stops_a_study_between_points_and_the_next_run_goes_on(tmp_path, capsys):
    """With its budget spent after the first point, a study stops, says so, exits 1 and
    leaves the other points pending; with more budget the same command continues."""
    _study(tmp_path, STUDY.replace("budget_process_hours: 1", "budget_process_hours: 1e-9"))
    assert main(_args(tmp_path, "run")) == 1
    assert "budget spent" in capsys.readouterr().err
    records = tmp_path / "results" / "tiny"
    assert list(json.loads((records / "ledger.json").read_text())) == ["fedprox-s0"]
    assert "no shared seed recorded yet" in (records / REPORT).read_text()
    _study(tmp_path)
    assert main(_args(tmp_path, "status")) == 0
    assert "1 of 6 points recorded" in capsys.readouterr().out
    assert main(_args(tmp_path, "run")) == 0
    assert len(json.loads((records / "ledger.json").read_text())) == 6


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("seeds: [0, 1, 2]", "seeds: [0, 1]"), "seeds: List should have at least 3 items"),
        (("{eval.every: 1, eval.stats_pass: false}", "{train.lr: 0.1}"),
         "train.lr: a protocol sets how every method is scored"),
        (("{algorithm: fedavg}", "{algorithm: fedavg, eval.stats_pass: true}"),
         "fedavg sets eval.stats_pass: every method is scored by the study's one protocol"),
        (("a: fedprox, b: fedavg", "a: fedprox, b: fedadam"),
         "comparisons[0] names fedadam, not a method of the study (fedprox, fedavg)"),
        (("margin_points: 5", "margin_points: 0"),
         "a non-inferiority claim needs margin_points > 0"),
        (("  fedavg: {algorithm", "  fedavg-s1: {algorithm"), "never '-s<digit>'"),
        (("base: base.yaml", "base: missing.yaml"), "base: no config file"),
    ],
)  # fmt: skip
def test_a_study_that_breaks_its_own_declaration_is_refused(tmp_path, change, message):
    path = _study(tmp_path, STUDY.replace(*change))
    with pytest.raises(ConfigError) as caught:
        open_study(path, tmp_path / "runs", tmp_path / "results")
    assert message in str(caught.value)


def test_a_method_the_protocol_cannot_score_is_refused_by_name_before_anything_runs(tmp_path):
    """The protocol scores every client's model right after training; split learning's
    client ends before the classifier, so SplitFed cannot be scored so."""
    text = STUDY.replace("{eval.every: 1, eval.stats_pass: false}", "{eval.local_trained: true}")
    text = text.replace("{algorithm: fedavg}", "{algorithm: splitfed}")
    with pytest.raises(ConfigError, match="method 'fedavg' cannot run under the study's protocol"):
        open_study(_study(tmp_path, text), tmp_path / "runs", tmp_path / "results")
    assert not (tmp_path / "runs").exists() and not (tmp_path / "results").exists()


def test_the_protocols_statistics_pass_is_imposed_on_every_point(tmp_path):
    text = STUDY.replace("eval.stats_pass: false}", "eval.global_stats_pass: 'on'}")
    study = open_study(_study(tmp_path, text), tmp_path / "runs", tmp_path / "results")
    assert {cfg.eval.global_stats_pass for cfg in study.configs.values()} == {"on"}
    mine = STUDY.replace("{algorithm: fedavg}", "{algorithm: fedavg, eval.global_stats_pass: off}")
    with pytest.raises(ConfigError, match=r"fedavg sets eval\.global_stats_pass: every method"):
        open_study(_study(tmp_path, mine), tmp_path / "runs", tmp_path / "results")


def test_a_method_without_a_global_model_is_refused_before_any_point_runs(tmp_path):
    """The protocol asks for a global test score; FedPer keeps its head private, so it has
    no global model: refused by name at the study's set-up, before FedProx's points run."""
    text = STUDY.replace("eval.stats_pass: false}", "eval.require_global_test: true}")
    text = text.replace(
        "{algorithm: fedavg}", "{algorithm: fedper, model: {name: stage-cnn, stages: 2}}"
    )
    study = open_study(_study(tmp_path, text), tmp_path / "runs", tmp_path / "results")
    with pytest.raises(ConfigError, match=r"method 'fedavg' cannot be scored.*fedper has none"):
        run_study(study, show_progress=False)
    assert not (tmp_path / "runs" / "tiny").exists()


def test_a_study_declared_before_its_runs_reports_every_comparison_pending(tmp_path):
    """No record yet (a migrated report's study, re-run pending): `report` writes the
    pending verdict lines, and again once its folder holds only that report."""
    _study(tmp_path)
    assert main(_args(tmp_path, "report")) == 0
    report = tmp_path / "results" / "tiny" / REPORT
    first = report.read_text()
    assert "tiny, fedprox vs fedavg: no shared seed recorded yet" in first
    assert main(_args(tmp_path, "report")) == 0
    assert report.read_text() == first


def test_a_methods_nested_setting_stays_in_its_own_points(tmp_path):
    """One method's `train.lr` does not leak into the base, so not into the next method's
    or seed's point (the points share one loaded base)."""
    text = STUDY.replace("{algorithm: fedavg}", "{algorithm: fedavg, train.lr: 0.1}")
    study = open_study(_study(tmp_path, text), tmp_path / "runs", tmp_path / "results")
    lrs = {name: cfg.train.lr for name, cfg in study.configs.items()}
    assert lrs == {f"{m}-s{s}": 0.1 if m == "fedavg" else 0.5
                   for s in range(3) for m in ("fedprox", "fedavg")}  # fmt: skip


STUDIES = sorted((REPO / "studies").glob("*.yaml"))


@pytest.mark.parametrize("path", STUDIES, ids=[p.stem for p in STUDIES])
def test_every_published_study_regenerates_from_its_committed_records(path: Path):
    """The report in results/<study>/ and the verdict lines quoted in docs/results.md are
    what the committed records give today."""
    study = open_study(path, REPO / "runs" / "studies", REPO / "results")
    committed = study.records_dir / REPORT
    assert committed.exists(), f"{path.name}: run `hetfl study report {path}` and commit it"
    assert report_text(study) == committed.read_text(), (
        f"{committed} differs from what its records give: `hetfl study report {path}`"
    )
    results = (REPO / "docs" / "results.md").read_text()
    for line in verdict_lines(study):
        assert line in results, f"docs/results.md does not quote {line!r}"


def test_a_time_to_target_claim_reads_the_rounds_with_censored_seeds_named(tmp_path):
    """Hand-made records: FedProx reaches global_acc 0.8 at rounds 2, 2, 3; FedAvg at 4, 5
    and never in 5 rounds: B - A = 2, 3, 2 rounds (the censored seed only strengthens 'A
    sooner'), mean 2.33, 95% interval 2.33 -+ 4.303 x 0.333 = [0.90, 3.77] -> holds."""
    text = STUDY.replace("primary: {metric: global_acc, at: final}",
                         "primary: {metric: global_acc, target: 0.8}")  # fmt: skip
    study = open_study(_study(tmp_path, text), tmp_path / "runs", tmp_path / "results")
    reach = {"fedprox": [2, 2, 3], "fedavg": [4, 5, None]}
    for name, rounds in reach.items():
        for seed, r in enumerate(rounds):
            accs = [0.5] * 5 if r is None else ([0.5] * (r - 1) + [0.85] * 5)[:5]
            rows = [{"round": i, "global_acc": a, "bytes_down": 0, "bytes_up": 0, "macs": 0,
                     "sim_time_s": None} for i, a in enumerate(accs, start=1)]  # fmt: skip
            point = study.records_dir / f"{name}-s{seed}"
            point.mkdir(parents=True)
            (point / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            (point / "summary.json").write_text(json.dumps({"seed": seed, "final": rows[-1]}))
    (line,) = verdict_lines(study)
    assert line == (
        "tiny, fedprox vs fedavg (A reaches it sooner than B, rounds to global_acc >= 0.8, "
        "3 seeds, censored A 0, B 1): **holds**, A - B +2.33 rounds, 95% interval "
        "[+0.90, +3.77]"
    )


RELATIVE = STUDY.replace(
    """  fedprox: {algorithm: fedprox, options.fedprox.mu: 0.01}
  fedavg: {algorithm: fedavg}""",
    """  a-attacked: {algorithm: fedprox}
  a-clean: {algorithm: fedprox}
  b-attacked: {algorithm: fedavg}
  b-clean: {algorithm: fedavg}""",
).replace(
    "  - {a: fedprox, b: fedavg, shape: non-inferiority, margin_points: 5}",
    "  - {a: a-attacked, b: b-attacked, a_reference: a-clean, b_reference: b-clean,"
    " chance_points: 10}",
)


def _final_records(study, finals: dict[str, list[float]], metric: str = "global_acc") -> None:
    """One-round records of `metric` (by method, one value per seed) in the study's folder."""
    for name, values in finals.items():
        for seed, value in enumerate(values):
            row = {"round": 1, metric: value, "bytes_down": 0, "bytes_up": 0, "macs": 0}
            point = study.records_dir / f"{name}-s{seed}"
            point.mkdir(parents=True)
            (point / "metrics.jsonl").write_text(json.dumps(row) + "\n")
            (point / "summary.json").write_text(json.dumps({"seed": seed, "final": row}))


def test_a_robustness_claim_reads_each_method_relative_to_its_clean_run(tmp_path):
    """Hand-made records. A's drops 0.02, 0.04, 0.00; B's 0.30, 0.20, 0.25: B's drop minus
    A's = 28, 16, 25 points, mean 23, sd 6.245, 95% interval 23 -+ 4.303 x 3.606 = [7.49,
    38.51] -> holds; then both attacked at chance (11 %, 12 %, 10 % and 10 % each): saturated,
    not a verdict."""
    study = open_study(_study(tmp_path, RELATIVE), tmp_path / "runs", tmp_path / "results")
    _final_records(study, {
        "a-clean": [0.80, 0.82, 0.78], "a-attacked": [0.78, 0.78, 0.78],
        "b-clean": [0.75, 0.70, 0.72], "b-attacked": [0.45, 0.50, 0.47],
    })  # fmt: skip
    (line,) = verdict_lines(study)
    assert line == (
        "tiny, a-attacked vs b-attacked, each relative to a-clean / b-clean (A better than B "
        "by more than 0 points (superiority), global_acc at final, 3 seeds): **holds**, "
        "A - B +23.00 points, 95% interval [+7.49, +38.51]"
    )
    saturated = tmp_path / "sat"
    saturated.mkdir()
    study = open_study(_study(saturated, RELATIVE), saturated / "runs", saturated / "results")
    _final_records(study, {
        "a-clean": [0.80, 0.82, 0.78], "a-attacked": [0.11, 0.12, 0.10],
        "b-clean": [0.75, 0.70, 0.72], "b-attacked": [0.10, 0.10, 0.10],
    })  # fmt: skip
    assert "**saturated**" in verdict_lines(study)[0]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("a_reference: a-clean, ", ""), "a_reference and b_reference go together"),
        (("b_reference: b-clean", "b_reference: c-clean"), "names c-clean, not a method"),
        (("primary: {metric: global_acc, at: final}", "primary: {metric: global_acc, target: 0.5}"),
         "relative to references reads an accuracy at a round"),
    ],
)  # fmt: skip
def test_a_relative_comparison_is_declared_whole(tmp_path, change, message):
    path = _study(tmp_path, RELATIVE.replace(*change))
    with pytest.raises(ConfigError, match=message):
        open_study(path, tmp_path / "runs", tmp_path / "results")


def test_a_perplexity_claim_reads_the_log_ratio_lower_being_better(tmp_path):
    """Hand-made records: A's local perplexities 10, 20, 40 against B's 12, 22, 44: ln(B/A)
    = 0.18232, 0.09531, 0.09531, mean 0.12432 (12.43 log points), ratio exp(0.12432) =
    1.132; sd 0.050235, 95% interval 12.43 -+ 4.303 x 2.9003 = [-0.05, +24.91], above the
    margin of -5 -> non-inferior."""
    text = STUDY.replace("primary: {metric: global_acc, at: final}",
                         "primary: {metric: local_ppl, at: final}")  # fmt: skip
    study = open_study(_study(tmp_path, text), tmp_path / "runs", tmp_path / "results")
    ppls = {"fedprox": [10.0, 20.0, 40.0], "fedavg": [12.0, 22.0, 44.0]}
    _final_records(study, ppls, metric="local_ppl")
    (line,) = verdict_lines(study)
    assert line == (
        "tiny, fedprox vs fedavg (A no worse than B by more than 5 log points "
        "(non-inferiority), local_ppl at final, 3 seeds, perplexity ratio B/A 1.132): "
        "**non-inferior**, A - B +12.43 log points, 95% interval [-0.05, +24.91]"
    )


def test_an_attack_success_claim_reads_lower_as_better_in_points(tmp_path):
    """Hand-made records: A's backdoor attack success 0.05, 0.10, 0.08 against B's 0.40,
    0.30, 0.35: A - B = B's - A's = 35, 20, 27 points, mean 27.33, sd 7.5056, 95% interval
    27.33 -+ 4.303 x 4.3333 = [+8.69, +45.98], above 0 -> holds; B against A (the higher
    attack success as A) the mirror, below -5 -> fails."""
    text = STUDY.replace("primary: {metric: global_acc, at: final}",
                         "primary: {metric: attack_success, at: final}")  # fmt: skip
    study = open_study(_study(tmp_path, text), tmp_path / "runs", tmp_path / "results")
    _final_records(study, {"fedprox": [0.05, 0.10, 0.08], "fedavg": [0.40, 0.30, 0.35]},
                   metric="attack_success")  # fmt: skip
    (line,) = verdict_lines(study)
    assert line == (
        "tiny, fedprox vs fedavg (A no worse than B by more than 5 points "
        "(non-inferiority), attack_success at final, 3 seeds): "
        "**holds**, A - B +27.33 points, 95% interval [+8.69, +45.98]"
    )
    mirrored = tmp_path / "mirror"
    mirrored.mkdir()
    swapped = text.replace("a: fedprox, b: fedavg", "a: fedavg, b: fedprox")
    study = open_study(_study(mirrored, swapped), mirrored / "runs", mirrored / "results")
    _final_records(study, {"fedprox": [0.05, 0.10, 0.08], "fedavg": [0.40, 0.30, 0.35]},
                   metric="attack_success")  # fmt: skip
    assert verdict_lines(study)[0].endswith(
        "**fails**, A - B -27.33 points, 95% interval [-45.98, -8.69]"
    )


BREAKDOWN = STUDY.replace(
    """  fedprox: {algorithm: fedprox, options.fedprox.mu: 0.01}
  fedavg: {algorithm: fedavg}""",
    """  attacked: {algorithm: fedavg}
  clean: {algorithm: fedavg}""",
).replace("a: fedprox, b: fedavg", "a: attacked, b: clean")


def _records_with(study, finals: dict[str, list[float]], extra: dict[str, dict]) -> None:
    """`_final_records` with `extra` summary keys (by method) in every seed's summary."""
    _final_records(study, finals)
    for name, values in finals.items():
        for seed in range(len(values)):
            path = study.records_dir / f"{name}-s{seed}" / "summary.json"
            path.write_text(json.dumps({**json.loads(path.read_text()), **extra.get(name, {})}))


@pytest.mark.parametrize(
    ("attacked", "clean", "mark"),
    [
        # the attacked runs have elements beyond (2,570 of 5,878,474: FedFA's label-split head)
        ({"attack": {"malicious": [3]}, "breakdown": {"max_share": 2570 / 5878474}}, {},
         ", beyond breakdown (0.0437 % of elements)"),
        # counted, none beyond; the clean run's count (the same rule) is not an attacked run's
        ({"attack": {"malicious": [3]}, "breakdown": {"max_share": 0.0}},
         {"attack": {"malicious": []}, "breakdown": {"max_share": 0.5}}, ""),
        ({"attack": {"malicious": [3]}}, {}, ""),  # an older record: no key, not marked
    ],
)  # fmt: skip
def test_a_cell_whose_attacked_runs_are_beyond_the_breakdown_is_marked(
    tmp_path, attacked, clean, mark
):
    """Hand-made records: the attacked run's final accuracy 0.70, 0.71, 0.72 against the
    clean 0.80, 0.80, 0.80: A - B = -10, -9, -8 points, mean -9, sd 1, 95% interval -9 -+
    4.303 x 0.57735 = [-11.48, -6.52], below -5 -> fails; marked beside the verdict (the
    line and the table) only where an attacked run has a share above 0."""
    study = open_study(_study(tmp_path, BREAKDOWN), tmp_path / "runs", tmp_path / "results")
    finals = {"attacked": [0.70, 0.71, 0.72], "clean": [0.80, 0.80, 0.80]}
    _records_with(study, finals, {"attacked": attacked, "clean": clean})
    (line,) = verdict_lines(study)
    assert line.endswith(f"**fails**{mark}, A - B -9.00 points, 95% interval [-11.48, -6.52]")
    table_verdict = f"| fails{mark} "  # the table pads its cells
    assert table_verdict in report_text(study)


RATIO = BREAKDOWN.replace(
    "protocol: {eval.every: 1, eval.stats_pass: false}",
    "protocol: {eval.every: 1, eval.stats_pass: false, eval.test_samples: 200}",
).replace(
    "  - {a: attacked, b: clean, shape: non-inferiority, margin_points: 5}",
    """  - {a: attacked, b: clean, shape: non-inferiority, margin_points: 5}
  - {a: attacked, b: clean, metric: attack_success, reading: ratio,
     shape: non-inferiority, margin_ratio: 2}""",
)


def _rows_records(study, rows: dict[str, list[dict[str, float]]]) -> None:
    """One-round records of several metrics (by method, one row per seed)."""
    for name, seeds in rows.items():
        for seed, metrics in enumerate(seeds):
            row = {"round": 1, **metrics, "bytes_down": 0, "bytes_up": 0, "macs": 0}
            point = study.records_dir / f"{name}-s{seed}"
            point.mkdir(parents=True)
            (point / "metrics.jsonl").write_text(json.dumps(row) + "\n")
            (point / "summary.json").write_text(json.dumps({"seed": seed, "final": row}))


def test_a_ratio_claim_reads_its_own_metric_as_the_mean_log_ratio(tmp_path):
    """Hand-made records: the attacked run's attack success 0.12, 0.09, 0.10 against the
    clean run's 0.10, 0.06, 0.08: ln(B/A) x 100 = -18.232, -40.547, -22.314 log points,
    mean -27.031, sd 11.8814, 95% interval -27.031 -+ 4.3027 x 6.8597 = [-56.55, +2.48],
    above -100 ln 2 = -69.31 -> non-inferior, A/B exp(0.27031) = 1.310. The first
    comparison reads the primary (global_acc 0.80, 0.79, 0.81 against 0.90, 0.90, 0.90: -10,
    -11, -9 points, below -5 -> fails); the second its own metric, not the primary."""
    study = open_study(_study(tmp_path, RATIO), tmp_path / "runs", tmp_path / "results")
    _rows_records(study, {
        "attacked": [{"global_acc": g, "attack_success": s}
                     for g, s in zip([0.80, 0.79, 0.81], [0.12, 0.09, 0.10], strict=True)],
        "clean": [{"global_acc": 0.90, "attack_success": s} for s in [0.10, 0.06, 0.08]],
    })  # fmt: skip
    primary, ratio = verdict_lines(study)
    assert primary.endswith("**fails**, A - B -10.00 points, 95% interval [-12.48, -7.52]")
    assert ratio == (
        "tiny, attacked vs clean on attack_success ratio (A no worse than B by more than "
        "69.3147 log points (non-inferiority): A/B at most 2, attack_success ratio at final, "
        "3 seeds, attack_success ratio A/B 1.310, each floored at 0.0025, half of one of 200 "
        "test images): **non-inferior**, A - B -27.03 log points, 95% interval "
        "[-56.55, +2.48]"
    )
    report = report_text(study)
    assert "| attacked vs clean on attack_success ratio | (its only setting) | attack_success " in (
        report
    )
    assert "| -27.03 (A/B 1.310) | [-56.55, +2.48] |" in report


def test_a_ratio_floors_an_attack_success_of_zero_at_half_a_test_image(tmp_path):
    """Hand-made records: the clean run's attack success 0 on every seed, the attacked run's
    0, 0.001 and 0.01; floored at 0.5 / 200 = 0.0025: ln(0.0025 / 0.0025) = 0 twice and
    ln(0.0025 / 0.01) = -138.63 log points: mean -46.21, A/B exp(0.4621) = 1.587; sd 80.04,
    95% interval -46.21 -+ 4.3027 x 46.21 = [-245.03, +152.61] -> tie. Unfloored, the logs
    are infinite."""
    study = open_study(_study(tmp_path, RATIO), tmp_path / "runs", tmp_path / "results")
    _rows_records(study, {
        "attacked": [{"global_acc": 0.9, "attack_success": s} for s in [0.0, 0.001, 0.01]],
        "clean": [{"global_acc": 0.9, "attack_success": 0.0}] * 3,
    })  # fmt: skip
    ratio = verdict_lines(study)[1]
    assert ratio.endswith(
        "attack_success ratio A/B 1.587, each floored at 0.0025, half of one of 200 test "
        "images): **tie**, A - B -46.21 log points, 95% interval [-245.03, +152.61]"
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("metric: attack_success,", "metric: attack_sucess,"),
         "metric 'attack_sucess': one of global_acc"),
        (("metric: attack_success,", "metric: global_acc,"),
         "reading: ratio reads a share where lower is better"),
        (("metric: attack_success,", "metric: local_ppl,"),
         "a perplexity is already read as a log ratio"),
        (("metric: attack_success, ", ""), "reading: ratio reads a share where lower is better"),
        (("margin_ratio: 2}", "margin_ratio: 2, margin_points: 5}"),
         "a ratio reading's margin is margin_ratio"),
        (("margin_ratio: 2}", "margin_ratio: 1}"), "Input should be greater than 1"),
        ((", margin_ratio: 2}", "}"), "a non-inferiority claim needs margin_ratio > 1"),
        (("reading: ratio,", "reading: difference,"),
         "margin_ratio is the margin of `reading: ratio`"),
        (("reading: ratio,", "reading: log,"), "'difference' or 'ratio'"),
    ],
)  # fmt: skip
def test_a_ratio_comparison_is_declared_whole(tmp_path, change, message):
    path = _study(tmp_path, RATIO.replace(*change))
    with pytest.raises(ConfigError) as caught:
        open_study(path, tmp_path / "runs", tmp_path / "results")
    assert message in str(caught.value)


def test_a_ratio_cell_beyond_the_breakdown_is_marked_and_an_unset_test_set_assumed(tmp_path):
    """The ratio's line carries the beyond-breakdown mark as any other; without
    `eval.test_samples` the floor is half of one image of an assumed 10,000-image test set.
    Records as in the hand computation above: the attacked run's attack success 0.12, 0.09,
    0.10 against 0.10, 0.06, 0.08 -> non-inferior, A - B -27.03 log points."""
    text = RATIO.replace(", eval.test_samples: 200", "")
    study = open_study(_study(tmp_path, text), tmp_path / "runs", tmp_path / "results")
    _rows_records(study, {
        "attacked": [{"global_acc": 0.8, "attack_success": s} for s in [0.12, 0.09, 0.10]],
        "clean": [{"global_acc": 0.9, "attack_success": s} for s in [0.10, 0.06, 0.08]],
    })  # fmt: skip
    for seed in range(3):
        path = study.records_dir / f"attacked-s{seed}" / "summary.json"
        beyond = {"attack": {"malicious": [3]}, "breakdown": {"max_share": 0.25}}
        path.write_text(json.dumps({**json.loads(path.read_text()), **beyond}))
    ratio = verdict_lines(study)[1]
    assert ratio.endswith(
        "each floored at 5e-05, half of one of 10,000 test images (eval.test_samples unset: "
        "assumed)): **non-inferior**, beyond breakdown (25 % of elements), A - B -27.03 log "
        "points, 95% interval [-56.55, +2.48]"
    )


def test_a_single_seed_reads_its_difference_without_an_interval(tmp_path):
    """One shared seed: the difference is read (A 0.80 against B 0.75, +5.00 points) and the
    line says there is no interval, never a NaN one."""
    study = open_study(_study(tmp_path), tmp_path / "runs", tmp_path / "results")
    _final_records(study, {"fedprox": [0.80], "fedavg": [0.75]})
    (line,) = verdict_lines(study)
    assert line.endswith("A - B +5.00 points, no interval at 1 seed") and "nan" not in line


def test_a_seeds_points_run_on_their_own_and_the_rest_after_them(tmp_path, capsys):
    """`--seed 1` runs seed 1's points only (one study split over processes or machines);
    the full run then adds the other seeds' points, leaving seed 1's records as they were."""
    _study(tmp_path)
    assert main([*_args(tmp_path, "run"), "--seed", "1"]) == 0
    records = tmp_path / "results" / "tiny"
    ledger = json.loads((records / "ledger.json").read_text())
    assert sorted(ledger) == ["fedavg-s1", "fedprox-s1"]
    kept = (records / "fedavg-s1" / "metrics.jsonl").read_bytes()
    assert main(_args(tmp_path, "run")) == 0
    after = json.loads((records / "ledger.json").read_text())
    assert len(after) == 6 and {k: after[k] for k in ledger} == ledger
    assert (records / "fedavg-s1" / "metrics.jsonl").read_bytes() == kept


def test_a_seed_the_study_does_not_declare_is_refused(tmp_path):
    study = open_study(_study(tmp_path), tmp_path / "runs", tmp_path / "results")
    with pytest.raises(ConfigError, match=r"seed\(s\) \[7\] not among its declared seeds"):
        run_study(study, show_progress=False, seeds=[1, 7])
    assert not (tmp_path / "runs" / "tiny").exists()


def test_the_ledger_is_read_and_rewritten_under_the_folders_lock(tmp_path, monkeypatch):
    """Processes running other seeds record into one ledger: the read that the rewrite
    starts from happens while the records folder is locked, so no entry is dropped."""
    import fcntl
    import os

    from hetfl import study as study_module

    study = open_study(_study(tmp_path), tmp_path / "runs", tmp_path / "results")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for f in study_module.RECORDS:
        (run_dir / f).write_text("{}\n")
    study.records_dir.mkdir(parents=True)
    (study.records_dir / "ledger.json").write_text('{"other-s0": {"wall_s": 1.0, "cpu_s": 1.0}}')
    held = []
    read = study_module.Study.ledger

    def ledger_while_locked(self):
        folder = os.open(self.records_dir, os.O_RDONLY)
        try:
            fcntl.flock(folder, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held.append(False)
        except BlockingIOError:
            held.append(True)
        finally:
            os.close(folder)
        return read(self)

    monkeypatch.setattr(study_module.Study, "ledger", ledger_while_locked)
    study_module._record(study, "fedavg-s0", run_dir, 2.0, 3.0)
    assert held == [True]
    assert sorted(json.loads((study.records_dir / "ledger.json").read_text())) == [
        "fedavg-s0",
        "other-s0",
    ]


def test_a_point_another_process_recorded_meanwhile_is_not_run_again(tmp_path, monkeypatch):
    """While the first point runs, another process (`--seed`) records the second: the run
    skips it, keeps that process's entry, and runs the rest."""
    import shutil

    from hetfl import runner
    from hetfl import study as study_module

    study = open_study(_study(tmp_path), tmp_path / "runs", tmp_path / "results")
    real, ran = runner.run_one, []

    def run_one(config, run_dir, **kwargs):
        real(config, run_dir, **kwargs)
        ran.append(run_dir.name)
        if len(ran) == 1:  # the other process records fedavg-s0 (a copy of these records)
            for f in study_module.RECORDS:
                (study.records_dir / "fedavg-s0").mkdir(parents=True, exist_ok=True)
                shutil.copyfile(run_dir / f, study.records_dir / "fedavg-s0" / f)
            study.records_dir.mkdir(parents=True, exist_ok=True)
            (study.records_dir / "ledger.json").write_text('{"fedavg-s0": {"wall_s": 7.0}}')

    monkeypatch.setattr(runner, "run_one", run_one)
    assert run_study(study, show_progress=False) == 0
    assert ran == ["fedprox-s0", "fedprox-s1", "fedavg-s1", "fedprox-s2", "fedavg-s2"]
    assert json.loads((study.records_dir / "ledger.json").read_text())["fedavg-s0"] == {
        "wall_s": 7.0
    }
