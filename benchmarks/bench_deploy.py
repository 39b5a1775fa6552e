"""Deployment rounds over Flower (issue 35): a bare Flower app against HetFL's README
example, on loopback, in one invocation, with the same number of SuperNodes.

- bare: `bare_flower_app.py` (the Message API, a NumPy "model", nothing else) on Flower's
  own `flower-superlink`, `flower-supernode`s and `flwr run`, as a Flower user starts them;
  a round is a `train` and an `evaluate` exchange, as in Flower's FedAvg and in HetFL's
  example (local evaluation of the sampled clients is on by default).
- hetfl: the README's "server and three clients on one machine" (FedAvg, digits, `mlp`,
  N clients, all of them each round, `--insecure`) through `hetfl serve` and N `hetfl
  client`s, with `HETFL_DEPLOY_PROFILE` set so that every node and the server log each
  message's times (`hetfl.deploy.profile`).

Per round: the bare app's server times each round; HetFL's from `metrics.jsonl`'s
cumulative `wall_time_s`. Round 1 is reported apart (it pays the first messages' set-up);
the ratio is over rounds 2..R. The per-message profile splits each HetFL message into:
delivery (server push to the node's process taking it: the SuperNode's polling of the
SuperLink and, cold, the SuperExec's poll and the process spawn), start-up (process start
to the handler: interpreter, imports, FAB install, pulling the message), build (the node's
partition and client program), compute (training or evaluation) and reply (the reply's
way back until the server's poll saw it).

Every process started is ended, and none is left (`hetfl.launch.Processes`, as the
deployment integration tests use). Usage:

    python benchmarks/bench_deploy.py --nodes 3 --rounds 5
    python benchmarks/bench_deploy.py --nodes 20 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import tomli_w
import yaml

from hetfl.deploy.profile import ENV as PROFILE_ENV
from hetfl.engine.ports import wait_for_port
from hetfl.launch import Processes, Security, free_port
from hetfl.launch.plumbing import flower_bin
from hetfl.launch.serve import write_connection

HETFL = [sys.executable, "-m", "hetfl.cli"]
HERE = Path(__file__).resolve().parent
BOUND_S = 3600  # the most one federation may take before the benchmark gives up
STAGES = ("delivery", "startup", "build", "compute", "reply")


def ended(procs: Processes) -> None:
    procs.stop(grace_s=10)
    if procs.tagged():
        sys.exit(f"benchmark FAILED: processes left behind: {procs.tagged()}")


def bare(workdir: Path, nodes: int, rounds: int, poll_s: float, size: int) -> list[float]:
    """Seconds per round of the bare Flower app."""
    port, app, home = free_port(), workdir / "app", workdir / "home"
    app.mkdir(parents=True)
    shutil.copy(HERE / "bare_flower_app.py", app)
    out = workdir / "rounds.jsonl"
    project = {
        "build-system": {"requires": ["hatchling"], "build-backend": "hatchling.build"},
        "project": {"name": "bare", "version": "1.0.0", "license": "Apache-2.0"},
        "tool": {
            "flwr": {
                "app": {
                    "publisher": "bench",
                    "components": {
                        "serverapp": "bare_flower_app:server_app",
                        "clientapp": "bare_flower_app:client_app",
                    },
                    "config": {
                        "nodes": nodes,
                        "rounds": rounds,
                        "poll-s": poll_s,
                        "size": size,
                        "out": str(out),
                    },
                }
            }
        },
    }
    (app / "pyproject.toml").write_text(tomli_w.dumps(project))
    write_connection(home, f"127.0.0.1:{port}", Security(insecure=True))
    env = {"FLWR_HOME": str(home)}
    procs = Processes()
    try:
        link = procs.start(
            [
                flower_bin("flower-superlink"), "--host", "127.0.0.1", "--port", str(port),
                "--insecure", "--disable-runtime-dependency-installation",
            ],
            log=workdir / "superlink.log",
            env=env,
        )  # fmt: skip
        wait_for_port("127.0.0.1", port, link, 120)
        for i in range(nodes):
            procs.start(
                [
                    flower_bin("flower-supernode"), "--superlink", f"127.0.0.1:{port}",
                    "--port", str(free_port()), "--insecure",
                    "--node-config", f"partition-id={i}",
                ],
                log=workdir / f"node{i}.log",
                env={"FLWR_HOME": str(workdir / "nodes")},
            )  # fmt: skip
        with open(workdir / "run.log", "wb") as log:
            subprocess.run(
                [flower_bin("flwr"), "run", str(app), "hetfl", "--stream"],
                env=procs.env(env),
                stdout=log,
                stderr=subprocess.STDOUT,
                check=True,
                timeout=BOUND_S,
            )
    finally:
        ended(procs)
    seconds = [json.loads(line)["seconds"] for line in out.read_text().splitlines()]
    if len(seconds) != rounds:
        sys.exit(f"benchmark FAILED: the bare app ran {len(seconds)} of {rounds} rounds")
    return seconds


def hetfl(workdir: Path, nodes: int, rounds: int) -> tuple[list[float], list[dict[str, Any]]]:
    """Seconds per round of HetFL's README example, and its per-message profile."""
    port = free_port()
    workdir.mkdir(parents=True)
    config = workdir / "fed.yaml"
    cfg = {
        "name": "fed",
        "algorithm": "fedavg",
        "data": {"dataset": "digits", "num_clients": nodes},
        "model": {"name": "mlp"},
        "train": {"rounds": rounds, "clients_per_round": nodes, "lr": 0.05, "batch_size": 16},
        "deploy": {
            "superlink": f"127.0.0.1:{port}",
            "round_timeout_s": BOUND_S,
            "registration_timeout_s": BOUND_S,
        },
        "output_dir": str(workdir / "runs"),
    }
    config.write_text(yaml.safe_dump(cfg))
    profile = workdir / "profile.jsonl"
    env = {PROFILE_ENV: str(profile)}
    procs = Processes()
    try:
        server = procs.start(
            [*HETFL, "serve", str(config), "--insecure"], log=workdir / "serve.log", env=env
        )
        for i in range(nodes):
            procs.start(
                [*HETFL, "client", "--partition-id", str(i), "--config", str(config), "--insecure"],
                log=workdir / f"client{i}.log",
                env={**env, "FLWR_HOME": str(workdir / "nodes")},
            )
        status = server.wait(timeout=BOUND_S)
    finally:
        ended(procs)
    if status != 0:
        sys.exit(f"benchmark FAILED: hetfl serve exited {status}; see {workdir}/serve.log")
    metrics = (workdir / "runs" / "fed" / "metrics.jsonl").read_text().splitlines()
    total = [json.loads(line)["wall_time_s"] for line in metrics]
    seconds = [b - a for a, b in zip([0.0, *total], total, strict=False)]
    return seconds, messages(profile)


