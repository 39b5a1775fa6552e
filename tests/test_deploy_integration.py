"""Real federations on 127.0.0.1: `hetfl serve` (SuperLink + ServerApp) and `hetfl client`
nodes (SuperNodes) as separate processes, on scikit-learn's digits.

Every process a test starts carries a tag in its environment, inherited by everything
Flower starts below it; each test ends them all in `finally` and checks that none is left.
The waits below are bounds that keep a broken run from hanging the suite, not timings.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import yaml

pytest.importorskip("flwr")

from hetfl.config import load_raw, validate
from hetfl.launch import Processes, free_port
from hetfl.runner import build_simulation
from hetfl.sim import Simulation

pytestmark = pytest.mark.flower

HETFL = [sys.executable, "-m", "hetfl.cli"]
BOUND_S = 600  # the most a federation may take before the test gives up on it


def write_config(path: Path, port: int, **changes) -> Path:
    cfg = {
        "name": "fed",
        "seed": 2,
        "algorithm": "fedavg",
        "data": {"dataset": "digits", "num_clients": 2, "test_per_client": 30},
        "model": {"name": "mlp"},
        "train": {"rounds": 2, "clients_per_round": 2, "batch_size": 16, "lr": 0.05},
        "eval": {"local_eval": "none"},
        "device": "cpu",
        "threads": 1,
        "output_dir": str(path.parent / "runs"),
        "deploy": {
            "superlink": f"127.0.0.1:{port}",
            "round_timeout_s": 120,
            "registration_timeout_s": 120,
        },
    }
    for key, value in changes.items():
        node = cfg
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    path.write_text(yaml.safe_dump(cfg))
    return path


def wait_for(predicate, what: str, bound_s: float = BOUND_S) -> None:
    deadline = time.monotonic() + bound_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.1)


def start_server(procs, tmp_path, argv):
    """`hetfl serve ARGV`, once its run is submitted (node keys are registered by then:
    a SuperNode whose key the SuperLink does not know yet gives up)."""
    server = procs.start([*HETFL, "serve", *argv], log=tmp_path / "serve.log")
    log = tmp_path / "serve.log"
    wait_for(
        lambda: "Successfully started run" in log.read_text() or server.poll() is not None,
        "the server to start",
    )
    return server


def start_clients(procs, tmp_path, config, n, extra=lambda i: []):
    home = {"FLWR_HOME": str(tmp_path / "nodes")}
    return [
        procs.start(
            [*HETFL, "client", "--partition-id", str(i), "--config", str(config), *extra(i)],
            log=tmp_path / f"client{i}.log",
            env=home,
        )
        for i in range(n)
    ]


def logs(tmp_path: Path) -> str:
    return "\n".join(
        f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp_path.glob("*.log"))
    )


def rows_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_simulator_agrees(rows: list[dict], config: Path, tmp_path: Path) -> Simulation:
    """Run `config` in the simulator and check that its metrics rows equal `rows` (wall
    time aside); returns the finished simulation."""
    cfg = validate(load_raw(config)).model_copy(update={"name": "sim"})
    sim = build_simulation(cfg, tmp_path / "runs" / "sim", show_progress=False)
    sim.run()
    expected = sim.metrics.read()
    for row in (*rows, *expected):
        row.pop("wall_time_s")
    assert rows == expected
    return sim


def shut_down(procs: Processes) -> None:
    procs.stop(grace_s=10)
    assert procs.tagged() == [], "processes left behind"


# -- TLS and node keys, made here ------------------------------------------------------
def make_tls(folder: Path) -> dict[str, Path]:
    """A CA and a SuperLink certificate for 127.0.0.1 signed by it."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    def pem_key(key) -> bytes:
        return key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )

    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "hetfl test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=1))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP384R1())
    names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=1))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    folder.mkdir(parents=True, exist_ok=True)
    files = {"ca": folder / "ca.pem", "cert": folder / "server.pem", "key": folder / "server.key"}
    files["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files["key"].write_bytes(pem_key(key))
    return files


def make_node_keys(folder: Path, n: int) -> list[tuple[Path, Path]]:
    """(private, public) OpenSSH EC key pairs, one per node."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    pairs = []
    for i in range(n):
        key = ec.generate_private_key(ec.SECP384R1())
        private, public = folder / f"node{i}", folder / f"node{i}.pub"
        private.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.OpenSSH,
                serialization.NoEncryption(),
            )
        )
        public.write_bytes(
            key.public_key().public_bytes(
                serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
            )
        )
        pairs.append((private, public))
    return pairs


# -- the tests -------------------------------------------------------------------------
def test_fjord_over_tls_with_node_authentication_equals_the_simulator(tmp_path):
    """Two authenticated nodes over TLS, two rounds of FjORD with local evaluation: sub-models
    of two widths (sliced index maps both ways, per-width passes) over the real transport,
    and every row equal to the simulator's. (Each real federation costs about 100 s of
    SuperLink and node start-up, so this one test carries TLS, node keys, sub-models and the
    nodes' state directories; FedAvg, ScalableFL's private layers and the other methods are
    checked in process, tests/test_deploy_server.py.)"""
    port = free_port()
    config = write_config(
        tmp_path / "fjord.yaml",
        port,
        algorithm="fjord",
        **{
            "options.fjord.levels": [0.5, 1.0],
            "model": {"name": "stage-cnn", "stages": 2},
            "eval.local_eval": "sampled",
        },
    )
    tls = make_tls(tmp_path / "tls")
    keys = make_node_keys(tmp_path, 2)
    procs = Processes()
    try:
        server = start_server(
            procs,
            tmp_path,
            [
                str(config),
                "--ssl-ca-certfile", str(tls["ca"]),
                "--ssl-certfile", str(tls["cert"]),
                "--ssl-keyfile", str(tls["key"]),
                *[arg for _, pub in keys for arg in ("--node-public-key", str(pub))],
            ],
        )  # fmt: skip
        clients = start_clients(
            procs,
            tmp_path,
            config,
            2,
            lambda i: [
                "--root-certificates", str(tls["ca"]),
                "--auth-key", str(keys[i][0]),
                "--state-dir", str(tmp_path / f"state{i}"),
            ],
        )  # fmt: skip
        assert server.wait(timeout=BOUND_S) == 0, logs(tmp_path)
        assert all(c.poll() is None for c in clients), "a client node died"
    finally:
        shut_down(procs)

    run_dir = tmp_path / "runs" / "fed"
    rows = rows_of(run_dir)
    assert [r["round"] for r in rows] == [1, 2]
    assert all(r["clients"] == 2 and r["failed"] == 0 for r in rows)
    assert all(r["local_acc"] is not None for r in rows)
    assert {"width=0.5", "width=1"} <= set(rows[1]["groups"])
    assert 0 < rows[0]["macs"] < rows[1]["macs"]
    # Real processes, TLS, real network: the same numbers as the simulator, row for row.
    assert_simulator_agrees(rows, config, tmp_path)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds_completed"] == 2 and summary["engine"] == "flower"
    assert summary["final"]["global_acc"] == rows[1]["global_acc"]
    # Each node is one warm process: its partition and client program were built once for
    # the run's register, train and evaluate messages.
    for i in range(2):
        log = (tmp_path / f"client{i}.log").read_text()
        assert log.count("Receiving: ") == 5, log  # register, 2 x (train, evaluate)
        assert log.count(f"client {i}: partition and client program built") == 1, log
    # Each node kept its (here empty: FjORD shares everything) private state on disk.
    for i in range(2):
        assert sorted(p.name for p in (tmp_path / f"state{i}" / f"client-{i}").iterdir()) == [
            "round-1",
            "round-2",
        ]


def test_a_client_killed_mid_round_is_recorded_and_the_run_goes_on(tmp_path):
    """Three nodes; node 2 is killed once registered, before it can answer round 1 (its
    own config makes it ask the SuperLink for messages only every 15 s, so round 1's
    message waits for it). The server keeps running, round 1 aggregates the two that
    answered within round_timeout_s and records the failure, and round 2 proceeds with the
    two that are left. The server names the silent client and counts it in summary.json."""
    port = free_port()
    changes = {"data.num_clients": 3, "train.clients_per_round": 3, "deploy.round_timeout_s": 15}
    config = write_config(tmp_path / "faults.yaml", port, **changes)
    slow = write_config(tmp_path / "slow.yaml", port, **changes, **{"deploy.node_poll_s": 15})
    procs, victim = Processes(), Processes()
    try:
        server = start_server(procs, tmp_path, [str(config), "--insecure"])
        start_clients(procs, tmp_path, config, 2, lambda i: ["--insecure"])
        victim.start(
            [*HETFL, "client", "--partition-id", "2", "--config", str(slow), "--insecure"],
            log=tmp_path / "client2.log",
            env={"FLWR_HOME": str(tmp_path / "nodes")},
        )
        serve_log = tmp_path / "serve.log"
        wait_for(
            lambda: "3 clients registered" in serve_log.read_text() or server.poll() is not None,
            "registration",
        )
        assert server.poll() is None, logs(tmp_path)
        for pid in victim.tagged():  # the node: its SuperNode and its warm ClientApp
            os.kill(pid, signal.SIGKILL)
        assert server.wait(timeout=BOUND_S) == 0, logs(tmp_path)
    finally:
        shut_down(victim)
        shut_down(procs)
    assert "Receiving: train" not in (tmp_path / "client2.log").read_text()
    rows = rows_of(tmp_path / "runs" / "fed")
    assert [(r["round"], r["clients"], r["failed"]) for r in rows[:1]] == [(1, 2, 1)]
    log = serve_log.read_text()
    assert "client 2 excluded in round 1" in log
    # Round 2 goes on with the two live clients. Whether it still asks client 2 (and records
    # a second failure) depends on whether Flower's heartbeats have marked the node offline.
    assert (rows[1]["round"], rows[1]["clients"]) == (2, 2)
    assert rows[1]["failed"] == ("client 2 excluded in round 2" in log)
    assert all(r["global_acc"] is not None for r in rows)
    summary = json.loads((tmp_path / "runs" / "fed" / "summary.json").read_text())
    assert summary["rounds_completed"] == 2
    # Named once when first missed; dropped in round 2 only if Flower saw the node leave
    # (deploy.max_missed_rounds is 2, and a second miss would drop it only from round 3).
    assert log.count("warning: client 2 did not answer") == 1
    assert "did not answer in round 1" in log
    dropped = "client 2 dropped from sampling from round 2: its node" in log
    assert summary["unresponsive"] == {
        "missed": 1 + rows[1]["failed"],
        "dropped": int(dropped),
        "rejoined": 0,
        "dropped_now": [2] if dropped else [],
    }
