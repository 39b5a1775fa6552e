"""One job: `hetfl client`: the node config that tells the ClientApp its partition and local
config, and the `flower-supernode` arguments of the SuperNode this process then runs, with
HetFL's ClientApp warm beside it (`hetfl.launch.supernode`)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from hetfl.config import ConfigError, RunConfig, load_raw, validate
from hetfl.engine.ports import free_port
from hetfl.launch.plumbing import flower_bin, require_flower
from hetfl.launch.security import Security

if TYPE_CHECKING:
    from flwr.clientapp import ClientApp

#: The ClientApp a node serves, as `hetfl serve`'s Flower App names it.
CLIENT_APP = "hetfl.flower:client_app"


def node_config(
    partition_id: int,
    config_path: Path,
    state_dir: Path | None,
    attrs: Mapping[str, Any],
) -> str:
    """The `--node-config` string of `flower-supernode` (TOML values, literal strings)."""

    def literal(text: str, what: str) -> str:
        if "'" in text or "\n" in text:
            raise ConfigError(f"{what} cannot contain a single quote or a newline: {text!r}")
        return f"'{text}'"

    parts = [f"partition-id={partition_id}"]
    parts.append(f"hetfl-config={literal(str(config_path.resolve()), 'the config path')}")
    if state_dir is not None:
        parts.append(f"hetfl-state-dir={literal(str(state_dir.resolve()), '--state-dir')}")
    if attrs:
        parts.append(f"hetfl-attrs={literal(json.dumps(dict(attrs)), '--attr values')}")
    return " ".join(parts)


def client_argv(
    cfg: RunConfig,
    config_path: Path,
    partition_id: int,
    security: Security,
    *,
    superlink: str | None = None,
    auth_key: Path | None = None,
    state_dir: Path | None = None,
    attrs: Mapping[str, Any] | None = None,
    runtime_port: int | None = None,
) -> list[str]:
    """The `flower-supernode` command line of one HetFL client node."""
    security.check(server=False)
    if not 0 <= partition_id < cfg.data.num_clients:
        raise ConfigError(
            f"--partition-id {partition_id} is outside 0..{cfg.data.num_clients - 1} "
            f"(data.num_clients = {cfg.data.num_clients})"
        )
    if auth_key is not None and not auth_key.is_file():
        raise ConfigError(f"--auth-key: file {str(auth_key)!r} does not exist")
    argv = [flower_bin("flower-supernode"), "--superlink", superlink or cfg.deploy.superlink]
    # Each node on a machine needs its own port for the API its ClientApp processes use.
    argv += ["--port", str(runtime_port or free_port())]
    if security.insecure:
        argv += ["--insecure"]
    else:
        argv += ["--root-certificates", str(security.ca_certfile)]
    if auth_key is not None:
        argv += ["--auth-supernode-private-key", str(auth_key)]
    argv += ["--node-config", node_config(partition_id, config_path, state_dir, attrs or {})]
    return argv


def _client_app() -> ClientApp:
    from hetfl.flower import client_app

    return client_app


# -- the commands --------------------------------------------------------------------------
def start_client(args: argparse.Namespace) -> int:
    """`hetfl client`: check everything the node will need, then run the SuperNode in
    this process with HetFL's ClientApp kept warm beside it (`hetfl.launch.supernode`).

    The node's data is loaded (and so checked) here too, so a missing or malformed file is
    an error at this terminal rather than a refusal in the server's log.
    """
    from hetfl.assembly import load_dataset
    from hetfl.launch.supernode import run_supernode

    require_flower()
    cfg = validate(load_raw(args.config))
    attrs: dict[str, Any] = {}
    for pair in args.attr:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--attr {pair!r} is not of the form KEY=VALUE")
        attrs[key] = yaml.safe_load(value)
    runtime_port = free_port()
    argv = client_argv(
        cfg,
        args.config,
        args.partition_id,
        Security(insecure=args.insecure, ca_certfile=args.root_certificates),
        superlink=args.superlink,
        auth_key=args.auth_key,
        state_dir=args.state_dir,
        attrs=attrs,
        runtime_port=runtime_port,
    )
    load_dataset(cfg)
    print(
        f"client {args.partition_id}: connecting to {args.superlink or cfg.deploy.superlink} "
        "(Ctrl-C stops the node)",
        flush=True,
    )
    run_supernode(argv[1:], runtime_port, _client_app, CLIENT_APP, cfg.deploy.node_poll_s)
    return 0
