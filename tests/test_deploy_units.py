"""The Flower adapter's parts that need no federation: command checks, security flags,
node config strings, the refusal of simulator-only methods, static-BN statistics
combination, private state on a node, process clean-up."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hetfl.core.training import LocalTraining

pytest.importorskip("flwr")

from flwr.app import Context, RecordDict
from flwr.common.config import parse_config_args

from hetfl.cli import main
from hetfl.config import ConfigError, validate
from hetfl.core.client.bn_statistics import (
    BNStatistics,
    apply_bn_statistics,
    bn_batch_statistics,
    recompute_bn_statistics,
)
from hetfl.core.client.program import Programs
from hetfl.core.model_cache import ModelCache
from hetfl.core.simulator_only import SimulatorOnlyError, refuse_simulator_only
from hetfl.deploy.node import Node, PrivateState
from hetfl.deploy.records import from_content, to_content
from hetfl.engine.parts import Parts
from hetfl.engine.statistics import add_bn_statistics, bn_statistics_problem
from hetfl.launch import Processes, Security, node_config
from hetfl.models import PlainFamily
from strategies import fedavg

CONFIG = """
name: d
data: {dataset: digits, num_clients: 3}
model: {name: mlp}
train: {rounds: 1, clients_per_round: 2}
"""


def cfg_file(tmp_path: Path, extra: str = "") -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(CONFIG + extra + f"output_dir: {tmp_path / 'runs'}\n")
    return path


def run_cli(capsys, *args: str) -> tuple[int, str]:
    code = main(list(args))
    return code, capsys.readouterr().err


# -- commands refuse before starting anything --------------------------------------------
def test_serve_needs_tls_files_or_an_explicit_insecure(tmp_path, capsys):
    code, err = run_cli(capsys, "serve", str(cfg_file(tmp_path)))
    assert code == 2
    assert "--ssl-ca-certfile" in err and "--insecure" in err
    assert not (tmp_path / "runs").exists()


def test_serve_refuses_insecure_mixed_with_certificates(tmp_path, capsys):
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    code, err = run_cli(
        capsys, "serve", str(cfg_file(tmp_path)), "--insecure", "--ssl-ca-certfile", str(ca)
    )
    assert code == 2 and "--insecure cannot be combined with --ssl-ca-certfile" in err


def test_serve_refuses_a_sweep(tmp_path, capsys):
    code, err = run_cli(
        capsys, "serve", str(cfg_file(tmp_path)), "sweep={seed: [0, 1]}", "--insecure"
    )
    assert code == 2 and "a sweep cannot be served" in err


def test_resume_of_a_flower_run_points_to_serve(tmp_path, capsys):
    run_dir = tmp_path / "runs" / "d"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(CONFIG)
    (run_dir / "deploy.json").write_text("{}")
    code, err = run_cli(capsys, "resume", str(run_dir))
    assert code == 2 and "hetfl serve" in err and "--resume" in err


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--partition-id", "3", "--insecure"], "--partition-id 3 is outside 0..2"),
        (["--partition-id", "0"], "--root-certificates"),
        (["--partition-id", "0", "--insecure", "--attr", "tier"], "not of the form KEY=VALUE"),
    ],
)
def test_client_checks_its_arguments(tmp_path, capsys, args, expected):
    code, err = run_cli(capsys, "client", "--config", str(cfg_file(tmp_path)), *args)
    assert code == 2 and expected in err


def test_round_timeout_is_validated():
    assert validate({}).deploy.round_timeout_s == 600
    with pytest.raises(ConfigError, match=r"deploy\.round_timeout_s"):
        validate({"deploy": {"round_timeout_s": 0}})
    with pytest.raises(ConfigError, match="must be host:port"):
        validate({"deploy": {"superlink": "localhost"}})


def test_security_check_names_missing_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        Security(ca_certfile=tmp_path / "missing.pem").check(server=False)
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    Security(ca_certfile=ca).check(server=False)  # a client needs only the CA
    Security(insecure=True).check(server=True)


def test_node_config_parses_back_as_flower_reads_it(tmp_path):
    text = node_config(4, tmp_path / "my cfg.yaml", tmp_path / "state", {"arch": "deep", "tier": 2})
    parsed = parse_config_args([text])
    assert parsed["partition-id"] == 4
    assert parsed["hetfl-config"] == str((tmp_path / "my cfg.yaml").resolve())
    assert parsed["hetfl-state-dir"] == str((tmp_path / "state").resolve())
    assert parsed["hetfl-attrs"] == '{"arch": "deep", "tier": 2}'
    with pytest.raises(ConfigError, match="single quote"):
        node_config(0, tmp_path / "it's.yaml", None, {})


# -- split learning is simulator-only ------------------------------------------------------
def test_serve_refuses_a_simulator_only_method_before_anything_starts(tmp_path, capsys):
    split = ["algorithm=splitfed", "model={name: resnet-cifar, blocks: 1}"]
    code, err = run_cli(capsys, "serve", str(cfg_file(tmp_path)), *split, "--insecure")
    assert code == 2
    assert "algorithm 'splitfed' runs in the simulator only" in err
    assert "activations and gradients with the server every batch" in err
    assert "`hetfl run CONFIG`" in err
    assert not (tmp_path / "runs").exists()  # nothing written, no process started


def test_the_flower_server_refuses_simulator_only_methods_and_server_programs():
    from hetfl.deploy.server import Deployment, FlowerServer

    class SplitSide:  # a split-learning strategy's server side, built outside the registry
        def program(self, round, state, tasks):
            return None

        def index_map(self, served):
            return []

    family = PlainFamily("mlp", (1, 8, 8), 10)
    train = LocalTraining(lr=0.1)
    deployment = Deployment("fedavg", "", {}, 1, None, 1.0, 1.0)
    for strategy, why, expected in [
        (fedavg(family, clients_per_round=1, train=train), "why not", "why not"),
        (
            fedavg(family, clients_per_round=1, train=train, server_side=SplitSide()),
            None,
            "it needs a server program",
        ),
        (
            fedavg(family, clients_per_round=1, train=train, server_phase=object()),
            None,
            "it needs a server program .* or a round-level server phase",
        ),
    ]:
        parts = Parts(strategy, None, [], None, None, None, None, None)  # refused before use
        with pytest.raises(SimulatorOnlyError, match=f"simulator only: {expected}"):
            FlowerServer(None, parts, replace(deployment, simulator_only=why), Path("unused"))
    refuse_simulator_only("fedavg", None)  # declares nothing: served


def test_clients_bn_statistics_combine_to_the_pass_over_all_their_batches():
    """Static BN under Flower: each client sums per-batch statistics over its own data and
    the server adds the sums; when every client's data is a whole number of batches this is
    `recompute_bn_statistics` over the concatenated data (checked here by hand too)."""
    a = torch.tensor([[0.0, 0.0], [2.0, 2.0], [4.0, 0.0], [4.0, 4.0]])  # 2 batches of 2
    b = torch.tensor([[1.0, 1.0], [3.0, 1.0]])  # 1 batch
    model = torch.nn.Sequential(torch.nn.BatchNorm1d(2))
    total: BNStatistics = {}
    for x in (a, b):
        sums = bn_batch_statistics(model, x, batch_size=2)
        wire = from_content(to_content({"stats": {k: list(v) for k, v in sums.items()}}))
        assert bn_statistics_problem(total, wire["stats"]) is None
        add_bn_statistics(total, wire["stats"])
    apply_bn_statistics(model, total)
    combined = {k: v.clone() for k, v in model.state_dict().items()}
    # Per-batch means (1, 1), (4, 2), (2, 1); unbiased variances (2, 2), (0, 8), (2, 0).
    torch.testing.assert_close(combined["0.running_mean"], torch.tensor([7 / 3, 4 / 3]))
    torch.testing.assert_close(combined["0.running_var"], torch.tensor([4 / 3, 10 / 3]))
    assert int(combined["0.num_batches_tracked"]) == 3 and not model.training

    reference = torch.nn.Sequential(torch.nn.BatchNorm1d(2))
    recompute_bn_statistics(reference, torch.cat([a, b]), batch_size=2)
    for k, v in reference.state_dict().items():
        torch.testing.assert_close(combined[k], v)
    assert "differ from other clients'" in str(
        bn_statistics_problem(total, {"other": list(sums["0"])})
    )


# -- private state on a node ---------------------------------------------------------------
def make_node(state_dir: Path | None, checkpoint_every: int = 1) -> Node:
    family = PlainFamily("mlp", (1, 8, 8), 10)
    data = None  # PrivateState never reads the node's data
    keep = checkpoint_every + 1
    program = Programs(family).program_for(1)
    models = ModelCache(family)
    return Node(1, 0, {}, data, program, models, {}, state_dir, keep)  # type: ignore[arg-type]


def context() -> Context:
    return Context(run_id=1, node_id=7, node_config={}, state=RecordDict(), run_config={})


def test_private_state_lives_in_the_context_within_a_run():
    node, ctx = make_node(None), context()
    store = PrivateState(ctx, node)
    assert store.get(before_round=1) == {}
    store.put(1, {"bn": torch.tensor([1.0, 2.0])})
    assert torch.equal(PrivateState(ctx, node).get(before_round=2)["bn"], torch.tensor([1.0, 2.0]))
    assert PrivateState(context(), node).get() == {}  # a new run (or node) starts empty


def test_private_state_on_disk_survives_a_restart_and_serves_a_resumed_round(tmp_path):
    node = make_node(tmp_path / "client-1", checkpoint_every=2)
    store = PrivateState(context(), node)
    for rnd in (1, 2, 4, 5):
        store.put(rnd, {"bn": torch.full((2,), float(rnd))})
    # keep = checkpoint_every + 1 states: the oldest one is gone.
    assert sorted(p.name for p in (tmp_path / "client-1").iterdir()) == [
        "round-2",
        "round-4",
        "round-5",
    ]
    restarted = PrivateState(context(), node)  # a fresh Flower context: only the disk
    assert restarted.get()["bn"][0] == 5
    # A run resumed from the server's round-4 checkpoint trains round 5 with the state the
    # node had after round 4, not the one it trained in the lost round 5.
    assert restarted.get(before_round=5)["bn"][0] == 4
    assert restarted.get(before_round=3)["bn"][0] == 2


# -- process clean-up --------------------------------------------------------------------
def test_processes_stop_ends_detached_descendants(tmp_path):
    """A child that starts a grandchild in a new session (as Flower does): both end."""
    script = (
        "import subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'],"
        " start_new_session=True)\n"
        "time.sleep(600)\n"
    )
    procs = Processes()
    child = procs.start([sys.executable, "-c", script])
    deadline_checks = 0
    while len(procs.tagged()) < 2 and deadline_checks < 300:
        deadline_checks += 1
        subprocess.run([sys.executable, "-c", "pass"], check=True)  # let the child start
    assert len(procs.tagged()) == 2
    procs.stop(grace_s=5)
    assert child.poll() is not None
    assert procs.tagged() == []


# -- the warm client side: one node build per run, Flower's waits shortened --------------
def _context(run_id: int, node_id: int, partition: int) -> Context:
    config = {"partition-id": partition}
    return Context(
        run_id=run_id, node_id=node_id, node_config=config, state=RecordDict(), run_config={}
    )


def test_a_node_is_built_once_per_run_and_again_for_a_new_run_or_config(monkeypatch):
    from hetfl.deploy import node as deploy_node

    monkeypatch.setattr(deploy_node, "_NODES", {})
    built: list[tuple[int, str]] = []

    def build(node_config, server_config: str) -> Node:
        cid = int(node_config["partition-id"])
        built.append((cid, server_config))
        return replace(make_node(None), cid=cid)

    first = deploy_node.node_for(_context(1, 7, 0), "config A", build)
    assert deploy_node.node_for(_context(1, 7, 0), "config A", build) is first
    other = deploy_node.node_for(_context(1, 8, 1), "config A", build)  # a second virtual node
    assert deploy_node.node_for(_context(1, 7, 0), "config A", build) is first
    assert deploy_node.node_for(_context(1, 8, 1), "config A", build) is other
    assert built == [(0, "config A"), (1, "config A")]
    new_run = deploy_node.node_for(_context(2, 7, 0), "config A", build)
    assert new_run is not first and len(deploy_node._NODES) == 1  # run 1's nodes dropped
    new_config = deploy_node.node_for(_context(2, 7, 0), "config B", build)
    assert new_config is not new_run and len(deploy_node._NODES) == 1
    assert built == [(0, "config A"), (1, "config A"), (0, "config A"), (0, "config B")]


def test_the_supernode_loop_waits_less_and_wakes_the_executor(monkeypatch):
    import threading
    import types

    from flwr.supernode import start_client_internal

    from hetfl.launch import supernode

    slept: list[float] = []
    monkeypatch.setattr(supernode, "time", types.SimpleNamespace(sleep=slept.append))
    loop = types.ModuleType("loop")
    answers = iter([None, 42])
    loop.time = None
    loop._pull_and_store_message = lambda *args, **kwargs: next(answers)
    wake = threading.Event()
    supernode.patch_supernode_loop(loop, 0.25, wake)
    assert loop._pull_and_store_message() is None and not wake.is_set()  # no message
    assert loop._pull_and_store_message() == 42 and wake.is_set()  # a message of run 42
    loop.time.sleep(3)  # Flower's idle pause
    loop.time.sleep(0.5)  # its polls for the ClientApp's reply
    assert slept == [0.25, supernode.REPLY_POLL_S]
    # The pinned Flower has what is patched; another one is refused by name.
    assert hasattr(start_client_internal, "time")
    assert hasattr(start_client_internal, "_pull_and_store_message")
    with pytest.raises(
        RuntimeError, match=r"other has no time, _pull_and_store_message: .*flwr==1\.41\.0"
    ):
        supernode.patch_supernode_loop(types.ModuleType("other"), 0.25, wake)


def test_an_exchange_pulls_after_waits_that_double_up_to_its_poll(monkeypatch):
    import time
    import types

    from hetfl.deploy import exchange

    slept: list[float] = []
    clock = types.SimpleNamespace(sleep=slept.append, monotonic=time.monotonic)
    monkeypatch.setattr(exchange, "time", clock)
    reply = types.SimpleNamespace(metadata=types.SimpleNamespace(reply_to_message_id="m1"))
    pulls = iter([[], [], [], [], [], [], [reply]])  # the reply comes at the seventh pull
    grid = types.SimpleNamespace(
        push_messages=lambda messages: ["m1"], pull_messages=lambda ids: next(pulls)
    )
    replies = exchange.Exchange(grid, poll_s=0.05)({"client 0": object()}, timeout=60)
    assert replies == {"client 0": reply}
    assert slept == [0.01, 0.02, 0.04, 0.05, 0.05, 0.05]
