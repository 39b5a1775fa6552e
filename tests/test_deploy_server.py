"""The Flower server loop against the real ClientApp, in one process.

`LoopbackGrid` delivers each message to `hetfl.flower.client_app` with the node's own
Flower `Context`, as a SuperNode would, and can silence a node to play a dead one. This
covers the round loop's rules (registration refusals, timeouts as failures, resume with
private state kept on the nodes) in seconds; the real processes are in
`test_deploy_integration.py`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from pathlib import Path

import pytest
import yaml

pytest.importorskip("flwr")

from flwr.app import Context, Error, Message, RecordDict
from flwr.common.constant import ErrorCode
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.util import tensor_util

from hetfl.cli import main
from hetfl.config import validate
from hetfl.core.simulator_only import SimulatorOnlyError
from hetfl.deploy import node
from hetfl.deploy.records import from_content, record_tensors
from hetfl.deploy.server import FlowerServer
from hetfl.engine.outputs import read_metrics
from hetfl.engine.tracking import TENSORBOARD_DIR, scalars
from hetfl.flower import client_app, flower_server
from hetfl.launch import finish_served_run
from hetfl.runner import build_simulation, run_one

BASE = {
    "name": "loop",
    "seed": 4,
    "algorithm": "fedper",  # a private head: state that must stay on the nodes
    "data": {"dataset": "digits", "num_clients": 3, "test_per_client": 20},
    "model": {"name": "mlp"},
    "train": {"rounds": 3, "clients_per_round": 2, "batch_size": 16, "lr": 0.05},
    "eval": {"local_eval": "all"},
    "device": "cpu",
    "threads": 1,
}


@pytest.fixture(autouse=True)
def _task_identity(monkeypatch):
    """Flower's runtime names the ServerApp process's run and node before calling it
    (messages are stamped with them); so does this, for the length of a test."""
    from flwr.supercore.task_identity import TaskIdentity

    for attr in ("_task_id", "_run_id", "_node_id"):
        monkeypatch.setattr(TaskIdentity, attr, 1)


@pytest.fixture(autouse=True)
def _fresh_node_cache():
    """Nodes built by earlier tests (the ClientApp caches them per process) are not reused:
    each test's nodes start as new machines would."""
    node._NODES.clear()
    yield
    node._NODES.clear()


def config(**changes) -> dict:
    cfg = yaml.safe_load(yaml.safe_dump(BASE))
    for key, value in changes.items():
        node = cfg
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return cfg


class LoopbackGrid:
    """Just enough of Flower's `Grid` for `FlowerServer`: nodes answer in process."""

    def __init__(self, node_configs: list[dict], dead_in_training: Iterable[int] = ()) -> None:
        self.contexts = {
            1000 + i: Context(
                run_id=1, node_id=1000 + i, node_config=nc, state=RecordDict(), run_config={}
            )
            for i, nc in enumerate(node_configs)
        }
        # Node ids that register, then never answer again (killed before round 1's reply).
        self.dead_in_training = set(dead_in_training)
        self.replies: dict[str, Message] = {}

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            ids.append(msg.metadata.message_id)
            dead = self.dead_in_training
            if msg.metadata.dst_node_id in dead and msg.metadata.message_type != "query.register":
                continue
            try:
                reply = client_app(msg, self.contexts[msg.metadata.dst_node_id])
            except Exception as exc:  # as a SuperNode reports a ClientApp that raised
                reply = Message(
                    Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, str(exc)), reply_to=msg
                )
            self.replies[msg.metadata.message_id] = reply
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        return [self.replies.pop(m) for m in list(message_ids) if m in self.replies]


def nodes(tmp_path: Path, n: int, state: bool = False) -> list[dict]:
    return [
        {"partition-id": i, **({"hetfl-state-dir": str(tmp_path / f"node{i}")} if state else {})}
        for i in range(n)
    ]


def serve(grid, raw: dict, run_dir: Path, resume: bool = False) -> tuple[FlowerServer, list]:
    server = flower_server(grid, validate(raw), run_dir, show_progress=False, poll_s=0.01)
    server.run(resume=resume)
    return server, server.metrics.read()


def without_wall_time(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "wall_time_s"} for r in rows]


