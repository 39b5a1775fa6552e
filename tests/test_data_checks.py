"""Malformed data is refused where it is loaded; failed clients are counted and reported.

Issue 14, items 3 and 4: data with NaN/Inf, bad labels or mismatched lengths is an error
naming the array and the file (in `hetfl run` and on a Flower node alike), a file that is
not an .npz archive says so, `summary.json` counts failures by kind in every run, and a run
that never aggregated a client exits with status 3.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import yaml

from hetfl.cli import main
from hetfl.config import validate
from hetfl.core.types import Failure, Problem
from hetfl.data import Dataset, load_libsvm, load_npz
from hetfl.engine.outputs import NOTHING_AGGREGATED_EXIT
from hetfl.engine.steps import RoundOutcome, every_client_failed
from hetfl.runner import build_simulation


def _npz(path: Path, **change: np.ndarray) -> Path:
    """A tiny valid 2-class tabular dataset, with `change` replacing some of its arrays."""
    rng = np.random.default_rng(0)
    arrays = {
        "x_train": rng.standard_normal((24, 4)),
        "y_train": np.arange(24) % 2,
        "x_test": rng.standard_normal((8, 4)),
        "y_test": np.arange(8) % 2,
    }
    arrays.update(change)
    np.savez(path, **arrays)
    return path


def _npz_config(tmp_path: Path, data: Path) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(
        f"""
name: t
algorithm: fedavg
data: {{dataset: npz, path: {data}, num_clients: 2, partition: {{kind: iid}}, test_per_client: 0}}
model: {{name: mlp}}
train: {{rounds: 2, clients_per_round: 2, batch_size: 8, lr: 0.1}}
output_dir: {tmp_path / "runs"}
"""
    )
    return path


# -- item 3: every source is checked when it is loaded -------------------------------------


def test_nan_inputs_stop_hetfl_run_with_the_array_and_the_file(tmp_path, capsys):
    x = np.random.default_rng(1).standard_normal((24, 4))
    x[5, 2] = np.nan
    x[9, 0] = np.inf
    data = _npz(tmp_path / "nan.npz", x_train=x)
    code = main(["run", str(_npz_config(tmp_path, data)), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"error: {data}: x_train has 2 non-finite values (NaN or Inf) in 2 samples" in err
    assert "the first in sample 5" in err
    assert not (tmp_path / "runs" / "t" / "summary.json").exists()


def _arrays(n_train: int = 4) -> dict[str, np.ndarray]:
    return {
        "x_train": np.zeros((n_train, 3), np.float32),
        "y_train": np.array([0, 1, 2, 0], np.int64),
        "x_test": np.zeros((2, 3), np.float32),
        "y_test": np.array([1, 2], np.int64),
    }


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"x_test": np.array([[0, 0, 0], [np.inf, np.nan, 1]], np.float32)},
            "test.npz: x_test has 2 non-finite values (NaN or Inf) in 1 samples, the first in "
            "sample 1; inputs must be finite: repair or drop those samples",
        ),
        (
            {"y_train": np.array([0, 3, 2, -1], np.int64)},
            "train.npz: y_train has 2 labels outside 0..2, the first label 3 at index 1; "
            "labels must be class indices from 0 to 2",
        ),
        (
            {"x_train": np.zeros((5, 3), np.float32)},
            "train.npz: x_train has 5 rows but y_train has shape (4,); every input needs one label",
        ),
    ],
)
def test_a_dataset_names_the_array_its_file_and_what_is_wrong(tmp_path, change, message):
    """Train and test arrays from different files: each error names the array's own."""
    files = {"x_train": "train.npz", "y_train": "train.npz", "x_test": "test.npz"}
    files |= {"y_test": "test.npz"}
    arrays = _arrays() | change
    with pytest.raises(ValueError) as err:
        Dataset("d", **arrays, num_classes=3, files={k: tmp_path / v for k, v in files.items()})
    assert str(err.value) == f"{tmp_path}/{message}"


def test_a_built_in_source_is_named_by_its_dataset(tmp_path):
    arrays = _arrays() | {"y_test": np.array([1, 7], np.int64)}
    with pytest.raises(ValueError, match=r"^dataset 'd': y_test has 1 labels outside 0\.\.2"):
        Dataset("d", **arrays, num_classes=3)


def test_a_flower_node_refuses_its_partition_with_the_same_check(tmp_path):
    """A node loads its partition from its own config (`hetfl-config`) through the same
    loaders, so bad local data fails there, naming the node's file."""
    pytest.importorskip("flwr")
    from flwr.app import Context, RecordDict

    from hetfl.deploy.node import node_for
    from hetfl.flower import build_node

    good = _npz(tmp_path / "good.npz")
    x = np.ones((24, 4))
    x[7, 3] = -np.inf
    bad = _npz(tmp_path / "bad.npz", x_train=x)
    server = _npz_config(tmp_path, good).read_text()
    local = tmp_path / "node.yaml"
    local.write_text(server.replace(str(good), str(bad)))
    node_config = {"partition-id": 0, "hetfl-config": str(local)}
    ctx = Context(run_id=1, node_id=7, node_config=node_config, state=RecordDict(), run_config={})
    message = f"{bad}: x_train has 1 non-finite values (NaN or Inf) in 1 samples, the first in "
    with pytest.raises(ValueError, match=re.escape(message + "sample 7")):
        node_for(ctx, server, build_node)


