"""One job: `hetfl serve`: write the run folder and a Flower App with no code, start the
SuperLink, register the nodes' keys, submit the app, wait for the run and stop the
SuperLink."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from hetfl.config import ConfigError, RunConfig, expand_sweep, validate
from hetfl.config.output import writable_folder
from hetfl.engine.outputs import NOTHING_AGGREGATED_EXIT, nothing_aggregated
from hetfl.engine.ports import split_address, wait_for_port
from hetfl.launch.client import CLIENT_APP
from hetfl.launch.plumbing import Processes, flower_bin, require_flower
from hetfl.launch.security import Security


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def write_flower_app(app_dir: Path, run_dir: Path, resume: bool) -> None:
    """A Flower App with no code: its components are HetFL's, its run config the run folder."""
    import tomli_w  # a dependency of flwr

    app_dir.mkdir(parents=True, exist_ok=True)
    project = {
        "build-system": {"requires": ["hatchling"], "build-backend": "hatchling.build"},
        "project": {
            "name": "hetfl-run",
            "version": "1.0.0",
            "description": "A HetFL run: the strategy and client program of hetfl.deploy",
            "license": "Apache-2.0",
            "dependencies": [],
        },
        "tool": {
            "flwr": {
                "app": {
                    "publisher": "hetfl",
                    "components": {
                        "serverapp": "hetfl.flower:server_app",
                        "clientapp": CLIENT_APP,
                    },
                    "config": {"hetfl-run-dir": str(run_dir.resolve()), "hetfl-resume": resume},
                }
            }
        },
    }
    (app_dir / "pyproject.toml").write_text(tomli_w.dumps(project))


def write_connection(flwr_home: Path, address: str, security: Security) -> None:
    """The Flower CLI's connection to our SuperLink, in a home of its own."""
    import tomli_w

    conn: dict[str, Any] = {"address": address}
    if security.insecure:
        conn["insecure"] = True
    else:
        conn["root-certificates"] = str(Path(str(security.ca_certfile)).resolve())
    flwr_home.mkdir(parents=True, exist_ok=True)
    text = tomli_w.dumps({"superlink": {"default": "hetfl", "hetfl": conn}})
    (flwr_home / "config.toml").write_text(text)


def serve(
    cfg: RunConfig,
    run_dir: Path,
    security: Security,
    *,
    node_keys: Sequence[Path] = (),
    resume: bool = False,
    bind: str | None = None,
    startup_timeout_s: float = 60.0,
) -> int:
    """Run `cfg` as a Flower federation served from this machine; returns an exit status
    (`finish_served_run`).

    `run_dir` must already hold `config.yaml`. `node_keys` are the SuperNodes' public keys:
    with any, node authentication is on and only those nodes may connect.
    """
    security.check(server=True)
    missing_keys = [str(k) for k in node_keys if not Path(k).is_file()]
    if missing_keys:
        raise ConfigError(f"--node-public-key: no such file: {', '.join(missing_keys)}")
    flower = run_dir / "flower"
    app_dir, home = flower / "app", flower / "home"
    write_flower_app(app_dir, run_dir, resume)
    host, port = split_address(cfg.deploy.superlink)
    write_connection(home, cfg.deploy.superlink, security)
    (run_dir / "deploy.json").write_text(
        json.dumps({"engine": "flower", "superlink": cfg.deploy.superlink}, indent=2) + "\n"
    )
    (run_dir / "summary.json").unlink(missing_ok=True)  # rewritten when the run completes

    argv = [flower_bin("flower-superlink"), "--host", bind or host, "--port", str(port)]
    argv += ["--disable-runtime-dependency-installation"]
    if security.insecure:
        argv += ["--insecure"]
    else:
        argv += ["--ssl-ca-certfile", str(security.ca_certfile)]
        argv += ["--ssl-certfile", str(security.certfile), "--ssl-keyfile", str(security.keyfile)]
    if node_keys:
        argv += ["--enable-supernode-auth"]
    env = {"FLWR_HOME": str(home.resolve())}
    dial = "127.0.0.1" if bind in ("0.0.0.0", "::") else (bind or host)
    procs = Processes()
    # A plain SIGTERM would end this process without cleaning up; make it unwind instead.
    previous = signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        superlink = procs.start(argv, log=flower / "superlink.log", env=env)
        wait_for_port(dial, port, superlink, startup_timeout_s)
        print(f"SuperLink listening on {cfg.deploy.superlink} (log: {flower / 'superlink.log'})")
        for key in node_keys:
            subprocess.run(
                [flower_bin("flwr"), "supernode", "register", str(key), "hetfl"],
                env=procs.env(env),
                check=True,
            )
        # `--stream` follows the run's log and returns when the run has ended.
        subprocess.run(
            [flower_bin("flwr"), "run", str(app_dir), "hetfl", "--stream"],
            env=procs.env(env),
            check=True,
        )
    finally:
        procs.stop()
        signal.signal(signal.SIGTERM, previous)
    return finish_served_run(run_dir)


