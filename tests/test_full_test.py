"""tools/full_test.py scores a finished run's final model on the whole test set: on a run
that already evaluated on all of it, exactly the summary's final numbers; on a run that
evaluated a subsample, the whole set; a checkpoint that is not the summary's last round is
refused."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from hetfl.config import validate
from hetfl.runner import run_one

TOOL = Path(__file__).resolve().parents[1] / "tools" / "full_test.py"
BASE = {
    "name": "t",
    "algorithm": "fedavg",
    "data": {"dataset": "digits", "num_clients": 3, "test_per_client": 20},
    "model": {"name": "mlp"},
    "train": {"rounds": 2, "clients_per_round": 2, "batch_size": 16, "lr": 0.05},
    "eval": {"local_eval": "none"},
    "checkpoint_every": 1,
    "device": "cpu",
    "threads": 1,
}


@pytest.fixture(scope="module")
def tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("full_test", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def run(tmp_path: Path, name: str, **changes) -> Path:
    raw = json.loads(json.dumps(BASE)) | {"name": name}
    for key, value in changes.items():
        *parents, field = key.split(".")
        node = raw
        for parent in parents:
            node = node.setdefault(parent, {})
        node[field] = value
    run_one(validate(raw), tmp_path / name, show_progress=False)
    return tmp_path / name


def test_the_whole_test_set_scores_as_the_runs_last_evaluation(tool, tmp_path):
    run_dir = run(tmp_path, "whole")
    final = json.loads((run_dir / "summary.json").read_text())["final"]
    result = tool.full_test(run_dir)
    assert result["round"] == 2
    assert (result["global_acc"], result["test_loss"]) == (final["global_acc"], final["test_loss"])


def test_a_subsampled_run_is_scored_on_every_test_sample(tool, tmp_path):
    whole = tool.full_test(run(tmp_path, "whole"))
    sub_dir = run(tmp_path, "sub", **{"eval.test_samples": 25})
    tool.main([str(sub_dir)])
    sub = json.loads((sub_dir / "full_test.json").read_text())
    assert sub["test_samples"] == whole["test_samples"] > 25
    assert sub["global_acc"] == whole["global_acc"]  # the same seed: the same final model


def test_a_checkpoint_that_is_not_the_final_state_is_refused(tool, tmp_path):
    run_dir = run(tmp_path, "late")
    summary = json.loads((run_dir / "summary.json").read_text())
    (run_dir / "summary.json").write_text(json.dumps(summary | {"rounds_completed": 3}))
    with pytest.raises(SystemExit, match="checkpoint is of round 2, the run completed 3"):
        tool.full_test(run_dir)
