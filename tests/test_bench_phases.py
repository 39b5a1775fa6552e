"""`benchmarks/bench_phases.py` (issue 48 item 2): its arithmetic on hand-made `phases`
records (the set-up holds its query once, the ratios, each phase's share of the cores and
when its verdict is printed), its command lines, and `--smoke` on the FedFA run, so that
the benchmark cannot rot. Nothing here asserts a time."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from bench_phase_shares import (
    Span,
    busy_lines,
    first_row_s,
    free_share,
    round_span,
    setup_lines,
    setup_span,
)
from bench_phases import fedfa_args, h_args, parse

from conftest import fmnist_available
from hetfl.config import validate_points

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_phases.py"


def phases() -> dict:
    """Set-up 1 + 4 s wall (its query's 3 s inside `setup`), round 1 2.5 s, 2 cores."""
    return {
        "cores": 2,
        "setup": {
            "data": {"wall_s": 1.0, "cpu_s": 1.0},
            "setup_query": {"wall_s": 3.0, "cpu_s": 3.0},
            "setup": {"wall_s": 4.0, "cpu_s": 4.5},
        },
        "rounds": {
            "1": {
                "train": {"wall_s": 2.0, "cpu_s": 3.6},
                "server_phase": {"wall_s": 0.0, "cpu_s": 0.0},
                "eval": {"wall_s": 0.5, "cpu_s": 0.9},
            }
        },
    }


def test_the_set_up_counts_its_query_once() -> None:
    assert setup_span(phases()) == Span(5.0, 5.5)
    assert round_span(phases(), 1) == Span(2.5, 4.5)
    assert round_span(phases(), 1, ["train"]) == Span(2.0, 3.6)


def test_the_set_up_lines_hold_the_wall_and_cpu_ratios() -> None:
    lines = setup_lines("F", phases())
    assert "F setup/round-1 ratio: 2.00  target <= 2.00: met" in lines  # 5.0 / 2.5
    assert "F setup/round-1 cpu ratio: 1.22  (CPU seconds)" in lines  # 5.5 / 4.5
    assert "F setup/round-1-train ratio: 2.50  (cpu 1.53)" in lines  # 5 / 2, 5.5 / 3.6
    slow = phases()
    slow["setup"]["setup"]["wall_s"] = 4.1
    assert "F setup/round-1 ratio: 2.04  target <= 2.00: MISSED" in setup_lines("F", slow)


def test_each_phase_share_of_the_cores_and_its_verdict() -> None:
    lines = busy_lines("H", phases(), judged=True)
    assert "H busy r1 train: 0.90  target >= 0.85: met  (2.0 s wall, 3.6 s cpu, 2 cores)" in lines
    assert "H busy r1 eval: 0.90  target >= 0.85: met  (0.5 s wall, 0.9 s cpu, 2 cores)" in lines
    assert (
        "H busy setup_query: 0.50  target >= 0.85: MISSED  (3.0 s wall, 3.0 s cpu, 2 cores)"
        in lines
    )
    assert not any("server_phase" in line for line in lines)  # no time: no share
    short = phases()
    short["rounds"]["1"]["eval"] = {"wall_s": 0.4, "cpu_s": 0.8}
    assert "H busy r1 eval: 1.00  (too short to judge)  (0.4 s wall, 0.8 s cpu, 2 cores)" in (
        busy_lines("H", short, judged=True)
    )
    assert "F busy r1 train: 0.90  (2.0 s wall, 3.6 s cpu, 2 cores)" in (
        busy_lines("F", phases(), judged=False)
    )


def test_bad_records_are_refused() -> None:
    with pytest.raises(ValueError, match="wall > 0"):
        Span(0.0, 1.0).busy(2)
    with pytest.raises(ValueError, match="no round 2"):
        round_span(phases(), 2)
    with pytest.raises(ValueError, match="no metrics row"):
        first_row_s(phases(), [])


def test_the_first_row_is_the_set_up_plus_the_rows_wall_time() -> None:
    assert first_row_s(phases(), [{"round": 1, "wall_time_s": 2.75}]) == 7.75
    assert free_share(1.5, 2) == 0.25
    assert free_share(3.0, 2) == 0.0


def test_the_command_lines(tmp_path: Path) -> None:
    args = parse(["--clients", "50", "--rounds", "3", "--workers", "2", "--no-warm"])
    assert args.runs == ["F", "H"]
    f = fedfa_args(args, tmp_path, every_round=False)
    assert f[0].endswith("configs/fedfa_fmnist_both.yaml")
    for over in ("sweep=null", "train.rounds=3", "eval.local_trained=true", "data.num_clients=50"):
        assert over in f
    assert "executor=processes" in f and "workers=2" in f and "eval.every=1" not in f
    assert "eval.every=1" in fedfa_args(args, tmp_path, every_round=True)
    (h,) = h_args(args, tmp_path)
    ((_, cfg),) = validate_points(yaml.safe_load(Path(h).read_text()))
    assert (cfg.algorithm, cfg.train.rounds, cfg.executor, cfg.workers) == (
        "heterofl",
        3,
        "processes",
        2,
    )
    with pytest.raises(SystemExit):
        parse(["--runs", "F,G"])


@pytest.mark.skipif(not fmnist_available(), reason="Fashion-MNIST is not installed")
def test_the_benchmark_runs_fedfa_cold_on_a_tiny_shape() -> None:
    """`bench_phases.py --smoke --runs F`: FedFA's cold ZiCo set-up and one round through
    the CLI, and every line the issue asks for printed (not their values)."""
    done = subprocess.run(
        [sys.executable, str(BENCH), "--smoke", "--runs", "F"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    for start in (
        "F first metrics row (round 1) at ",
        "F setup/round-1 ratio: ",
        "F setup/round-1 cpu ratio: ",
        "F setup/round-1-train ratio: ",
        "F busy setup_query: ",
        "F busy r1 train: ",
        "F busy r1 eval: ",
        "F load average (1 min) before ",
    ):
        assert any(line.startswith(start) for line in lines), start