def same_trace(flower: Path, sim: Path) -> bool:
    """Both engines wrote the same non-empty per-client trace (it holds no wall time)."""
    rows = read_metrics(flower / "clients.jsonl")
    return bool(rows) and rows == read_metrics(sim / "clients.jsonl")


def test_resume_restores_the_server_and_nodes_keep_their_private_heads(tmp_path):
    """A run stopped after round 2 and resumed with fresh Flower contexts (so private
    heads come from the nodes' state directories) ends exactly as an uninterrupted
    simulator run, per-client trace included."""
    node_cfgs = nodes(tmp_path, 3, state=True)
    run_dir = tmp_path / "flower"
    serve(LoopbackGrid(node_cfgs), config(**{"train.rounds": 2}), run_dir)
    _, rows = serve(LoopbackGrid(node_cfgs), config(), run_dir, resume=True)

    run_one(validate(config()), tmp_path / "sim", show_progress=False)
    expected = read_metrics(tmp_path / "sim" / "metrics.jsonl")
    assert without_wall_time(rows) == without_wall_time(expected)
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert same_trace(run_dir, tmp_path / "sim")


def test_the_flower_server_feeds_tracking_too(tmp_path):
    """`tracking: tensorboard` under Flower: the server's rows reach the event files (their
    values against metrics.jsonl by hand are checked in test_tracking.py)."""
    run_dir = tmp_path / "flower"
    _, rows = serve(
        LoopbackGrid(nodes(tmp_path, 3)),
        config(**{"train.rounds": 2, "tracking": "tensorboard"}),
        run_dir,
    )
    acc = event_accumulator.EventAccumulator(str(run_dir / TENSORBOARD_DIR))
    acc.Reload()
    events = {
        tag: [(e.step, tensor_util.make_ndarray(e.tensor_proto).item()) for e in acc.Tensors(tag)]
        for tag in acc.Tags()[event_accumulator.TENSORS]
    }
    expected: dict[str, list] = {}
    for row in rows:
        for tag, value in scalars(row):
            expected.setdefault(tag, []).append((row["round"], value))
    assert events == expected
    assert [step for step, _ in events["local_acc"]] == [1, 2]


def test_without_state_dirs_a_resumed_node_restarts_its_private_head(tmp_path):
    """The documented limit: without a state directory the private head is re-initialised,
    so training after resuming differs from the uninterrupted run."""
    run_dir = tmp_path / "flower"
    first, _ = serve(LoopbackGrid(nodes(tmp_path, 3)), config(**{"train.rounds": 2}), run_dir)
    _, rows = serve(LoopbackGrid(nodes(tmp_path, 3)), config(), run_dir, resume=True)
    run_one(validate(config()), tmp_path / "sim", show_progress=False)
    expected = read_metrics(tmp_path / "sim" / "metrics.jsonl")
    assert without_wall_time(rows[:2]) == without_wall_time(expected[:2])
    assert rows[2]["loss"] != expected[2]["loss"], (rows, expected, first.participated)


def test_a_silent_client_is_named_dropped_after_max_missed_rounds_and_counted(tmp_path, capsys):
    """A node that registers, then never answers: its client is a timeout failure in
    rounds 1 and 2 (deploy.max_missed_rounds = 2), said when it first misses and when it is
    dropped, then no longer asked (round 3 waits for no one); summary.json counts it."""
    raw = config(
        algorithm="fedavg",
        **{"train.clients_per_round": 3, "eval.local_eval": "none", "deploy.round_timeout_s": 0.2},
    )
    grid = LoopbackGrid(nodes(tmp_path, 3), dead_in_training={1002})
    server = flower_server(grid, validate(raw), tmp_path / "run", poll_s=0.01)
    server.run()
    rows = server.metrics.read()
    assert [(r["round"], r["clients"], r["failed"]) for r in rows] == [
        (1, 2, 1),
        (2, 2, 1),
        (3, 2, 0),
    ]
    assert rows[2]["global_acc"] > 0.2
    # its client (partition 2) is traced as timed out: sent the model, nothing back
    silent = [r for r in read_metrics(tmp_path / "run" / "clients.jsonl") if r["cid"] == 2]
    assert [(r["round"], r["failure"]) for r in silent] == [(1, "timeout"), (2, "timeout")]
    assert all(r["bytes_down"] > 0 and r["bytes_up"] == r["macs"] == 0 for r in silent)
    said = [line for line in capsys.readouterr().err.splitlines() if "client 2 " in line]
    assert [line.split(":")[0] for line in said if "did not answer" in line] == ["warning"]
    assert "did not answer in round 1 (deploy.round_timeout_s = 0.2 s)" in said[0]
    dropped = [line for line in said if "dropped from sampling from round" in line]
    assert len(dropped) == 1 and "from round 3: it missed 2 round(s) in a row" in dropped[0]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["unresponsive"] == {"missed": 2, "dropped": 1, "rejoined": 0, "dropped_now": [2]}


