"""Comparison tables and plots from hand-made run folders."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import get_args

import pytest

from hetfl.cli import main
from hetfl.config.sections import TargetConfig
from hetfl.engine.outputs import ROW_KEYS, TARGET_METRICS, Target, read_metrics
from hetfl.paired import (
    TIME_RULE,
    PairedDifference,
    Rule,
    interval_verdict,
    paired_difference,
    paired_differences,
    paired_rows,
)
from hetfl.report import comparison_rows, final_spreads, find_runs, format_table, spread


def _fake_run(path: Path, seed: int, accs: list[float], target_round: int | None) -> Path:
    """A finished run folder with the output contract's files, metrics made up by hand."""
    path.mkdir(parents=True)
    rows = []
    for i, acc in enumerate(accs, start=1):
        row = dict.fromkeys(ROW_KEYS)
        row.update(round=i, clients=2, failed=0, global_acc=acc, local_acc=None,
                   bytes_down=1_000_000 * i, bytes_up=500_000 * i, macs=0, groups={})  # fmt: skip
        rows.append(row)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    best = max(rows, key=lambda r: r["global_acc"])
    target = {"metric": "global_acc", "value": 0.5, "round": target_round,
              "bytes": None if target_round is None else 1_500_000 * target_round}  # fmt: skip
    summary = {"name": "x", "seed": seed, "rounds_completed": len(rows), "final": rows[-1],
               "best": best, "targets": [target]}  # fmt: skip
    (path / "summary.json").write_text(json.dumps(summary))
    return path


@pytest.fixture
def sweep(tmp_path: Path) -> Path:
    _fake_run(tmp_path / "fedavg-s0", 0, [0.4, 0.6], 2)
    _fake_run(tmp_path / "fedavg-s1", 1, [0.5, 0.8], 1)
    _fake_run(tmp_path / "fedavg-s2", 2, [0.3, 0.7], 2)
    _fake_run(tmp_path / "fedprox-s0", 0, [0.2, 0.3], None)
    return tmp_path


def test_comparison_means_and_sample_sds_by_hand(sweep: Path):
    rows = {r["run"]: r for r in comparison_rows(find_runs([sweep]))}
    avg = rows["fedavg"]
    assert avg["seeds"] == "3"
    # final 0.6, 0.8, 0.7: mean 0.7, sample sd sqrt(((-.1)^2 + .1^2 + 0) / 2) = 0.1
    assert avg["final global_acc"] == "0.7000 ± 0.1000"
    assert avg["best global_acc"] == "0.7000 ± 0.1000"
    # rounds to target 2, 1, 2: mean 5/3, sd sqrt((1/9 + 4/9 + 1/9) / 2) = 0.577
    assert avg["rounds to global_acc>=0.5"] == "1.7 ± 0.6"
    # MB to target 3.0, 1.5, 3.0
    assert avg["MB to global_acc>=0.5"] == "2.5 ± 0.9"
    assert avg["MB sent"] == "3.0 ± 0.0"
    prox = rows["fedprox"]
    assert prox["final global_acc"] == "0.3000 ± 0.0000"
    assert prox["rounds to global_acc>=0.5"] == "-"  # never reached: no number invented


def test_partial_hits_are_flagged(tmp_path: Path):
    _fake_run(tmp_path / "a-s0", 0, [0.6], 1)
    _fake_run(tmp_path / "a-s1", 1, [0.1], None)
    row = comparison_rows(find_runs([tmp_path]))[0]
    assert row["rounds to global_acc>=0.5"] == "1.0 ± 0.0 (1/2)"