def messages(profile: Path) -> list[dict[str, Any]]:
    """Each message the nodes handled, with its stages in seconds (see the docstring)."""
    lines = [json.loads(x) for x in profile.read_text().splitlines()]
    seen = {x["message"]: x["seen"] for x in lines if x["side"] == "server"}
    out = []
    for x in (x for x in lines if x["side"] == "node" and x["message"] in seen):
        start = x["process"] if x["process"] > x["created"] else x["entered"]  # cold, warm
        stages = {
            "delivery": start - x["created"],
            "startup": x["entered"] - start,
            "build": x["built"] - x["entered"],
            "compute": x["done"] - x["built"],
            "reply": seen[x["message"]] - x["done"],
        }
        out.append({"kind": x["kind"], "round": x["round"], **stages})
    return out


def later(seconds: list[float]) -> float:
    return statistics.mean(seconds[1:]) if len(seconds) > 1 else float("nan")


def report(nodes: int, bare_s: list[float], hetfl_s: list[float], msgs: list[dict]) -> dict:
    load = os.getloadavg()[0]
    print(f"\n{nodes} nodes, {len(bare_s)} rounds, {os.cpu_count()} cores, load {load:.1f}")
    print(f"{'app':8} {'round 1 s':>10} {'rounds 2.. s':>13}  per round")
    for name, s in (("bare", bare_s), ("hetfl", hetfl_s)):
        print(f"{name:8} {s[0]:10.2f} {later(s):13.2f}  {' '.join(f'{x:.2f}' for x in s)}")
    ratio, first = later(hetfl_s) / later(bare_s), hetfl_s[0] / bare_s[0]
    print(f"ratio hetfl/bare per round ({nodes} nodes): {ratio:.2f}  (round 1: {first:.2f})")
    print("\nHetFL per message, mean seconds over rounds 2.. (n: messages):")
    print(f"{'kind':15} {'n':>4} " + " ".join(f"{s:>9}" for s in STAGES) + f" {'total':>9}")
    profile: dict[str, dict[str, float]] = {}
    for kind in ("query.register", "train", "evaluate"):
        rows = [m for m in msgs if m["kind"] == kind and m["round"] != "1"]
        if not rows:
            continue
        means = {s: statistics.mean(m[s] for m in rows) for s in STAGES}
        profile[kind] = means
        cells = " ".join(f"{means[s]:9.3f}" for s in STAGES)
        print(f"{kind:15} {len(rows):4} {cells} {sum(means.values()):9.3f}")
    return {"nodes": nodes, "bare_s": bare_s, "hetfl_s": hetfl_s, "ratio": ratio, "msgs": profile}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--poll-s", type=float, default=0.05, help="the bare server's poll")
    parser.add_argument("--size", type=int, default=55210, help="floats in the bare model (mlp's)")
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    parser.add_argument("--keep", type=Path, help="keep the work folder (logs) here")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="bench-deploy-")) if args.keep is None else args.keep
    try:
        bare_s = bare(workdir / "bare", args.nodes, args.rounds, args.poll_s, args.size)
        hetfl_s, msgs = hetfl(workdir / "hetfl", args.nodes, args.rounds)
    finally:
        if args.keep is None:
            shutil.rmtree(workdir, ignore_errors=True)
    result = report(args.nodes, bare_s, hetfl_s, msgs)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