class RestartingGrid(LoopbackGrid):
    """Node 1002 stops answering from its first training message; once round `restart`'s
    training messages are sent, it is gone and a new node (1003) serves its partition, as a
    restarted `hetfl client` would."""

    def __init__(self, node_configs: list[dict], restart: int) -> None:
        super().__init__(node_configs, dead_in_training={1002})
        self.restart = restart

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        messages = list(messages)
        ids = super().push_messages(messages)
        if any(m.metadata.group_id == str(self.restart) for m in messages):
            old = self.contexts.pop(1002)
            self.contexts[1003] = Context(
                run_id=1, node_id=1003, node_config=old.node_config, state=RecordDict(),
                run_config={},
            )  # fmt: skip
        return ids


def test_a_client_whose_node_restarts_rejoins_and_is_said(tmp_path, capsys):
    raw = config(
        algorithm="fedavg",
        **{
            "train.clients_per_round": 3,
            "eval.local_eval": "none",
            "deploy.round_timeout_s": 0.2,
            "deploy.max_missed_rounds": 1,
        },
    )
    grid = RestartingGrid(nodes(tmp_path, 3), 2)
    server = flower_server(grid, validate(raw), tmp_path / "r", poll_s=0.01)
    server.run()
    rows = server.metrics.read()
    assert [(r["round"], r["clients"], r["failed"]) for r in rows] == [
        (1, 2, 1),  # missed: dropped at once (max_missed_rounds 1)
        (2, 2, 0),  # not asked; its node restarts
        (3, 3, 0),  # the new node registered: back
    ]
    err = capsys.readouterr().err
    assert "client 2 dropped from sampling from round 2: it missed 1 round(s) in a row" in err
    assert "client 2 rejoined in round 3 (node 1003)" in err
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["unresponsive"] == {"missed": 1, "dropped": 1, "rejoined": 1, "dropped_now": []}


def test_serve_exits_3_when_no_node_ever_answered(tmp_path, capsys):
    """Nodes that register, then never answer: each round every client times out,
    summary.json counts the failures by kind, and `hetfl serve`'s exit status is 3."""
    raw = config(
        algorithm="fedavg",
        **{
            "data.dataset": "synthetic",
            "train.rounds": 2,
            "eval.local_eval": "none",
            "deploy.round_timeout_s": 0.05,
        },
    )
    grid = LoopbackGrid(nodes(tmp_path, 3), dead_in_training={1000, 1001, 1002})
    serve(grid, raw, tmp_path / "run")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["failures"] == {"timeout": 4} and summary["rounds_aggregated"] == 0
    assert finish_served_run(tmp_path / "run") == 3
    assert "no round aggregated any client's result in 2 rounds" in capsys.readouterr().err


@pytest.mark.parametrize("change", [{"seed": 99}, {"data.validation": 0.2}])
def test_nodes_with_other_data_settings_are_refused(change, tmp_path):
    """Another seed, or another validation hold-out (the node would train on samples the
    server scores as validation), is other data under the same partition id."""
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump(config(**change)))
    node_cfgs = nodes(tmp_path, 3)
    node_cfgs[2]["hetfl-config"] = str(other)
    raw = config(**{"deploy.min_clients": 2, "deploy.registration_timeout_s": 1})
    server, rows = serve(LoopbackGrid(node_cfgs), raw, tmp_path / "run")
    assert server.members.refused == {1002}
    assert sorted(server.members.infos) == [0, 1]
    assert all(r["clients"] == 2 for r in rows)