def test_compare_and_plot_commands(sweep: Path, tmp_path: Path, capsys):
    assert main(["compare", str(sweep)]) == 0
    out = capsys.readouterr().out
    assert out.strip() == format_table(comparison_rows(find_runs([sweep])))
    png = tmp_path / "cmp.png"
    assert main(["plot", str(sweep), "-o", str(png), "--x", "bytes"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_target_chosen_after_the_runs_is_found_in_their_rows(sweep: Path, capsys):
    """`--target global_acc=0.65` is looked for in each run's metrics.jsonl; the summaries'
    own 0.5 target is not shown."""
    assert main(["compare", str(sweep), "--target", "global_acc=0.65"]) == 0
    out = capsys.readouterr().out
    assert "global_acc>=0.5" not in out
    avg = {r["run"]: r for r in comparison_rows(find_runs([sweep]), [Target("global_acc", 0.65)])}
    # s0 0.4, 0.6: never; s1 0.5, 0.8: round 2; s2 0.3, 0.7: round 2
    assert avg["fedavg"]["rounds to global_acc>=0.65"] == "2.0 ± 0.0 (2/3)"
    assert avg["fedavg"]["MB to global_acc>=0.65"] == "3.0 ± 0.0 (2/3)"
    assert avg["fedprox"]["rounds to global_acc>=0.65"] == "-"


@pytest.mark.parametrize("bad", ["val_acc", "accuracy=0.8", "val_acc=high"])
def test_a_malformed_target_is_refused_naming_the_metrics(sweep: Path, bad: str, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["compare", str(sweep), "--target", bad])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "val_acc" in err and repr(bad) in err


def test_target_metrics_are_what_a_config_target_accepts():
    assert get_args(TargetConfig.model_fields["metric"].annotation) == TARGET_METRICS


def test_compare_without_runs_is_a_clear_error(tmp_path: Path, capsys):
    assert main(["compare", str(tmp_path)]) == 2
    assert "no finished runs" in capsys.readouterr().err


def test_each_sub_models_final_accuracy_is_a_column(tmp_path: Path):
    for seed, (wide, mean) in enumerate([(0.6, 0.5), (0.8, 0.6)]):
        run = _fake_run(tmp_path / f"flanc-s{seed}", seed, [0.1, wide], None)
        summary = json.loads((run / "summary.json").read_text())
        summary["final"]["groups"] = {
            "capacity=1": {"acc": wide, "n": 100},
            "capacity=mean": {"acc": mean, "n": 100},
        }
        summary["final"]["macs"] = 2e9 * (seed + 1)
        (run / "summary.json").write_text(json.dumps(summary))
    (row,) = comparison_rows(find_runs([tmp_path]))
    assert row["final capacity=1"] == "0.7000 ± 0.1414"  # sd of 0.6, 0.8
    assert row["final capacity=mean"] == "0.5500 ± 0.0707"
    assert row["GMAC"] == "3.00 ± 1.41"


def test_local_acc_trained_is_a_column_where_measured_and_a_plotted_curve(
    tmp_path: Path, monkeypatch
):
    """`final local_acc_trained` appears for the runs that measured it (eval.local_trained)
    and not otherwise; `hetfl plot` draws it beside global_acc and local_acc."""
    for seed, acc in enumerate([0.5, 0.9]):
        run = _fake_run(tmp_path / "sweep" / f"fedfa-s{seed}", seed, [0.1, 0.2], None)
        rows = read_metrics(run / "metrics.jsonl")
        for row in rows:
            row["local_acc_trained"] = acc
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        summary = json.loads((run / "summary.json").read_text())
        summary["final"]["local_acc_trained"] = acc
        (run / "summary.json").write_text(json.dumps(summary))
    _fake_run(tmp_path / "sweep" / "fedavg-s0", 0, [0.1, 0.2], None)
    rows = {r["run"]: r for r in comparison_rows(find_runs([tmp_path / "sweep"]))}
    assert rows["fedfa"]["final local_acc_trained"] == "0.7000 ± 0.2828"  # sd of 0.5, 0.9
    assert "final local_acc_trained" not in rows["fedavg"]
    axes = pytest.importorskip("matplotlib.axes")
    drawn, original = [], axes.Axes.plot

    def recording(self, *args, **kwargs):
        drawn.append(kwargs.get("label"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(axes.Axes, "plot", recording)
    assert main(["plot", str(tmp_path / "sweep"), "-o", str(tmp_path / "p.png")]) == 0
    assert "fedfa local_acc_trained" in drawn and "fedavg local_acc_trained" not in drawn


def _write_trace(run: Path, final: list[float], groups: list[str | None]) -> None:
    """A `clients.jsonl` whose last evaluated round (3) scores clients 0.. with `final`;
    round 2 scores them otherwise, and round 4 only trains (no local score)."""
    rows = []
    for rnd, accs in ((2, [0.0] * len(final)), (3, final), (4, [None] * len(final))):
        for cid, (acc, group) in enumerate(zip(accs, groups, strict=True)):
            rows.append({"round": rnd, "cid": cid, "local_acc": acc, "group": group})
    (run / "clients.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_local_accuracy_spread_over_clients_by_hand(sweep: Path):
    accs = [0.2, 0.4, 0.6, 0.6, 0.6, 0.6, 0.6, 0.6, 0.8, 1.0]
    groups = ["local width=1"] * 5 + ["local width=0.5"] * 5
    _write_trace(sweep / "fedavg-s0", accs, groups)
    _write_trace(sweep / "fedavg-s1", [0.5, 0.7, 0.9], [None] * 3)
    spreads = final_spreads(read_metrics(sweep / "fedavg-s0" / "clients.jsonl"))
    # 10 clients: the worst decile is the lowest one; mean 0.6, deviations -.4 -.2 0 ... .2 .4
    assert spreads[None].worst_decile == 0.2 and spreads[None].n == 10
    assert spreads[None].sd == pytest.approx(math.sqrt((0.16 + 0.04 + 0.04 + 0.16) / 10))
    # per group of 5: [.2 .4 .6 .6 .6] (mean .48) and [.6 .6 .6 .8 1] (mean .72)
    wide, narrow = spreads["local width=1"], spreads["local width=0.5"]
    assert (wide.worst_decile, narrow.worst_decile) == (0.2, 0.6)
    assert wide.sd == pytest.approx(0.16) and narrow.sd == pytest.approx(0.16)
    # 12 clients: ceil(12 / 10) = 2 make the worst decile
    assert spread([0.9, 0.1, 0.5, 0.3, *[1.0] * 8]).worst_decile == pytest.approx(0.2)

    rows = {r["run"]: r for r in comparison_rows(find_runs([sweep]))}
    avg = rows["fedavg"]
    # seeds: worst deciles 0.2, 0.5 and none for s2 (no trace); mean 0.35, sd 0.2121
    assert avg["local_acc worst 10%"] == "0.3500 ± 0.2121 (2/3)"
    sd_s1 = math.sqrt(0.08 / 3)  # [.5 .7 .9] around .7
    mean = (0.2 + sd_s1) / 2
    sd = math.sqrt(((0.2 - mean) ** 2 + (sd_s1 - mean) ** 2) / 1)
    assert avg["local_acc client sd"] == f"{mean:.4f} ± {sd:.4f} (2/3)"
    assert avg["local_acc worst 10% local width=0.5"] == "0.6000 ± 0.0000 (1/3)"
    assert rows["fedprox"]["local_acc worst 10%"] == "-"  # a run without a trace


# -- paired comparison ---------------------------------------------------------------------------
def _paired_run(path: Path, seed: int, final: dict, best_val: dict | None = None) -> None:
    """A finished run whose final row holds `final` (a `width=` / `capacity=` entry becomes
    a group); with `best_val`, a first row of those scores chosen by validation."""
    path.mkdir(parents=True)

    def row(rnd: int, scores: dict) -> dict:
        r = dict.fromkeys(ROW_KEYS)
        groups = {k: {"acc": v} for k, v in scores.items() if "=" in k}
        r.update({k: v for k, v in scores.items() if "=" not in k}, round=rnd, groups=groups)
        return r

    rows = ([row(1, best_val)] if best_val else []) + [row(2, final)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {"seed": seed, "final": rows[-1], "best": rows[-1]}
    if best_val:
        summary["best_by_val"] = {"round": 1, "val_acc": 0.5, "global_acc": best_val["global_acc"]}
    (path / "summary.json").write_text(json.dumps(summary))


#: Student's t quantiles from a printed table (not scipy): t(0.975, df) and t(0.80, df).
T975 = {2: 4.302653, 3: 3.182446, 4: 2.776445}
T80 = {2: 1.060660, 3: 0.978472, 4: 0.940965}


def test_paired_differences_their_intervals_and_verdicts_by_hand(tmp_path: Path):
    """FLANC - HeteroFL over seeds 0-2 (seed 3 only FLANC ran: left out), IID setting.
    global_acc: d = 0.05, 0.03, 0.04: mean 4 points, sd 1, se 0.577, 95 % interval
    4 -+ 4.303 x 0.577 = [1.52, 6.48] -> holds; detectable (4.303 + 1.061) x 1 / sqrt(3) =
    3.10 points. width 0.5 (FLANC's capacity=0.5): d = 2, -1, 0.5 points: mean 0.5, sd 1.5,
    interval [-3.23, 4.23] -> tie. local_acc: d = -3 points each: sd 0, [-3, -3] -> fails.
    At the best-validation round: d = 0.1 point each -> holds (margin 0: any difference
    the seeds agree on)."""
    flanc = [(0.85, 0.80, 0.70), (0.83, 0.78, 0.70), (0.84, 0.805, 0.70), (0.9, 0.9, 0.9)]
    hetero = [(0.80, 0.78, 0.73), (0.80, 0.79, 0.73), (0.80, 0.80, 0.73)]
    for seed, (g, half, local) in enumerate(flanc):
        best = {"global_acc": 0.501 + seed / 10}
        _paired_run(tmp_path / f"flanc-s{seed}-kind=iid", seed,
                    {"global_acc": g, "local_acc": local, "capacity=0.5": half}, best)  # fmt: skip
    for seed, (g, half, local) in enumerate(hetero):
        best = {"global_acc": 0.5 + seed / 10}
        _paired_run(tmp_path / f"heterofl-s{seed}-kind=iid", seed,
                    {"global_acc": g, "local_acc": local, "width=0.5": half}, best)  # fmt: skip
    _paired_run(tmp_path / "heterofl-s0-kind=classes", 0, {"global_acc": 0.5})  # unpaired
    runs = find_runs([tmp_path])
    found = {(d.setting, d.metric, d.at): d for d in paired_differences(runs, "flanc", "heterofl")}
    assert set(found) == {
        ("kind=iid", "global_acc", "final"),
        ("kind=iid", "local_acc", "final"),
        ("kind=iid", "p=0.5", "final"),
        ("kind=iid", "global_acc", "best val"),
    }
    g = found["kind=iid", "global_acc", "final"]
    assert (g.n, g.verdict) == (3, "holds")
    assert g.mean == pytest.approx(0.04) and g.se == pytest.approx(0.01 / math.sqrt(3))
    half_width = T975[2] * 0.01 / math.sqrt(3)
    assert g.interval == pytest.approx((0.04 - half_width, 0.04 + half_width), abs=1e-6)
    assert g.detectable == pytest.approx((T975[2] + T80[2]) * 0.01 / math.sqrt(3), abs=1e-6)
    half = found["kind=iid", "p=0.5", "final"]
    assert half.mean == pytest.approx(0.005) and half.se == pytest.approx(0.015 / math.sqrt(3))
    assert half.interval[0] == pytest.approx(0.005 - T975[2] * 0.015 / math.sqrt(3), abs=1e-6)
    assert half.verdict == "tie"
    local = found["kind=iid", "local_acc", "final"]
    assert local.mean == pytest.approx(-0.03) and local.se == pytest.approx(0, abs=1e-12)
    assert local.verdict == "fails"
    assert found["kind=iid", "global_acc", "best val"].verdict == "holds"
    rows = paired_rows([g])
    assert rows == [{"setting": "kind=iid", "metric": "global_acc", "at": "final", "seeds": "3",
                     "A - B": "+4.00", "95% interval": "[+1.52, +6.48]",
                     "detectable (80%)": "3.10 (observed)", "verdict": "holds"}]  # fmt: skip


def _judged(diffs: list[float], rule: Rule | None = None) -> PairedDifference:
    a, b = [0.5 + d for d in diffs], [0.5] * len(diffs)
    return paired_difference("s", "m", "final", a, b, rule or Rule())


def test_the_verdict_reads_the_interval_against_the_declared_margin():
    """Superiority (margin 0, then 1 point) and non-inferiority (margin 2 points) on the
    same differences; d = 1, 2, 3 points: mean 2, sd 1, 95 % interval 2 -+ 4.303 x 0.577 =
    [-0.48, 4.48]; d = 3, 4, 5: [1.52, 6.48]; d = -5, -4, -3: [-6.48, -1.52]."""
    up, far, down = [0.01, 0.02, 0.03], [0.03, 0.04, 0.05], [-0.05, -0.04, -0.03]
    half_width = T975[2] * 0.01 / 3**0.5
    assert _judged(up).interval == pytest.approx((0.02 - half_width, 0.02 + half_width), abs=1e-6)
    assert [_judged(d).verdict for d in (up, far, down)] == ["tie", "holds", "fails"]
    one_point = Rule("superiority", 0.01)
    assert _judged(far, one_point).verdict == "holds"  # 1.52 > 1
    assert _judged([0.014, 0.015, 0.016], one_point).verdict == "holds"
    assert _judged([0.004, 0.005, 0.006], one_point).verdict == "fails"  # above 0, below 1
    two_worse = Rule("non-inferiority", 0.02)
    assert _judged(up, two_worse).verdict == "non-inferior"  # -0.48 > -2
    assert _judged(far, two_worse).verdict == "holds"  # above 0
    assert _judged(down, two_worse).verdict == "tie"  # [-6.48, -1.52] holds -2
    assert _judged([-0.05, -0.045, -0.04], two_worse).verdict == "fails"
    # exactly on the margin, to within the rounding of accuracies, is a tie
    assert _judged([0.01, 0.01, 0.01], one_point).verdict == "tie"


def test_fewer_than_three_seeds_give_no_verdict_and_the_pilot_spread_sets_the_power():
    assert _judged([0.1]).verdict == "inconclusive"
    two = _judged([0.10, 0.12])
    assert (two.verdict, two.detectable_from) == ("inconclusive", "observed")
    four = _judged([0.01, 0.02, 0.03, 0.02], Rule(pilot_sd=0.04))
    assert four.detectable_from == "pilot"
    assert four.detectable == pytest.approx((T975[3] + T80[3]) * 0.04 / 2, abs=1e-6)
    (row,) = paired_rows([_judged([0.1])])
    assert (row["95% interval"], row["detectable (80%)"]) == ("-", "-")


def test_a_claim_is_checked_when_declared():
    with pytest.raises(ValueError, match="non-inferiority claim needs its margin"):
        Rule("non-inferiority")
    with pytest.raises(ValueError, match="margin is >= 0"):
        Rule("superiority", -0.01)
    with pytest.raises(ValueError, match="one of superiority, non-inferiority"):
        Rule("equivalence")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pilot spread is >= 0"):
        Rule(pilot_sd=-1.0)


def _timed_run(path: Path, seed: int, accs: list[float]) -> None:
    """A run whose val_acc per round is `accs`."""
    path.mkdir(parents=True)
    rows = [{**dict.fromkeys(ROW_KEYS), "round": i, "val_acc": a, "bytes_down": 0,
             "bytes_up": 0, "macs": 0, "sim_time_s": 0.0, "groups": {}}
            for i, a in enumerate(accs, start=1)]  # fmt: skip
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "summary.json").write_text(json.dumps({"seed": seed, "final": rows[-1]}))


def test_time_to_target_reports_censored_seeds_and_keeps_only_verdicts_they_cannot_turn(
    tmp_path: Path,
):
    """Rounds to val_acc >= 0.8, B - A. FedAvg reaches it at rounds 2, 2, 3; FedProx at 4, 5
    and never in 5 rounds (censored at 5): d = 2, 3, 2 (a lower bound: the censored run
    would take longer, so 'A faster' can only strengthen) -> holds, with B's censoring
    reported. Swapped, A's censored seed could turn 'A slower' into anything but the
    verdict 'fails' it already gives: kept."""
    reach = {"fedavg": [2, 2, 3], "fedprox": [4, 5, None]}
    for name, rounds in reach.items():
        for seed, r in enumerate(rounds):
            accs = [0.5] * 5 if r is None else [0.5] * (r - 1) + [0.85] * (6 - r)
            _timed_run(tmp_path / f"{name}-s{seed}", seed, accs[:5])
    runs, target = find_runs([tmp_path]), Target("val_acc", 0.8)
    (d,) = paired_differences(runs, "fedavg", "fedprox", targets=[target])
    assert (d.metric, d.at, d.diffs, d.censored) == (
        "rounds to val_acc>=0.8", "first reached", (2.0, 3.0, 2.0), (0, 1))  # fmt: skip
    assert d.verdict == "holds"
    (row,) = paired_rows([d])
    assert row["seeds"] == "3 (censored: A 0, B 1)" and row["A - B"] == "+2.3"
    (swapped,) = paired_differences(runs, "fedprox", "fedavg", targets=[target])
    assert (swapped.censored, swapped.verdict) == ((1, 0), "fails")
    # a censored seed on the side the verdict does not favour: no verdict
    _timed_run(tmp_path / "fedadam-s0", 0, [0.5] * 5)
    for seed, r in ((1, 5), (2, 5)):
        _timed_run(tmp_path / f"fedadam-s{seed}", seed, [0.5] * (r - 1) + [0.9])
    (mixed,) = paired_differences(find_runs([tmp_path]), "fedadam", "fedprox", targets=[target])
    assert mixed.censored == (1, 1) and mixed.verdict == "inconclusive"
    # 'A faster' computed with A's censored seed (a 2-round run) standing in: d = 2, 3, 3,
    # interval [1.23, 4.10], but the true d of seed 0 may be anything below 2: no verdict
    for seed in range(3):
        _timed_run(tmp_path / f"fedbn-s{seed}", seed, [0.5] * 3 + [0.9] * 2)
        _timed_run(tmp_path / f"fedyogi-s{seed}", seed, [0.5] * 2 if seed == 0 else [0.9] * 5)
    (hidden,) = paired_differences(find_runs([tmp_path]), "fedyogi", "fedbn", targets=[target])
    assert (hidden.diffs, hidden.censored) == ((2.0, 3.0, 3.0), (1, 0))
    assert interval_verdict(*hidden.interval, TIME_RULE) == "holds"
    assert hidden.verdict == "inconclusive"


def test_compare_paired_command_and_its_errors(tmp_path: Path, capsys):
    for seed, acc in enumerate((0.7, 0.8, 0.75)):
        _paired_run(tmp_path / f"fedavg-s{seed}", seed, {"global_acc": acc})
        _paired_run(tmp_path / f"fedprox-s{seed}", seed, {"global_acc": acc - 0.1 + seed / 100})
    assert main(["compare", str(tmp_path), "--paired", "fedavg", "fedprox"]) == 0
    out = capsys.readouterr().out
    assert "claim: A better than B by more than 0 points (superiority)" in out
    assert "| (its only setting) | global_acc | final | 3     | +9.00 | [+6.52, +11.48]" in out
    assert out.rstrip().endswith("| holds   |")
    argv = ["compare", str(tmp_path), "--paired", "fedavg", "fedprox"]
    assert main([*argv, "--claim", "non-inferiority", "--margin", "12"]) == 0
    assert "by more than 12 points (non-inferiority)" in capsys.readouterr().out
    assert main([*argv, "--claim", "non-inferiority"]) == 2
    assert "non-inferiority claim needs its margin" in capsys.readouterr().err
    assert main(["compare", str(tmp_path), "--margin", "1"]) == 2
    assert "judge a --paired comparison" in capsys.readouterr().err
    assert main(["compare", str(tmp_path), "--paired", "fedavg", "flanc"]) == 2
    assert "no runs of 'flanc' among the runs given (algorithms and settings found: fedavg," in (
        capsys.readouterr().err
    )
    _paired_run(tmp_path / "flanc-s5", 5, {"global_acc": 0.5})  # no seed shared with fedavg
    assert main(["compare", str(tmp_path), "--paired", "fedavg", "flanc"]) == 2
    assert "--paired fedavg flanc: no setting and seed that both ran" in capsys.readouterr().err


def test_variants_of_one_algorithm_pair_by_their_point_names(tmp_path: Path):
    for seed in (0, 1):
        for variant, acc in (("scalablefl", 0.8), ("individual", 0.7)):
            path = tmp_path / f"scalablefl-s{seed}-variant={variant}"
            _paired_run(path, seed, {"local_acc": acc + seed / 100})
    runs = find_runs([tmp_path])
    (d,) = paired_differences(
        runs, "scalablefl-variant=scalablefl", "scalablefl-variant=individual"
    )
    assert (d.setting, d.metric, d.n) == ("(its only setting)", "local_acc", 2)
    assert d.verdict == "inconclusive"  # two seeds give no verdict
    assert d.mean == pytest.approx(0.1)


def test_the_local_accuracy_right_after_training_is_paired(tmp_path: Path):
    """FedFA's non-IID local metric (`local_acc_trained`): d = 0.02, 0.04 -> 3 points."""
    for seed, (a, b) in enumerate(((0.90, 0.88), (0.92, 0.88))):
        _paired_run(tmp_path / f"fedfa-s{seed}", seed, {"local_acc_trained": a})
        _paired_run(tmp_path / f"nefl-s{seed}", seed, {"local_acc_trained": b})
    (d,) = paired_differences(find_runs([tmp_path]), "fedfa", "nefl")
    assert (d.metric, d.n, d.verdict) == ("local_acc_trained", 2, "inconclusive")
    assert d.mean == pytest.approx(0.03)


def test_local_acc_stats_is_a_column_when_a_run_reports_it(tmp_path: Path):
    _paired_run(tmp_path / "fedbn-s0", 0, {"local_acc": 0.5, "local_acc_stats": 0.7})
    _paired_run(tmp_path / "fedbn-s1", 1, {"local_acc": 0.5, "local_acc_stats": 0.9})
    _paired_run(tmp_path / "fedavg-s0", 0, {"local_acc": 0.5})
    rows = {r["run"]: r for r in comparison_rows(find_runs([tmp_path]))}
    assert rows["fedbn"]["final local_acc_stats"] == "0.8000 ± 0.1414"
    assert "final local_acc_stats" not in rows["fedavg"]


def test_attack_success_is_a_column_and_a_plotted_curve_when_a_run_reports_it(
    tmp_path: Path, monkeypatch
):
    """A backdoored run's `final attack_success` (mean ± sd over seeds) and its dash-dotted
    curve; a run without a trigger shows neither."""
    for seed, share in enumerate([0.2, 0.6]):
        _paired_run(
            tmp_path / f"fedavg-bd-s{seed}", seed, {"global_acc": 0.5, "attack_success": share}
        )
    _paired_run(tmp_path / "fedavg-s0", 0, {"global_acc": 0.5})
    rows = {r["run"]: r for r in comparison_rows(find_runs([tmp_path]))}
    assert rows["fedavg-bd"]["final attack_success"] == "0.4000 ± 0.2828"
    assert "final attack_success" not in rows["fedavg"]
    axes = pytest.importorskip("matplotlib.axes")
    drawn, original = [], axes.Axes.plot

    def recording(self, *args, **kwargs):
        drawn.append((kwargs.get("label"), args[2] if len(args) > 2 else None))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(axes.Axes, "plot", recording)
    assert main(["plot", str(tmp_path), "-o", str(tmp_path / "p.png")]) == 0
    assert ("fedavg-bd attack_success", "-.") in drawn
    assert not any(label == "fedavg attack_success" for label, _ in drawn)


def test_perplexities_are_columns_and_curves_on_their_own_axis_for_language_models(
    tmp_path: Path, monkeypatch
):
    """A language-model run's `final global_ppl` and `final local_ppl` (mean ± sd over
    seeds), drawn on a log-scaled second axis; an image run shows neither."""
    for seed, ppl in enumerate([3.0, 5.0]):
        final = {"global_acc": 0.5, "global_ppl": ppl, "local_ppl": 2 * ppl}
        _paired_run(tmp_path / f"fedfa-lm-s{seed}", seed, final)
    _paired_run(tmp_path / "fedavg-s0", 0, {"global_acc": 0.5})
    rows = {r["run"]: r for r in comparison_rows(find_runs([tmp_path]))}
    assert rows["fedfa-lm"]["final global_ppl"] == "4.0000 ± 1.4142"
    assert rows["fedfa-lm"]["final local_ppl"] == "8.0000 ± 2.8284"
    assert "final global_ppl" not in rows["fedavg"]
    pytest.importorskip("matplotlib")
    from hetfl.report import comparison_figure

    fig = comparison_figure(find_runs([tmp_path]), "round")
    accuracy, perplexity = fig.axes
    assert {line.get_label() for line in perplexity.get_lines()} == {
        "fedfa-lm global_ppl",
        "fedfa-lm local_ppl",
    }
    assert perplexity.get_yscale() == "log"
    assert "fedfa-lm global_ppl" not in {line.get_label() for line in accuracy.get_lines()}
    only_images = comparison_figure(find_runs([tmp_path / "fedavg-s0"]), "round")
    assert len(only_images.axes) == 1


_MALICIOUS = ("malicious_kept", "malicious_clipped", "malicious_dropped")


def test_malicious_kept_is_a_column_for_defended_attacked_runs(tmp_path: Path):
    """The share of malicious updates let through (kept or clipped) over those decided:
    (1 + 1) / 4 = 0.5 and 3 / 3 = 1 over the seeds: 0.75 ± sd(0.5, 1) = 0.3536. Runs
    without a defence (or without an attack) have no column."""
    for seed, (kept, clipped, dropped) in enumerate([(1, 1, 2), (3, 0, 0)]):
        run = _fake_run(tmp_path / f"krum-s{seed}", seed, [0.1], None)
        summary = json.loads((run / "summary.json").read_text())
        counts = {"kept": kept, "clipped": clipped, "dropped": dropped}
        summary["defence"] = {"kind": "krum", **{f"malicious_{d}": n for d, n in counts.items()}}
        (run / "summary.json").write_text(json.dumps(summary))
    clean = _fake_run(tmp_path / "clean-s0", 0, [0.1], None)
    summary = json.loads((clean / "summary.json").read_text())
    summary["defence"] = {"kind": "krum", **dict.fromkeys(_MALICIOUS)}
    (clean / "summary.json").write_text(json.dumps(summary))
    _fake_run(tmp_path / "fedavg-s0", 0, [0.1], None)
    rows = {r["run"]: r for r in comparison_rows(find_runs([tmp_path]))}
    assert rows["krum"]["malicious kept"] == "0.7500 ± 0.3536"
    assert "malicious kept" not in rows["clean"] and "malicious kept" not in rows["fedavg"]


def test_the_share_of_malicious_updates_let_through_is_a_plotted_curve(tmp_path: Path, monkeypatch):
    """A round's `defence` row kept 1 and clipped 1 of 4 malicious updates: 0.5 is drawn
    dotted with crosses; a round with no malicious update decided draws nothing."""
    decided = {"kind": "norm-clip", "malicious_kept": 1, "malicious_clipped": 1}
    _paired_run(
        tmp_path / "krum-s0", 0, {"global_acc": 0.5, "defence": {**decided, "malicious_dropped": 2}}
    )
    _paired_run(tmp_path / "clean-s0", 0, {"global_acc": 0.5, "defence": {"kind": "krum"}})
    axes = pytest.importorskip("matplotlib.axes")
    drawn, original = [], axes.Axes.plot

    def recording(self, *args, **kwargs):
        drawn.append((kwargs.get("label"), list(args[1]), args[2]))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(axes.Axes, "plot", recording)
    assert main(["plot", str(tmp_path), "-o", str(tmp_path / "p.png")]) == 0
    assert ("krum malicious kept", [0.5], "x:") in drawn
    assert not any(label == "clean malicious kept" for label, _, _ in drawn)


def test_a_comparison_plot_says_what_it_shows(sweep: Path, tmp_path: Path, capsys):
    """A title, whole-number round ticks, one colour per method for all its curves, a
    legend entry naming the band, and the written file's path printed."""
    from matplotlib.colors import same_color

    from hetfl.report import comparison_figure

    runs = find_runs([sweep])
    for run in runs:
        for row in run.rows:
            row["local_acc"] = row["global_acc"] / 2
    ax = comparison_figure(runs, "round").axes[0]
    assert ax.get_title() == "fedavg, fedprox: accuracy against round"
    assert all(float(t).is_integer() for t in ax.get_xticks())
    colours = {}
    for line in ax.get_lines():
        colours.setdefault(line.get_label().split()[0], []).append(line.get_color())
    assert {k: len(v) for k, v in colours.items()} == {"fedavg": 2, "fedprox": 2}
    assert all(same_color(c, v[0]) for v in colours.values() for c in v)
    assert not same_color(colours["fedavg"][0], colours["fedprox"][0])
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "fedavg: lines the mean of 3 seeds, band lowest to highest" in legend
    assert legend.count("fedavg global_acc") == 1 and "fedprox global_acc" in legend
    assert not any(text.startswith("fedprox:") for text in legend)  # one seed: no band
    png = tmp_path / "out" / "p.png"
    assert main(["plot", str(sweep), "-o", str(png)]) == 0
    assert capsys.readouterr().out.strip() == f"(written to {png.resolve()})"


def test_time_to_target_in_simulated_seconds_and_a_run_without_a_clock(tmp_path: Path):
    """DTFL's claim is in training time: DTFL's rounds take 4 simulated seconds, FedAvg's
    10; DTFL reaches val_acc 0.8 at round 3 (12 s), FedAvg at round 2 (20 s), every seed:
    by rounds FedAvg is sooner (d = -1 round), by simulated time DTFL (d = +8 s)."""
    for seed in range(3):
        for name, step, reach in (("dtfl", 4.0, 3), ("fedavg", 10.0, 2)):
            accs = [0.5] * (reach - 1) + [0.85] * (5 - reach + 1)
            _timed_run(tmp_path / f"{name}-s{seed}", seed, accs)
            path = tmp_path / f"{name}-s{seed}" / "metrics.jsonl"
            rows = [json.loads(line) for line in path.read_text().splitlines()]
            path.write_text("".join(json.dumps({**r, "sim_time_s": step * r["round"]}) + "\n"
                                    for r in rows))  # fmt: skip
    runs, target = find_runs([tmp_path]), Target("val_acc", 0.8)
    (rounds,) = paired_differences(runs, "dtfl", "fedavg", targets=[target])
    (seconds,) = paired_differences(runs, "dtfl", "fedavg", targets=[target], clock="sim_time_s")
    assert (rounds.metric, rounds.diffs, rounds.verdict) == (
        "rounds to val_acc>=0.8", (-1.0, -1.0, -1.0), "fails")  # fmt: skip
    assert (seconds.metric, seconds.diffs, seconds.verdict) == (
        "sim s to val_acc>=0.8", (8.0, 8.0, 8.0), "holds")  # fmt: skip
    _timed_run(tmp_path / "fedprox-s0", 0, [0.9])  # its rows have a null simulated time
    path = tmp_path / "fedprox-s0" / "metrics.jsonl"
    path.write_text(path.read_text().replace('"sim_time_s": 0.0', '"sim_time_s": null'))
    with pytest.raises(ValueError, match=r"fedprox-s0: no sim_time_s in its metrics rows"):
        paired_differences(find_runs([tmp_path]), "fedprox", "fedavg", targets=[target],
                           clock="sim_time_s")  # fmt: skip