def finish_served_run(run_dir: Path) -> int:
    """After the Flower run ended: plots, the final line and `hetfl serve`'s exit status
    (1: no summary, the run did not complete; `NOTHING_AGGREGATED_EXIT`: it completed
    without aggregating any client's result in any round; else 0)."""
    summary = run_dir / "summary.json"
    if not summary.exists():
        print(
            f"error: the run did not complete; see the log above and {run_dir / 'flower'}",
            file=sys.stderr,
        )
        return 1
    from hetfl.report import plot_run  # matplotlib only once a run is written

    plot_run(run_dir)
    done = json.loads(summary.read_text())
    final = done.get("final", {})
    shown = "  ".join(
        f"{k} {final[k]:.4f}" for k in ("global_acc", "local_acc") if final.get(k) is not None
    )
    print(f"{run_dir}: round {done.get('rounds_completed')}  {shown}")
    why = nothing_aggregated(done)
    if why is not None:
        print(f"error: {run_dir}: {why}", file=sys.stderr)
        return NOTHING_AGGREGATED_EXIT
    return 0


# -- a client ------------------------------------------------------------------------------


def refuse_attack(cfg: RunConfig) -> None:
    """ConfigError for a config with an `attack:` section: malicious clients are a
    simulation (the simulator draws them and wraps their programs); a real federation's
    nodes run their own programs."""
    if cfg.attack is not None:
        raise ConfigError(
            f"attack: {cfg.attack.kind} is a simulation of malicious clients and cannot be "
            "served: the nodes of a real federation run their own programs. Run it with "
            "`hetfl run`, or remove the attack: section (attack=null) to serve the clean run"
        )


def serve_config(raw: dict[str, Any], args: argparse.Namespace) -> int:
    """`hetfl serve`: check the config and the method, prepare the run folder, serve it.

    A sweep cannot be served (a federation runs one configuration). Everything that can be
    checked without the network is checked before any process starts: the config, that
    the method is not simulator-only (`Algorithm.simulator_only`, checked first, before
    even Flower's presence), that the strategy asks no set-up query and sets up, that the
    dataset loads (the server tests on it).
    """
    from hetfl.algorithms import ALGORITHMS
    from hetfl.assembly import build_parts
    from hetfl.core.simulator_only import needs_setup_query, refuse_simulator_only
    from hetfl.engine.rounds import setup_strategy

    if raw.get("sweep"):
        raise ConfigError("a sweep cannot be served: serve one point (sweep=null key=value ...)")
    cfg = validate(next(iter(expand_sweep(raw)))[1])
    refuse_attack(cfg)
    refuse_simulator_only(cfg.algorithm, ALGORITHMS.get(cfg.algorithm).simulator_only)
    require_flower()
    run_dir = Path(cfg.output_dir) / cfg.name
    writable_folder(run_dir)
    saved = run_dir / "config.yaml"
    if args.resume:
        if not (run_dir / "checkpoints").exists():
            raise ConfigError(f"{run_dir} has no checkpoint to resume from")
        if yaml.safe_load(saved.read_text()) != yaml.safe_load(cfg.to_yaml()):
            raise ConfigError(
                f"the config differs from the run's saved {saved}; --resume continues the saved "
                f"run: pass {saved} itself"
            )
    elif not args.overwrite and ((run_dir / "metrics.jsonl").exists() or saved.exists()):
        raise ConfigError(
            f"{run_dir} already holds a run; use --resume to continue it, --overwrite to "
            "replace it, or another name (name=...)"
        )
    security = Security(
        insecure=args.insecure,
        ca_certfile=args.ssl_ca_certfile,
        certfile=args.ssl_certfile,
        keyfile=args.ssl_keyfile,
    )
    security.check(server=True)
    parts = build_parts(cfg, show_progress=False)
    query = parts.strategy.capabilities.setup_query
    if query is not None:  # a question to every client at set-up (FedFA's ZiCo)
        refuse_simulator_only(cfg.algorithm, needs_setup_query(query.instead))
    # With the server's own view of the clients; the run registers the real ones.
    setup_strategy(parts.strategy, [c.info() for c in parts.clients], parts.settings)
    run_dir.mkdir(parents=True, exist_ok=True)
    if not args.resume:
        saved.write_text(cfg.to_yaml())
    return serve(
        cfg, run_dir, security, node_keys=args.node_public_key, resume=args.resume, bind=args.bind
    )
