"""Bad inputs a researcher makes, through the command line: an edited config on resume,
resume overrides, an unwritable output folder, duplicate YAML keys, and validation errors.
Each ends with one `error:` line, exit status 2, no traceback, and leaves nothing behind
that `hetfl resume` would misread."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hetfl.cli import main
from hetfl.config.resume import Change, alters_results, changes
from test_cli import BASE, _cfg, _run


def _refused(code: int, err: str) -> None:
    assert code == 2, err
    assert err.startswith("error: ") and err.count("error:") == 1, err
    assert "Traceback" not in err


# -- hetfl resume against the config the checkpoint was written under ---------------------
@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished two-round run (its checkpoint after round 2), copied by each test."""
    root = tmp_path_factory.mktemp("finished")
    assert main(["run", str(_cfg(root)), "--quiet"]) == 0
    return root / "runs" / "t"


@pytest.fixture
def run_dir(finished, tmp_path) -> Path:
    copy = tmp_path / "t"
    shutil.copytree(finished, copy)
    return copy


def _edit(run_dir: Path, old: str, new: str) -> None:
    path = run_dir / "config.yaml"
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


def _outputs(run_dir: Path) -> tuple[str, str]:
    return (run_dir / "metrics.jsonl").read_text(), (run_dir / "summary.json").read_text()


@pytest.mark.parametrize(
    ("old", "new", "named"),
    [
        ("lr: 0.1\n", "lr: 0.5\n", "train.lr: 0.1 -> 0.5"),
        ("num_clients: 6\n", "num_clients: 4\n", "data.num_clients: 6 -> 4"),
        ("name: mlp\n", "name: linear\n", "model.name: 'mlp' -> 'linear'"),
        ("threads: 1\n", "threads: 2\n", "threads: 1 -> 2"),
    ],
)
def test_resume_refuses_a_config_edited_in_what_determines_results(
    run_dir, capsys, old, new, named
):
    """A change that could alter a metric is refused before anything runs, naming the key,
    both values and what to do; the run's outputs are left as they were."""
    before = _outputs(run_dir)
    _edit(run_dir, old, new)
    code, _, err = _run(capsys, "resume", str(run_dir), "--quiet")
    _refused(code, err)
    assert named in err and "Put those values back" in err and "hetfl run" in err
    assert _outputs(run_dir) == before


def test_resume_allows_result_neutral_edits_and_overrides_and_records_them(run_dir, capsys):
    """config.yaml's checkpoint_every edited and store.memory_budget given on the command
    line: the resume runs, and summary.json says what changed since the checkpoint."""
    rows = _outputs(run_dir)[0]
    _edit(run_dir, "checkpoint_every: 1\n", "checkpoint_every: 3\n")
    code, _, err = _run(capsys, "resume", str(run_dir), "store.memory_budget=1MiB", "--quiet")
    assert code == 0, err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed"] == {
        "after_round": 2,
        "overrides": {"store.memory_budget": "1MiB"},
        "changed": {"checkpoint_every": 3, "store.memory_budget": 1048576},
    }
    assert (run_dir / "metrics.jsonl").read_text() == rows


@pytest.mark.parametrize("override", ["train.lr=0.5", "seed=1", "threads=2"])
def test_resume_overrides_only_result_neutral_keys(run_dir, capsys, override):
    before = _outputs(run_dir)
    code, _, err = _run(capsys, "resume", str(run_dir), override, "--quiet")
    _refused(code, err)
    assert f"cannot override {override.partition('=')[0]}" in err and "executor" in err
    assert _outputs(run_dir) == before


def test_an_executor_change_alters_results_only_to_or_from_the_vectorised_one():
    found = changes({"executor": "processes", "train": {"lr": 0.1}}, {"executor": "ray"})
    assert [str(c) for c in found] == [
        "executor: 'processes' -> 'ray'",
        "train.lr: 0.1 -> (absent)",
    ]
    assert not alters_results(Change("executor", "processes", "ray"))
    assert not alters_results(Change("executor", None, "sequential"))
    assert alters_results(Change("executor", "sequential", "vectorised"))
    assert not alters_results(Change("ray.address", None, "auto"))
    assert alters_results(Change("train.lr", 0.1, 0.5))