@pytest.mark.parametrize("algorithm", ["fedper", "fedavg"])
def test_val_acc_equals_the_simulators(algorithm, tmp_path):
    """FedPer has no global model: each node scores its model with its private head on its
    own validation split (an `EvalTask` with split "validation"). FedAvg's global model is
    scored by the server on the pooled validation samples, which it builds as the nodes
    hold them out. Either way every row equals the simulator's."""
    raw = config(algorithm=algorithm, **{"data.validation": 0.2, "train.rounds": 1})
    _, rows = serve(LoopbackGrid(nodes(tmp_path, 3)), raw, tmp_path / "flower")
    run_one(validate(raw), tmp_path / "sim", show_progress=False)
    expected = read_metrics(tmp_path / "sim" / "metrics.jsonl")
    assert without_wall_time(rows) == without_wall_time(expected)
    assert all(0 <= r["val_acc"] <= 1 and r["val_loss"] > 0 for r in rows)


def test_local_acc_trained_equals_the_simulators(tmp_path):
    """`eval.local_trained` under Flower: an `evaluate` exchange sends each trained client
    its own trained tensors, which its node scores with the private head it kept this
    round: every row and the per-client trace equal the simulator's."""
    raw = config(**{"train.rounds": 2, "eval.local_trained": True})
    _, rows = serve(LoopbackGrid(nodes(tmp_path, 3)), raw, tmp_path / "flower")
    run_one(validate(raw), tmp_path / "sim", show_progress=False)
    expected = read_metrics(tmp_path / "sim" / "metrics.jsonl")
    assert without_wall_time(rows) == without_wall_time(expected)
    assert same_trace(tmp_path / "flower", tmp_path / "sim")
    assert all(0 <= r["local_acc_trained"] <= 1 for r in rows)


MALICIOUS = ("malicious_kept", "malicious_clipped", "malicious_dropped")


def test_a_defence_runs_under_flower_as_in_the_simulator(tmp_path):
    """A defence alone (no attack, which `hetfl serve` refuses) through the adapter:
    Multi-Krum keeping 2 of the 3 clients each round; every row, its `defence` key included,
    and the per-client trace with each client's decision equal the simulator's, and the
    summary's totals too."""
    raw = config(
        algorithm="fedavg",
        options={"fedavg": {"reducer": {"kind": "multi-krum", "f": 0, "m": 2}}},
        **{"train.rounds": 2, "train.clients_per_round": 3},
    )
    _, rows = serve(LoopbackGrid(nodes(tmp_path, 3)), raw, tmp_path / "flower")
    summary = run_one(validate(raw), tmp_path / "sim", show_progress=False)
    expected = read_metrics(tmp_path / "sim" / "metrics.jsonl")
    assert without_wall_time(rows) == without_wall_time(expected)
    assert same_trace(tmp_path / "flower", tmp_path / "sim")
    decided = {"kind": "multi-krum", "kept": 2, "clipped": 0, "dropped": 1, "fallback": False}
    assert [r["defence"] for r in rows] == [{**decided, **dict.fromkeys(MALICIOUS)}] * 2
    served = json.loads((tmp_path / "flower" / "summary.json").read_text())
    assert served["defence"] == summary["defence"] and summary["defence"]["dropped"] == 2


def test_registration_gives_up_naming_the_missing_partitions(tmp_path):
    raw = config(**{"deploy.registration_timeout_s": 0.3})
    with pytest.raises(TimeoutError, match=r"missing partitions: \[2\]"):
        serve(LoopbackGrid(nodes(tmp_path, 2)), raw, tmp_path / "run")


