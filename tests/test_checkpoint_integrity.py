"""Checkpoints are verified when read: a truncated, changed or missing file is refused,
named, with what the user can do (exit status 2, no traceback), never resumed into a
silently different run; `hetfl resume` of a run without a checkpoint starts it again from
round 1 and says so."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hetfl.cli import main
from hetfl.engine.checkpoint import (
    LATEST,
    CheckpointDamagedError,
    load_checkpoint,
    save_checkpoint,
)

#: FedAvg with kept momentum: the client store (each client's momentum) is streamed into a
#: `.entries` file beside `latest.pt`.
CONFIG = """
name: {name}
seed: 0
algorithm: fedavg
data:
  dataset: digits
  num_clients: 4
  partition: {{kind: iid}}
  test_per_client: 20
model: {{name: mlp}}
train: {{rounds: 2, clients_per_round: 2, batch_size: 32, lr: 0.1, momentum: 0.9,
        keep_momentum: true}}
executor: sequential
output_dir: {out}
"""


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished two-round run, checkpointed after each round (module-wide, read only)."""
    root = tmp_path_factory.mktemp("ckpt")
    cfg = root / "cfg.yaml"
    cfg.write_text(CONFIG.format(name="whole", out=root / "runs"))
    assert main(["run", str(cfg), "--quiet"]) == 0
    return root / "runs" / "whole"


def _copy(run: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "run"
    shutil.copytree(run, dest)
    return dest


def _entries(run: Path) -> Path:
    (path,) = (run / "checkpoints").glob("store-*.entries")
    return path


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip(offset: Callable[[bytes], int]) -> Callable[[Path], None]:
    def flip(path: Path) -> None:
        data = bytearray(path.read_bytes())
        data[offset(bytes(data))] ^= 0x01
        path.write_bytes(bytes(data))

    return flip


def _inside_a_global_tensor(data: bytes) -> int:
    """An offset inside the bytes of the largest tensor of the global state."""
    ckpt = torch.load(io.BytesIO(data), weights_only=False)
    tensor = max(ckpt["global"].values(), key=lambda t: t.numel())
    at = data.find(tensor.numpy().tobytes())
    assert at > 0
    return at + tensor.numel() * tensor.element_size() // 2


DAMAGE = {
    "latest-truncated": (lambda run: run / "checkpoints" / LATEST, _truncate),
    "latest-tensor-byte": (
        lambda run: run / "checkpoints" / LATEST,
        _flip(_inside_a_global_tensor),
    ),
    "latest-trailer-byte": (lambda run: run / "checkpoints" / LATEST, _flip(lambda d: len(d) - 3)),
    "entries-truncated": (_entries, _truncate),
    "entries-tensor-byte": (_entries, _flip(lambda d: len(d) - 5)),
    "entries-missing": (_entries, lambda path: path.unlink()),
}


@pytest.mark.parametrize("case", DAMAGE)
def test_a_damaged_checkpoint_file_is_refused_naming_it(case, finished, tmp_path, capsys):
    run = _copy(finished, tmp_path)
    which, damage = DAMAGE[case]
    path = which(run)
    damage(path)
    code = main(["resume", str(run), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"error: checkpoint file {path} is damaged (")
    assert "Traceback" not in err
    assert "Restore the checkpoint folder" in err and "hetfl resume" in err
    with pytest.raises(CheckpointDamagedError):
        load_checkpoint(run / "checkpoints")


def test_the_cli_reports_damage_without_a_traceback(finished, tmp_path):
    """The same through a real process: stderr is the one line."""
    run = _copy(finished, tmp_path)
    (run / "checkpoints" / LATEST).write_bytes(b"Garbage\n")
    done = subprocess.run(
        [sys.executable, "-m", "hetfl.cli", "resume", str(run), "--quiet"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert done.stderr.startswith(f"error: checkpoint file {run / 'checkpoints' / LATEST}")
    assert "it cannot be read as a checkpoint" in done.stderr and "Traceback" not in done.stderr


def test_an_intact_checkpoint_reads_back_what_was_written(tmp_path):
    state = {"w": torch.arange(6.0).reshape(2, 3)}
    save_checkpoint(tmp_path, {"round": 1, "global": state})
    again = load_checkpoint(tmp_path)
    assert again["round"] == 1 and torch.equal(again["global"]["w"], state["w"])


def test_resume_without_a_checkpoint_starts_again_from_round_1(finished, tmp_path, capsys):
    """A run killed before its first checkpoint: its folder holds a config (and perhaps
    metrics rows), no checkpoint. Resumed, it says so, runs from round 1 and ends as the
    uninterrupted run did."""
    run = _copy(finished, tmp_path)
    shutil.rmtree(run / "checkpoints")
    (run / "summary.json").unlink()
    rows = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text(rows[0] + "\n")
    assert main(["resume", str(run)]) == 0
    err = capsys.readouterr().err
    assert f"hetfl resume: {run} has no checkpoint" in err and "from round 1" in err
    assert "\nhetfl resume whole: fedavg on digits" in "\n" + err  # the banner says resume

    def strip(path: Path) -> list[dict]:
        out = [json.loads(line) for line in path.read_text().splitlines()]
        return [{k: v for k, v in r.items() if k != "wall_time_s"} for r in out]

    assert strip(run / "metrics.jsonl") == strip(finished / "metrics.jsonl")