# -- the output folder and the YAML itself ------------------------------------------------
@pytest.mark.parametrize("command", ["run", "partition"])
@pytest.mark.parametrize("under", ["a-file", "a-file/runs"])
def test_an_unwritable_output_dir_is_one_error_before_anything_runs(
    tmp_path, capsys, command, under
):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    cfg = _cfg(tmp_path)
    quiet = ["--quiet"] if command == "run" else []
    code, _, err = _run(capsys, command, str(cfg), f"output_dir={tmp_path / under}", *quiet)
    _refused(code, err)
    assert f"{tmp_path / under / 't'}" in err and f"{blocker} is a file, not a folder" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "cfg.yaml"]


def test_a_yaml_key_given_twice_is_refused_naming_it_and_both_lines(tmp_path, capsys):
    cfg = _cfg(tmp_path, BASE.replace("seed: 0\n", "seed: 0\nseed: 1\n"))
    code, _, err = _run(capsys, "run", str(cfg), "--quiet")
    _refused(code, err)
    assert "key 'seed' is given twice (lines 3 and 4)" in err
    assert not (tmp_path / "runs").exists()


def test_a_nested_duplicate_key_and_one_in_an_override_are_refused(tmp_path, capsys):
    cfg = _cfg(tmp_path, BASE + "eval:\n  every: 1\n  every: 2\n")
    code, _, err = _run(capsys, "run", str(cfg), "--quiet")
    _refused(code, err)
    assert "key 'every' is given twice (lines 14 and 15)" in err
    code, _, err = _run(capsys, "run", str(_cfg(tmp_path)), "train={lr: 1, lr: 2}", "--quiet")
    _refused(code, err)
    assert "key 'lr' is given twice" in err


# -- validation messages ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["train.clients_per_round=7"], ["train.clients_per_round = 7", "data.num_clients = 6"]),
        (["train.keep_momentum=true"], ["keep_momentum needs momentum > 0"]),
        (["options.fedprox.muu=1"], ["options.fedprox.muu: unknown key; did you mean 'mu'?"]),
        (["options.fedprox.mu=-1"], ["options.fedprox.mu: ", "(got -1)"]),
        (["executor=ray", "ray.adress=auto"], ["ray.adress", "did you mean 'address'?"]),
        (["targets=[{metrc: global_acc, value: 1}]"], ["targets.0.metrc", "'metric'?"]),
        (["attack={fractoin: 0.1, kind: label-flip}"], ["did you mean 'fraction'"]),
        (["train.lr={a"], ["override 'train.lr={a': its value is not YAML"]),
        (
            ["sweep={algorithm: [fedavg, fedprox], options.fedprox.mu: [0.1, -1]}"],
            ["sweep point 2 of 4 (fedavg-s0-mu=-1)", "options.fedprox.mu", "(got -1)"],
        ),
    ],
)
def test_validation_errors_name_the_field_never_the_whole_config(
    tmp_path, capsys, overrides, expected
):
    code, _, err = _run(capsys, "run", str(_cfg(tmp_path)), *overrides, "--quiet")
    _refused(code, err)
    for fragment in expected:
        assert fragment in err, (fragment, err)
    assert "(top level)" not in err and "'dataset'" not in err  # no config dumped
    assert not (tmp_path / "runs" / "t" / "config.yaml").exists()


# -- help texts ---------------------------------------------------------------------------
def test_the_help_texts_are_whole_and_say_what_each_option_does(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    description = text.split("\n\n")[1]
    assert description.startswith("HetFL: ") and description.endswith("is the guide.")
    with pytest.raises(SystemExit):
        main(["plot", "--help"])
    text = capsys.readouterr().out
    assert "comparison.png in the\n" in text and "the x axis" in text
    assert "run directories or sweep folders" in text
    with pytest.raises(SystemExit):
        main(["resume", "--help"])
    assert "cannot alter results" in capsys.readouterr().out


def test_a_sweep_folder_is_checked_point_by_point_before_any_runs(tmp_path, capsys):
    cfg = _cfg(tmp_path, BASE.replace("rounds: 2", "rounds: 1") + "sweep: {seed: [0, 1]}\n")
    assert main(["run", str(cfg), "--quiet"]) == 0
    sweep = tmp_path / "runs" / "t"
    _edit(sweep / "fedavg-s1", "lr: 0.1\n", "lr: 0.2\n")
    capsys.readouterr()
    code, _, err = _run(capsys, "resume", str(sweep), "--quiet")
    _refused(code, err)
    assert f"{sweep / 'fedavg-s1'}: the config to resume with" in err and "train.lr" in err
