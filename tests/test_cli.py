"""The command line: config errors, runs, sweeps, resume after SIGKILL."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import SUITE_PINS
from hetfl.cli import main
from hetfl.config import expand_sweep, parse_overrides
from hetfl.engine.heap import HEAP_TUNABLES, c_library, tuned_environment

BASE = """
name: t
seed: 0
algorithm: fedavg
data:
  dataset: digits
  num_clients: 6
  partition: {kind: dirichlet, alpha: 0.5, min_size: 5}
  test_per_client: 20
model: {name: mlp}
train: {rounds: 2, clients_per_round: 3, batch_size: 32, lr: 0.1}
executor: sequential
"""


def _cfg(tmp_path: Path, text: str = BASE) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(text + f"output_dir: {tmp_path / 'runs'}\n")
    return path


def _run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("train.lrr=0.1", ["train.lrr", "unknown key", "did you mean 'lr'"]),
        ("train.rounds=many", ["train.rounds", "'many'", "integer"]),
        ("train.lr=-0.5", ["train.lr", "greater than 0", "-0.5"]),
        ("algorithm=fedavgg", ["algorithm", "did you mean 'fedavg'", "allowed"]),
        ("data.num_clients=5000", ["5000", "samples"]),
        ("train.clients_per_round=7", ["clients_per_round = 7", "num_clients = 6"]),
        ("options.fedprox.mu=-1", ["options.fedprox.mu", "-1"]),
        ("train.keep_momentum=true", ["train", "keep_momentum needs momentum > 0"]),
        (
            "options.fedavg.reducer={kind: trimmed-mean, trim: 0.6}",
            ["options.fedavg.reducer", "'trimmed-mean': trim = 0.6", "less than or equal to 0.5"],
        ),
        (
            "options.fedavg.reducer=bulyan",
            ["options.fedavg.reducer", "unknown reducer 'bulyan'", "krum, mean, median"],
        ),
        ("options.fedavg.trim=0.1", ["options.fedavg", "reducer: {kind: trimmed-mean, trim: 0.1}"]),
        ("wrappers=[{kind: flip}]", ["wrappers.0", "unknown client-program wrapper 'flip'"]),
    ],
)
def test_bad_configs_fail_with_a_clear_message(tmp_path, capsys, override, expected):
    code, _, err = _run(capsys, "run", str(_cfg(tmp_path)), override, "--quiet")
    assert code == 2
    assert "Traceback" not in err
    for fragment in expected:
        assert fragment in err, (fragment, err)


def test_missing_dataset_names_the_fixes(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("HETFL_DATA", raising=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    cfg = _cfg(
        tmp_path, BASE.replace("dataset: digits", f"dataset: fashion-mnist\n  path: {empty}")
    )
    code, _, err = _run(capsys, "run", str(cfg), "--quiet")
    assert code == 2
    assert "dataset-fashion-mnist" in err and "HETFL_DATA" in err
    assert "hetfl data download fashion-mnist" in err


def test_missing_config_file(tmp_path, capsys):
    code, _, err = _run(capsys, "run", str(tmp_path / "nope.yaml"))
    assert code == 2 and "does not exist" in err


def test_run_writes_the_output_contract(tmp_path, capsys):
    code, _out, _ = _run(
        capsys,
        "run",
        str(_cfg(tmp_path)),
        "--quiet",
        "targets=[{metric: global_acc, value: 0.12}, {metric: global_acc, value: 0.99}]",
    )
    assert code == 0
    run = tmp_path / "runs" / "t"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rounds_completed"] == 2
    assert summary["failures"] == {} and summary["rounds_aggregated"] == 2
    assert summary["reducer"] == {"kind": "mean"} and "wrappers" not in summary
    reached, missed = summary["targets"]
    first = next(r for r in rows if r["global_acc"] >= 0.12)
    assert reached["round"] == first["round"]
    assert reached["bytes"] == first["bytes_down"] + first["bytes_up"]
    assert rows[1]["bytes_down"] == 2 * rows[0]["bytes_down"]  # cumulative, same model each round
    assert missed["round"] is None
    assert (run / "config.yaml").exists() and (run / "checkpoints" / "latest.pt").exists()
    assert (run / "plots" / "accuracy_vs_round.png").stat().st_size > 0
    _check_provenance(summary["provenance"], run)
    # a second run into the same folder is refused rather than silently replacing it
    code, _, err = _run(capsys, "run", str(_cfg(tmp_path)), "--quiet")
    assert code == 2 and "hetfl resume" in err


def _check_provenance(record: dict, run: Path) -> None:
    """summary.json says where its numbers came from: this checkout's commit, the numerics
    in force (the suite's pins among them), and the hash of the config it ran."""
    from importlib import metadata

    from hetfl.engine.numerics import fingerprint

    src = Path(__file__).resolve().parents[1] / "src" / "hetfl"
    head = subprocess.run(
        ["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert record["hetfl"] == metadata.version("hetfl")
    assert record["commit"] == head and isinstance(record["dirty"], bool)
    assert record["numerics"] == {**fingerprint(), "threads": record["numerics"]["threads"]}
    assert record["numeric_env"] == {k: os.environ[k] for k in record["numeric_env"]}
    assert set(SUITE_PINS) <= set(record["numeric_env"])
    assert record["glibc_tunables"] == os.environ.get("GLIBC_TUNABLES")
    config = (run / "config.yaml").read_bytes()
    assert record["config_sha256"] == hashlib.sha256(config).hexdigest()


def test_sweep_expands_and_compares(tmp_path, capsys):
    cfg = _cfg(tmp_path, BASE + "sweep: {algorithm: [fedavg, fedprox], seed: [0, 1]}\n")
    code, out, _ = _run(capsys, "run", str(cfg), "--quiet", "train.rounds=1")
    assert code == 0
    sweep = tmp_path / "runs" / "t"
    names = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    assert names == ["fedavg-s0", "fedavg-s1", "fedprox-s0", "fedprox-s1"]
    table = (sweep / "comparison.md").read_text()
    assert "| fedavg " in table and "| fedprox " in table and "± " in table
    assert "fedavg" in out


def test_sweep_names_other_keys():
    points = expand_sweep({"algorithm": "fedavg", "sweep": {"train.lr": [0.1, 0.2]}})
    assert [n for n, _ in points] == ["fedavg-s0-lr=0.1", "fedavg-s0-lr=0.2"]
    assert points[1][1]["train"]["lr"] == 0.2 and "sweep" not in points[1][1]


def test_overrides_parse_yaml_values():
    assert parse_overrides(["a.b=0.5", "c=[1, 2]", "d=fedavg"]) == {
        "a.b": 0.5,
        "c": [1, 2],
        "d": "fedavg",
    }


def test_resume_after_sigkill_equals_uninterrupted(tmp_path):
    text = (
        BASE.replace("algorithm: fedavg", "algorithm: fedprox").replace("rounds: 2", "rounds: 7")
        + "checkpoint_every: 2\noptions: {fedprox: {mu: 0.1}}\n"
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "hetfl.cli", "run"]
    cfg = _cfg(tmp_path, text)
    slow = "train.local_epochs=20"  # about 0.1 s a round, so the kill lands mid-run
    victim = tmp_path / "runs" / "victim"
    proc = subprocess.Popen([*cmd, str(cfg), "name=victim", "--quiet", slow], env=env)
    metrics = victim / "metrics.jsonl"
    while proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.01)
    proc.wait()
    killed_at = len(metrics.read_text().splitlines())
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert killed_at < 7
    subprocess.run(
        [sys.executable, "-m", "hetfl.cli", "resume", str(victim), "--quiet"],
        check=True,
        env=env,
        capture_output=True,
    )
    subprocess.run(
        [*cmd, str(cfg), "name=ref", "--quiet", slow], check=True, env=env, capture_output=True
    )
    ref = tmp_path / "runs" / "ref"

    def rows(run):
        out = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        for r in out:
            r.pop("wall_time_s")
        return out

    assert rows(victim) == rows(ref)
    a = torch.load(victim / "checkpoints" / "latest.pt", weights_only=False)
    b = torch.load(ref / "checkpoints" / "latest.pt", weights_only=False)
    assert a["round"] == b["round"] == 7
    for name, value in b["global"].items():
        assert torch.equal(a["global"][name], value), name
    # every process ran under the allocator setting the command line gives itself on glibc
    # (a re-execution, same pid: the kill above still hit the run), which the rows above
    # show changes no number
    on_glibc = tuned_environment({}, c_library()) is not None
    expected = os.environ.get("GLIBC_TUNABLES", HEAP_TUNABLES if on_glibc else None)
    for run in (victim, ref):
        summary = json.loads((run / "summary.json").read_text())
        assert summary["provenance"]["glibc_tunables"] == expected


def test_tuned_environment_leaves_a_users_setting_and_other_libcs_alone():
    env = {"PATH": "/bin"}
    assert tuned_environment(env, "glibc 2.36") == {"PATH": "/bin", "GLIBC_TUNABLES": HEAP_TUNABLES}
    assert tuned_environment({**env, "GLIBC_TUNABLES": ""}, "glibc 2.36") is None
    own = {**env, "GLIBC_TUNABLES": "glibc.malloc.arena_max=1"}
    assert tuned_environment(own, "glibc 2.36") is None
    assert tuned_environment(env, "") is None  # musl, macOS: no glibc to tune


def test_partition_prints_the_clients_the_run_trains_on(tmp_path, capsys):
    from hetfl.assembly import build_federation
    from hetfl.config import load_raw, validate

    cfg_path = _cfg(tmp_path)
    code, out, _ = _run(capsys, "partition", str(cfg_path), "data.num_clients=5")
    assert code == 0
    saved = (tmp_path / "runs" / "t" / "partition.txt").read_text().splitlines()
    rows = [line.split() for line in saved[2:-1]]  # skip the heading lines and the total row
    raw = load_raw(cfg_path)
    raw["data"]["num_clients"] = 5
    clients = build_federation(validate(raw), torch.device("cpu")).clients
    assert len(rows) == 5
    for row, client in zip(rows, clients, strict=True):
        counts = torch.bincount(client.y_train, minlength=10).tolist()
        assert [int(v) for v in row[1:-1]] == counts and int(row[-1]) == client.n_train
    assert saved[1] in out


def test_the_start_banner_lists_what_the_strategy_decided():
    from hetfl.runner import _described

    described = {"variant": "heterofl-max", "groups": {"g1": {"depth": 2, "gap": -0.07}}}
    assert _described(described) == ["  variant: heterofl-max", "  g1: depth 2, gap -0.07"]
    assert _described({}) == []


def test_a_reader_that_went_away_is_not_an_error():
    """`hetfl list | head -1`: output into a pipe nobody reads ends quietly, exit 0, where
    it printed a BrokenPipeError traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write now fails with EPIPE
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "hetfl.cli", "list"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            check=False,
        )
    finally:
        os.close(write_end)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