@pytest.mark.parametrize(("stats_samples", "rounds"), [(None, 2), (700, 1)])
def test_heterofl_equals_the_simulator_with_statistics_passes_on_the_clients(
    tmp_path, stats_samples, rounds
):
    """HeteroFL's static BN under Flower: before each global evaluation every width's model
    gets BatchNorm statistics from the nodes' training data (`query.stats`; with
    `eval.stats_samples`, each node draws the share the server sends), and each client's
    local accuracy is the full-rate model with those statistics under its label mask. Every
    number (global_acc, each width, local_acc) equals the simulator's."""
    raw = config(
        algorithm="heterofl",
        options={"heterofl": {"levels": [1.0, 0.5], "assignment": "fixed"}},
        model={"name": "stage-cnn", "stages": 2, "bn": "static"},
        data={"dataset": "digits", "num_clients": 3, "partition": {"kind": "classes", "k": 4}},
        **{
            "train.rounds": rounds,
            "train.local_steps": 4,
            "eval.local_eval": "sampled",
            "eval.stats_samples": stats_samples,
        },
    )

    class Counting(LoopbackGrid):
        stats = 0

        def push_messages(self, messages):
            messages = list(messages)
            self.stats += sum(m.metadata.message_type == "query.stats" for m in messages)
            return super().push_messages(messages)

    grid = Counting(nodes(tmp_path, 3))
    _, rows = serve(grid, raw, tmp_path / "flower")
    run_one(validate(raw), tmp_path / "sim", show_progress=False)
    expected = read_metrics(tmp_path / "sim" / "metrics.jsonl")
    assert without_wall_time(rows) == without_wall_time(expected)
    assert same_trace(tmp_path / "flower", tmp_path / "sim")
    assert grid.stats == rounds * 2 * 3  # rounds x widths x registered clients
    for row in rows:
        assert {"width=1", "width=0.5"} <= set(row["groups"])
        assert 0 <= row["global_acc"] <= 1 and 0 <= row["local_acc"] <= 1


def test_fjord_sub_models_equal_the_simulator(tmp_path):
    """FjORD's heterogeneous sub-models through the adapter: client widths drawn per round,
    sliced index maps both ways, per-width BatchNorm and a pass per width at evaluation;
    every row, each width's group and the per-client trace equal the simulator's, and a
    half-width client is sent less than the whole model."""
    raw = config(
        algorithm="fjord",
        options={"fjord": {"levels": [0.5, 1.0]}},
        model={"name": "stage-cnn", "stages": 2},
        **{"train.rounds": 2, "train.local_steps": 4},
    )
    _, rows = serve(LoopbackGrid(nodes(tmp_path, 3)), raw, tmp_path / "flower")
    sim = build_simulation(validate(raw), tmp_path / "sim", show_progress=False)
    sim.run()
    expected = read_metrics(tmp_path / "sim" / "metrics.jsonl")
    assert without_wall_time(rows) == without_wall_time(expected)
    assert same_trace(tmp_path / "flower", tmp_path / "sim")
    assert all({"width=0.5", "width=1"} <= set(r["groups"]) for r in rows)
    assert rows[0]["bytes_down"] < 3 * sum(t.numel() * t.element_size() for t in sim.state.values())


@pytest.mark.parametrize(("algorithm", "widths"), [("flexifed", [0.125]), ("nefl", [0.125, 0.25])])
def test_fedfas_baselines_equal_the_simulator(algorithm, widths, tmp_path):
    """FlexiFed's per-path and NeFL's per-sub-model tensors (group-qualified names, NeFL's
    step sizes) through the adapter, on FedFA's seeded choice of architectures (budgets
    that fit every candidate): every row and the per-client trace equal the simulator's,
    every architecture evaluated. With `choice: zico` the set-up query is refused, naming
    the method's option."""
    budgets = [1e12] * 3

    def raw(choice: str) -> dict:
        return config(
            algorithm=algorithm,
            options={
                algorithm: {
                    "depths": [1, 2],
                    "widths": widths,
                    "choice": choice,
                    "budgets": budgets,
                }
            },
            model={"name": "preresnet", "stages": 2},
            **{"train.rounds": 2, "train.local_steps": 2},
        )

    _, rows = serve(LoopbackGrid(nodes(tmp_path, 3)), raw("random"), tmp_path / "flower")
    run_one(validate(raw("random")), tmp_path / "sim", show_progress=False)
    expected = read_metrics(tmp_path / "sim" / "metrics.jsonl")
    assert without_wall_time(rows) == without_wall_time(expected)
    assert same_trace(tmp_path / "flower", tmp_path / "sim")
    assert len([g for g in rows[-1]["groups"] if g.startswith("arch=")]) > 1
    with pytest.raises(
        SimulatorOnlyError, match=rf"asks each client .*{algorithm}\.choice: random"
    ):
        serve(LoopbackGrid(nodes(tmp_path, 3)), raw("zico"), tmp_path / "zico")


