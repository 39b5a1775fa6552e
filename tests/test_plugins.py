"""Plugins (docs/plugins.md): user modules imported before a config is validated.

A test that imports a plugin runs it in a fresh interpreter (`hetfl run`, and
tests/plugin_probe.py), so that the registries of this process stay HetFL's own, which
tests/test_startup.py holds equal to the catalogue. The tests run here import nothing, or
only plugins that fail before registering anything.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import hetfl
from hetfl.config import ConfigError, load_raw, validate
from hetfl.core.plugins import PluginError, is_file, module_name, resolve
from hetfl.core.registry import Registry, registering_for

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "plugin"
PLUGIN = str(EXAMPLE / "fedavgm_plugin.py")
SEQUENTIAL, PROCESSES = "fedavgm-s0-executor=sequential", "fedavgm-s0-executor=processes"


def _fresh_python(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    src = Path(hetfl.__file__).resolve().parents[1]
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(src)},
    )


# -- in this process: nothing is imported ----------------------------------------------------
def test_a_plugin_is_a_module_name_or_a_file(tmp_path):
    assert not is_file("my_package.my_module")
    assert all(is_file(p) for p in ("./x.py", "x.py", "plugins/x", "/abs/x.py"))
    assert resolve("my_package.my_module") == "my_package.my_module"
    assert resolve("./x.py", tmp_path) == str(tmp_path / "x.py")
    assert resolve("../x.py", tmp_path / "sub") == str(tmp_path / "x.py")
    assert resolve("/abs/x.py", tmp_path) == "/abs/x.py"
    assert module_name("/a/b/my-plugin.v2.py") == "hetfl_plugin_my_plugin_v2"
    assert module_name("my_package.my_module") == "my_package.my_module"
    for bad in ("my-package", "a..b", "", 3):
        with pytest.raises(PluginError, match="module name"):
            resolve(bad)  # type: ignore[arg-type]


def test_a_config_files_plugin_paths_are_relative_to_its_folder(tmp_path, monkeypatch):
    folder = tmp_path / "configs"
    folder.mkdir()
    (folder / "run.yaml").write_text("plugins: [./mine.py, ../shared/theirs.py, json]\n")
    monkeypatch.chdir(tmp_path / "configs" / "..")
    raw = load_raw(folder / "run.yaml")
    assert raw["plugins"] == [
        str(folder / "mine.py"),
        str(tmp_path / "shared" / "theirs.py"),
        "json",
    ]
    # json is imported already and registers nothing; the record keeps each plugin once
    cfg = validate({"plugins": ["json", "json"]})
    assert cfg.plugins == ["json"]
    assert yaml.safe_load(cfg.to_yaml())["plugins"] == ["json"]
    assert validate({}).plugins == []


def test_plugin_options_add_to_the_configs_plugins(tmp_path):
    from hetfl.cli import _parser, _raw_config

    for command in (["run"], ["partition"], ["serve", "c.yaml"], ["list"]):
        args = _parser().parse_args([*command, "--plugin", "a.b", "--plugin", "./c.py"])
        assert args.plugins == ["a.b", "./c.py"], command
    (tmp_path / "run.yaml").write_text("plugins: [json]\n")
    raw = _raw_config(str(tmp_path / "run.yaml"), ["seed=1"], ["a.b", "./c.py"])
    assert raw["plugins"] == ["json", "a.b", "./c.py"]  # validation resolves ./c.py (CWD)
    assert _raw_config(str(tmp_path / "run.yaml"), [])["plugins"] == ["json"]


def test_a_registration_remembers_its_plugin_and_a_second_is_refused_naming_both():
    methods: Registry[int] = Registry("algorithm")
    methods.register("own", 1)
    with registering_for("/home/me/a.py"):
        methods.register("mine", 2)
    assert (methods.origin("own"), methods.origin("mine")) == (None, "/home/me/a.py")
    with registering_for("b.plugin"), pytest.raises(ValueError) as taken:
        methods.register("mine", 3)
    assert str(taken.value) == (
        "algorithm 'mine' is already registered by plugin '/home/me/a.py'; plugin "
        "'b.plugin' registers it again: give it another name"
    )
    with registering_for("b.plugin"), pytest.raises(ValueError, match="by HetFL \\(built in\\)"):
        methods.register("own", 3)
    assert (methods.get("own"), methods.get("mine")) == (1, 2)
    # registries sharing their names: a name taken in one is taken in all, both ways
    plain: Registry[int] = Registry("model")
    scalable: Registry[int] = Registry("scalable model", shares_names_with=plain)
    composed: Registry[int] = Registry("composed model", shares_names_with=plain)
    plain.register("linear", 1)
    composed.register("cnn", 2)
    with registering_for("p"), pytest.raises(ValueError) as shadowed:
        scalable.register("linear", 3)
    assert str(shadowed.value) == (
        "model 'linear' is already registered by HetFL (built in); plugin 'p' registers it "
        "again as a scalable model: give it another name"
    )
    with pytest.raises(ValueError, match="composed model 'cnn' is already registered"):
        plain.register("cnn", 4)
    assert plain.names() == ["linear"] and scalable.names() == []


def test_a_plugins_method_and_kinds_carry_their_own_summary(monkeypatch):
    from hetfl.algorithms.fedavg import FedAvgOptions
    from hetfl.algorithms.parts import method_registry
    from hetfl.api import REDUCERS, register_algorithm, register_reducer

    methods: Registry[method_registry.Algorithm] = Registry("algorithm")
    monkeypatch.setattr(method_registry, "ALGORITHMS", methods)
    monkeypatch.setattr(REDUCERS, "_entries", dict(REDUCERS._entries))
    register_algorithm("mine", FedAvgOptions, summary="my method")(print)
    register_reducer("my-mean", summary="my reducer")(print)
    assert methods.get("mine").summary == "my method"
    assert REDUCERS.get("my-mean").summary == "my reducer"
    with pytest.raises(KeyError, match=r"in a plugin, pass it: .*summary="):
        register_algorithm("unsummarised", FedAvgOptions)
    with pytest.raises(KeyError, match=r"in a plugin, pass it \(summary="):
        register_reducer("unsummarised")(print)


def test_the_example_builds_its_method_through_hetfl_api_only():
    """The example plugin imports HetFL's method-building names from `hetfl.api` alone (its
    model from `hetfl.models`), and every name `hetfl.api` exports is there."""
    import hetfl.api

    tree = ast.parse(Path(PLUGIN).read_text())
    hetfl_imports = sorted(
        node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hetfl")
    )
    assert hetfl_imports == ["hetfl.api", "hetfl.models"]
    assert [n for n in hetfl.api.__all__ if not hasattr(hetfl.api, n)] == []
    assert len(hetfl.api.__all__) == len(set(hetfl.api.__all__))


def test_plugins_that_cannot_load_are_config_errors_naming_them(tmp_path):
    """Each fails before registering anything, so loading them here changes no registry."""
    (tmp_path / "boom.py").write_text("raise RuntimeError('boom at import')\n")
    cases = {
        "no_such_package_i28.mod": (
            "plugins: plugin 'no_such_package_i28.mod' failed to import: ModuleNotFoundError: "
            "No module named 'no_such_package_i28' (a module name is imported from sys.path"
        ),
        str(tmp_path / "absent.py"): f"plugin '{tmp_path / 'absent.py'}': no such file (a path",
        str(tmp_path / "boom.py"): (
            f"plugin '{tmp_path / 'boom.py'}' failed to import: RuntimeError: boom at import"
        ),
        "my-package": "plugin 'my-package' is neither a module name",
    }
    for plugin, expected in cases.items():
        with pytest.raises(ConfigError) as refused:
            validate({"plugins": [plugin]})
        assert expected in str(refused.value), plugin
    assert "hetfl_plugin_boom" not in sys.modules
    with pytest.raises(ConfigError, match=r"plugins: a list of module names or \.py files"):
        validate({"plugins": "./mine.py"})


def test_resume_imports_the_plugins_its_saved_config_names(tmp_path):
    """`hetfl resume` validates each saved config (`_resume_config`) before it runs; the
    plugin here only leaves a mark, so importing it changes no registry."""
    from hetfl.cli import _resume_config

    spy = tmp_path / "resume_spy.py"
    spy.write_text(f"open({str(tmp_path / 'imported')!r}, 'w').close()\n")
    (tmp_path / "config.yaml").write_text(
        validate({}).to_yaml().replace("plugins: []", f"plugins: [{spy}]")
    )
    assert not (tmp_path / "imported").exists()
    assert _resume_config(tmp_path, [])[0].plugins == [str(spy)]
    assert (tmp_path / "imported").exists()


def test_a_node_imports_no_plugin_that_a_servers_config_names(tmp_path):
    from hetfl.flower import parse_config

    spy = tmp_path / "spy.py"
    spy.write_text(f"open({str(tmp_path / 'imported')!r}, 'w').close()\n")
    server = yaml.safe_dump({"plugins": [str(spy)], "algorithm": "fedavg"})
    with pytest.raises(ConfigError) as refused:
        parse_config(server)
    assert f"plugin(s) '{spy}' not imported in this process" in str(refused.value)
    assert "on a Flower node, name them in the node's own config" in str(refused.value)
    assert not (tmp_path / "imported").exists()
    assert "hetfl_plugin_spy" not in sys.modules


def test_a_node_imports_its_own_configs_plugins_before_reading_the_servers(tmp_path):
    """The server names the node's plugin by the server's path (a file is known by its
    name); a partition id out of range stops the build right after both configs are read."""
    from hetfl.flower import build_node

    (tmp_path / "node_spy.py").write_text(f"open({str(tmp_path / 'imported')!r}, 'w').close()\n")
    small = {"data": {"dataset": "digits", "num_clients": 4}, "train": {"clients_per_round": 2}}
    own = tmp_path / "node.yaml"
    own.write_text(yaml.safe_dump({"plugins": ["./node_spy.py"], **small}))
    server = yaml.safe_dump({"plugins": ["/on/the/server/node_spy.py"], **small})
    with pytest.raises(ValueError, match=r"partition-id 7 is outside 0\.\.3"):
        build_node({"partition-id": 7, "hetfl-config": str(own)}, server)
    assert (tmp_path / "imported").exists()


# -- in a fresh interpreter: the example plugin --------------------------------------------
@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    """tests/plugin_probe.py's findings: it runs the example through `hetfl run` (under the
    sequential and the process executor), then lists, validates and refuses plugins."""
    work = tmp_path_factory.mktemp("probe")
    done = _fresh_python(str(REPO / "tests" / "plugin_probe.py"), str(work), cwd=REPO)
    assert done.returncode == 0, done.stderr
    return json.loads((work / "probe.json").read_text()) | {"work": str(work)}


def _rows(point: Path) -> list[dict]:
    rows = [json.loads(line) for line in (point / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k != "wall_time_s"} for row in rows]


def test_the_example_plugin_runs_under_both_executors(probe):
    assert probe["imported_at_start"] is False and probe["run_status"] == 0
    sweep = Path(probe["work"]) / "runs" / "fedavgm-digits"
    rows = _rows(sweep / SEQUENTIAL)
    assert [(r["round"], r["clients"], r["failed"]) for r in rows] == [(1, 4, 0), (2, 4, 0)]
    assert all(0 < r["global_acc"] <= 1 for r in rows)
    assert _rows(sweep / PROCESSES) == rows  # the same bits in worker processes
    for point in (SEQUENTIAL, PROCESSES):
        summary = json.loads((sweep / point / "summary.json").read_text())
        assert summary["algorithm"] == "fedavgm"
        assert summary["strategy"] == {"server": "SGD with momentum 0.5 (FedAvgM), lr 1.0"}
        saved = yaml.safe_load((sweep / point / "config.yaml").read_text())
        assert saved["plugins"] == [PLUGIN]  # resolved against the config's folder
        assert saved["model"]["name"] == "tiny-mlp"
    summary = json.loads((sweep / PROCESSES / "summary.json").read_text())
    assert summary["executor"].startswith("processes (")


def test_list_with_a_plugin_adds_its_entries_and_says_whose_they_are(probe):
    lines = probe["list"]
    assert probe["list_status"] == 0
    assert (
        "  fedavgm      FedAvgM (Hsu et al. 2019): FedAvg with server momentum "
        "[example plugin]" in lines
    )
    models = next(line for line in lines if line.startswith("models: "))
    assert "tiny-mlp" in models.split(": ")[1].split(", ") and "mlp" in models
    assert "  fedavg       FedAvg (McMahan et al. 2017): sample-weighted averaging" in lines
    partitioners = next(line for line in lines if line.startswith("partitioners: "))
    assert partitioners == "partitioners: classes, dirichlet, halves, iid, natural, quantity"
    assert "  silent       a client that sends nothing" in lines
    assert (  # the built-in attacks, which only hetfl.attacks registers
        "  fedfa-poison honest update + lambda x the update trained on shuffled labels "
        "(FedFA, Eq. 1)" in lines
    )
    extra = Path(probe["work"]) / "extra.py"
    assert lines[-2:] == [
        f"plugin {PLUGIN}: algorithm fedavgm, model tiny-mlp",
        f"plugin {extra}: client-program wrapper silent, partitioner halves",
    ]


def test_the_example_method_is_server_sgd_with_momentum_as_hsu_et_al_write_it(probe):
    assert probe["fedavgm"]["rounds"] == 3
    assert probe["fedavgm"]["max_gap"] < 1e-12


def test_a_plugin_taking_a_name_already_registered_is_refused_naming_both(probe):
    work = Path(probe["work"])
    expected = {
        "dup_method.py": "algorithm 'fedavg' is already registered by HetFL (built in); "
        f"plugin '{work / 'dup_method.py'}' registers it again: give it another name",
        "dup_model.py": "model 'linear' is already registered by HetFL (built in); "
        f"plugin '{work / 'dup_model.py'}' registers it again as a scalable model",
        "dup_plugin.py": f"model 'tiny-mlp' is already registered by plugin '{PLUGIN}'; "
        f"plugin '{work / 'dup_plugin.py'}' registers it again",
    }
    for name, message in expected.items():
        assert probe[name].startswith(f"plugins: plugin '{work / name}' failed to import: ")
        assert message in probe[name], name
    other = work / "other" / "fedavgm_plugin.py"
    assert probe["same_file_name"] == (
        f"plugins: plugin '{other}': another file of the same name, '{PLUGIN}', is loaded as "
        "module 'hetfl_plugin_fedavgm_plugin'; rename one of them"
    )


def test_a_node_accepts_a_server_plugin_it_imported_from_its_own_config(probe):
    assert probe["node"] == [["/on/the/server/fedavgm_plugin.py"], "fedavgm", "tiny-mlp"]


def test_the_example_attack_uploads_the_update_reversed_as_a_plugin(probe):
    """docs/plugins.md's sign flip, loaded as a plugin and chosen by attack: (lambda 2): every
    parameter is received − 2·(trained − received), the honest client's trained values for
    the same inputs; the BatchNorm buffers are as trained; under wrappers: it is refused."""
    flip = probe["sign_flip"]
    assert flip["kind"] == "sign-flip"
    assert flip["described"] == {"kind": "sign-flip", "fraction": 0.25, "lambda": 2.0}
    assert flip["parameter_gap"] < 1e-6 and flip["moved"] and flip["buffers_as_trained"]
    assert "wrappers.0: 'sign-flip' is an attack" in flip["under_wrappers"]
    assert "attack: {kind: sign-flip, fraction:" in flip["under_wrappers"]
