"""One job: `hetfl client`: the node config that tells the ClientApp its partition and local
config, and the `flower-supernode` command this process replaces itself with."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from hetfl.config import ConfigError, RunConfig, load_raw, validate
from hetfl.launch.plumbing import flower_bin, free_port, require_flower
from hetfl.launch.security import Security


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


def exec_client(argv: Sequence[str]) -> None:
    """Become the SuperNode (it retries until the SuperLink is up; Ctrl-C stops it)."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(argv[0], list(argv), env)


# -- the commands --------------------------------------------------------------------------
def start_client(args: argparse.Namespace) -> int:
    """`hetfl client`: check everything the node will need, then become the SuperNode.

    The node's data is loaded (and so checked) here too, so a missing or malformed file is
    an error at this terminal rather than a refusal in the server's log.
    """
    from hetfl.assembly import load_dataset

    require_flower()
    cfg = validate(load_raw(args.config))
    attrs: dict[str, Any] = {}
    for pair in args.attr:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--attr {pair!r} is not of the form KEY=VALUE")
        attrs[key] = yaml.safe_load(value)
    argv = client_argv(
        cfg,
        args.config,
        args.partition_id,
        Security(insecure=args.insecure, ca_certfile=args.root_certificates),
        superlink=args.superlink,
        auth_key=args.auth_key,
        state_dir=args.state_dir,
        attrs=attrs,
    )
    load_dataset(cfg)
    print(
        f"client {args.partition_id}: connecting to {args.superlink or cfg.deploy.superlink} "
        "(Ctrl-C stops the node)",
        flush=True,
    )
    exec_client(argv)
    return 0  # not reached: exec replaced this process