def scalablefl_config(**changes) -> dict:
    """Two client groups of digits views (16 px with 10 classes, 8 px with 3) and H0 = 4:
    depths 2 and 1, widths 1 and log 3 / log 10, private BN and heads."""
    raw = config(
        algorithm="scalablefl",
        options={"scalablefl": {"base_size": 4, "participation": 1.0}},
        model={"name": "stage-cnn"},
        data={
            "dataset": "digits",
            "test_per_client": 20,
            "groups": [{"size": 16, "classes": 10, "clients": 2}, {"size": 8, "classes": 3}],
        },
        **{"train.clients_per_round": 3, "train.momentum": 0.9, "train.weight_decay": 5e-4},
    )
    raw["data"]["groups"][1]["clients"] = 1
    for key, value in changes.items():
        raw[key] = value
    return raw


def test_scalablefl_equals_the_simulator_and_keeps_private_layers_on_the_nodes(tmp_path):
    """ScalableFL through the adapter: per-group depth and width, private BatchNorm and heads
    held in each node's Flower state (never in a message to or from the server), and the
    same metrics as the simulator, row for row, per group."""
    raw = scalablefl_config()

    class Recording(LoopbackGrid):
        def __init__(self, node_configs):
            super().__init__(node_configs)
            self.sent: set[str] = set()

        def push_messages(self, messages):
            messages = list(messages)
            for m in messages:
                if m.metadata.message_type == "train":
                    self.sent |= set(from_content(m.content)["task"].payload)
            return super().push_messages(messages)

    grid = Recording(nodes(tmp_path, 3))
    server, rows = serve(grid, raw, tmp_path / "flower")
    run_one(validate(raw), tmp_path / "sim", show_progress=False)
    expected = read_metrics(tmp_path / "sim" / "metrics.jsonl")
    assert without_wall_time(rows) == without_wall_time(expected)
    assert set(rows[-1]["groups"]) == {"group=16px-10cls", "group=8px-3cls"}

    private = set()
    for ctx in grid.contexts.values():
        held = set(record_tensors(ctx.state["hetfl.private"]))
        # Each node holds exactly its BN layers (affine and statistics) and its head ...
        assert {"head.weight", "head.bias", "stages.0.norm.running_mean"} <= held
        assert all(".norm." in n or n.startswith("head.") for n in held)
        private |= held
    # ... and none of them was ever sent.
    assert grid.sent and not (grid.sent & private)
    assert not any(n in server.state for n in private)


def test_a_node_with_other_client_groups_is_refused(tmp_path):
    other = tmp_path / "other.yaml"
    changed = scalablefl_config()
    changed["data"]["groups"][1]["classes"] = 4
    other.write_text(yaml.safe_dump(changed))
    node_cfgs = nodes(tmp_path, 3)
    node_cfgs[2]["hetfl-config"] = str(other)
    raw = scalablefl_config(deploy={"min_clients": 2, "registration_timeout_s": 1})
    raw["train"]["rounds"] = 1
    server, _ = serve(LoopbackGrid(node_cfgs), raw, tmp_path / "run")
    assert server.members.refused == {1002}


def fedfa_config(choice: str) -> dict:
    """FedFA on a Pre-ResNet of two sections, three clients of digits with 4 classes each."""
    return config(
        algorithm="fedfa",
        options={"fedfa": {"depths": [2, 3], "widths": [0.25, 0.5], "choice": choice}},
        model={"name": "preresnet", "stages": 2},
        data={"dataset": "digits", "num_clients": 3, "partition": {"kind": "classes", "k": 4}},
        **{"train.rounds": 2, "train.local_steps": 2, "eval.local_eval": "sampled"},
    )


def test_fedfa_equals_the_simulator_and_its_zico_query_is_refused(tmp_path):
    """FedFA with seeded choices: the architectures (drawn on the server from the run's
    seed), grafting, the round-level scaling and the statistics passes give every number
    the simulator gives, per architecture group and per client. With `choice: zico` the
    set-up would ask each node a question the adapter cannot send: it is refused, naming
    what to set instead."""
    raw = fedfa_config("random")
    _, rows = serve(LoopbackGrid(nodes(tmp_path, 3)), raw, tmp_path / "flower")
    run_one(validate(raw), tmp_path / "sim", show_progress=False)
    expected = read_metrics(tmp_path / "sim" / "metrics.jsonl")
    assert without_wall_time(rows) == without_wall_time(expected)
    assert same_trace(tmp_path / "flower", tmp_path / "sim")
    assert any(group.startswith("arch=") for group in rows[-1]["groups"])
    with pytest.raises(SimulatorOnlyError, match=r"asks each client .*fedfa\.choice: random"):
        serve(LoopbackGrid(nodes(tmp_path, 3)), fedfa_config("zico"), tmp_path / "zico")