def test_hetfl_client_checks_its_data_before_becoming_a_node(tmp_path, capsys, monkeypatch):
    pytest.importorskip("flwr")
    from hetfl.launch import supernode

    def became_a_node(*args) -> None:
        raise AssertionError("the node started before its data was checked")

    monkeypatch.setattr(supernode, "run_supernode", became_a_node)
    x = np.zeros((24, 4))
    x[3, 1] = np.nan
    data = _npz(tmp_path / "nan.npz", x_train=x)
    args = ["client", "--partition-id", "1", "--config", str(_npz_config(tmp_path, data))]
    assert main([*args, "--insecure"]) == 2
    assert f"error: {data}: x_train has 1 non-finite values" in capsys.readouterr().err


# -- item 4: a file that is not an .npz archive ---------------------------------------------

NPZ_FORMAT = "a NumPy .npz archive (what numpy.savez writes) with arrays x_train, y_train"


def test_random_bytes_are_not_an_npz_archive(tmp_path):
    path = tmp_path / "noise.npz"
    path.write_bytes(bytes(range(7, 207)))
    with pytest.raises(ValueError) as err:
        load_npz(path)
    text = str(err.value)
    assert text.startswith(f"{path}: not a NumPy .npz archive (it does not start with a zip ")
    assert NPZ_FORMAT in text and "pickle" not in text


def test_a_truncated_archive_and_a_single_npy_are_named(tmp_path):
    whole = _npz(tmp_path / "whole.npz").read_bytes()
    cut = tmp_path / "cut.npz"
    cut.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match=re.escape(f"{cut}: not a readable .npz archive (")):
        load_npz(cut)
    single = tmp_path / "single.npz"
    with open(single, "wb") as fh:
        np.save(fh, np.zeros(3))
    with pytest.raises(ValueError, match=re.escape(f"{single}: is a single-array .npy file")):
        load_npz(single)


def test_a_binary_libsvm_file_names_the_file_and_line(tmp_path):
    path = tmp_path / "data.svm"
    path.write_bytes(b"1 1:0.5\n2 1:0.25\n\xff\xfe 1:1\n")
    message = f"{path}:3: not text (byte 0xFF at column 1 is not UTF-8)"
    with pytest.raises(ValueError, match=re.escape(message)):
        load_libsvm(path)


# -- item 3: failures counted by kind, an all-failed round said, exit status 3 ---------------

DIVERGING = """
name: t
algorithm: fedavg
data: {dataset: synthetic, num_clients: 2, partition: {kind: iid}, test_per_client: 0}
model: {name: mlp}
train: {rounds: 2, clients_per_round: 2, local_steps: 2, batch_size: 16, lr: 1.0e+30}
eval: {local_eval: none}
"""


def test_a_run_that_never_aggregates_exits_3_and_counts_its_failures(tmp_path, capsys):
    """lr = 1e30 sends every client's weights to Inf/NaN within two steps: each round
    every client is excluded as non-finite, so nothing is ever aggregated."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(DIVERGING + f"output_dir: {tmp_path / 'runs'}\n")
    code = main(["run", str(cfg)])
    err = capsys.readouterr().err
    assert code == NOTHING_AGGREGATED_EXIT == 3
    for rnd in (1, 2):
        assert f"warning: round {rnd}: every client failed (2 non-finite); nothing" in err
    assert "no round aggregated any client's result in 2 rounds (failures: 4 non-finite)" in err
    summary = json.loads((tmp_path / "runs" / "t" / "summary.json").read_text())
    assert summary["failures"] == {"non-finite": 4} and summary["rounds_aggregated"] == 0


def test_failure_counts_survive_resume(tmp_path):
    """Stopped after round 1 and resumed: the counts of the uninterrupted run above."""
    two = validate(yaml.safe_load(DIVERGING))
    one = two.model_copy(update={"train": two.train.model_copy(update={"rounds": 1})})
    build_simulation(one, tmp_path, show_progress=False).run()
    resumed = build_simulation(two, tmp_path, show_progress=False).run(resume=True)
    assert resumed["failures"] == {"non-finite": 4} and resumed["rounds_aggregated"] == 0


def test_the_all_failed_line_counts_each_kind():
    outcome = RoundOutcome(
        failures=[
            Failure.of(0, Problem("timeout", "no reply")),
            Failure.of(3, Problem("raised", "raised ValueError: x")),
            Failure.of(5, Problem("timeout", "no reply")),
        ]
    )
    assert every_client_failed(4, outcome) == (
        "warning: round 4: every client failed (1 raised, 2 timeout); nothing was aggregated "
        "and the global model is unchanged"
    )
