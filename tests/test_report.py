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