def test_fedgkt_is_refused_by_serve_and_the_flower_server_before_anything_starts(tmp_path, capsys):
    """FedGKT's server phase (all of a round's uploaded features, per-sample logits back)
    has no Flower message yet: `hetfl serve` refuses it after validation, before the TLS
    check, the run folder or any process, and so does the Flower server when it is built,
    before any node is asked; both name the method and point to the simulator."""
    raw = config(
        algorithm="fedgkt",
        model={"name": "resnet-cifar", "blocks": 1},
        options={"fedgkt": {"server_epochs": 1}},
        output_dir=str(tmp_path / "runs"),
    )
    path = tmp_path / "fedgkt.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["serve", str(path)]) == 2  # not even --insecure is asked for first
    err = capsys.readouterr().err
    assert "algorithm 'fedgkt' runs in the simulator only" in err
    assert "round-level server phase" in err and "`hetfl run CONFIG`" in err
    assert not (tmp_path / "runs").exists()
    grid = LoopbackGrid(nodes(tmp_path, 3))
    refusal = r"'fedgkt' runs in the simulator only: .*round-level server phase.*`hetfl run"
    with pytest.raises(SimulatorOnlyError, match=refusal):
        serve(grid, raw, tmp_path / "flower")
    assert grid.replies == {} and not (tmp_path / "flower").exists()


def test_a_detection_run_equals_the_simulator(tmp_path):
    """ScalableFL's detector through the adapter: each node builds its detection client,
    trains with SSD's loss and answers its mAP on its local test scenes; the rows equal
    the simulator's, `local_map` and every group's `map` included."""
    from test_detection_runs import DETECTION

    raw = {**DETECTION, "name": "det"}
    _, rows = serve(LoopbackGrid(nodes(tmp_path, 3)), raw, tmp_path / "flower")
    run_one(validate(raw), tmp_path / "sim", show_progress=False)
    expected = read_metrics(tmp_path / "sim" / "metrics.jsonl")
    assert without_wall_time(rows) == without_wall_time(expected)
    assert rows[-1]["local_map"] is not None and set(rows[-1]["groups"]) == {
        "group=16px-2cls",
        "group=32px-3cls",
    }


def test_hetlora_self_pruning_runs_under_flower_as_in_the_simulator(tmp_path):
    """HetLoRA's local rank self-pruning through the adapter: the server decides each
    client's rank from the factors it sent, so a pruned client gets its smaller adapter
    from the next round on; every row and the per-client trace (each client's rank among
    it) equal the simulator's, and some rank falls."""
    raw = config(
        algorithm="hetlora",
        options={
            "hetlora": {
                "ranks": [2, 4, 8],
                "self_pruning": {"enabled": True, "gamma": 0.5, "lam": 1.0},
            }
        },
        **{"train.rounds": 3, "train.clients_per_round": 3},
    )
    _, rows = serve(LoopbackGrid(nodes(tmp_path, 3)), raw, tmp_path / "flower")
    run_one(validate(raw), tmp_path / "sim", show_progress=False)
    expected = read_metrics(tmp_path / "sim" / "metrics.jsonl")
    assert without_wall_time(rows) == without_wall_time(expected)
    assert same_trace(tmp_path / "flower", tmp_path / "sim")
    trace = [json.loads(line) for line in (tmp_path / "sim" / "clients.jsonl").open()]
    ranks = {(t["round"], t["cid"]): t["fields"]["rank"] for t in trace if t["fields"]}
    assert any(ranks[(3, c)] < ranks[(1, c)] for c in range(3))


def test_evaluation_on_the_simulated_clock_is_refused_under_flower(tmp_path):
    """`eval.every_sim_s` needs the simulator's clock; under Flower rounds take real time,
    so the server refuses it when built, before any node is asked."""
    raw = config(**{"system": {"preset": "dtfl"}, "eval.every_sim_s": 10.0})
    grid = LoopbackGrid(nodes(tmp_path, 3))
    with pytest.raises(ValueError, match=r"every_sim_s evaluates on the simulator's clock"):
        serve(grid, raw, tmp_path / "flower")
    assert grid.replies == {}
