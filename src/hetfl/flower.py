"""The Flower apps, `server_app` and `client_app`, as Flower loads them by name.

This is the face's side of the Flower engine: the engine (`hetfl.deploy`) takes explicit
parts and never reads a config, so the config is taken apart here. `hetfl serve` writes a
Flower App whose components are `hetfl.flower:server_app` and `hetfl.flower:client_app`
(HetFL itself is installed on every machine, so the app carries no code); its run config
names the run directory, whose `config.yaml` drives the run. `make_server_app` builds a
server app for a config held in memory, for Flower's simulation engine
(`flwr.simulation.run_simulation`), which takes app objects.

The server sends its resolved config as YAML text with every request; each node parses it
here (`build_node`), takes `data`, `device` and `threads` from its own config, and builds
its client with the simulator's `build_parts`, so both engines train the same client on
the same data by construction.

Plugins (docs/plugins.md): a node imports the plugins its own config names, never one a
server's message names (a message must not make a node run code); a plugin of the server's
config that the node has not imported is an error on the node, naming it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from hetfl.algorithms import ALGORITHMS
from hetfl.assembly import build_parts
from hetfl.config import RunConfig, load_raw, validate
from hetfl.core.model_cache import ModelCache
from hetfl.deploy.exchange import POLL_S
from hetfl.deploy.node import Node, make_client_app
from hetfl.deploy.server import Deployment, FlowerServer
from hetfl.engine.tracking import make_sinks

#: Keys of the Flower run config that `hetfl serve` sets.
RUN_DIR_KEY = "hetfl-run-dir"
RESUME_KEY = "hetfl-resume"


def data_fingerprint(cfg: RunConfig) -> dict[str, Any]:
    """What must agree between server and node for partition `i` to be the same data."""
    return {
        "dataset": cfg.data.dataset,
        "num_clients": cfg.data.num_clients,
        "partition": cfg.data.partition.model_dump(mode="json"),
        "test_per_client": cfg.data.test_per_client,
        "validation": cfg.data.validation,
        "groups": [g.model_dump(mode="json") for g in cfg.data.groups or []],
        "seed": cfg.seed,
    }


def parse_config(text: str) -> RunConfig:
    """A config sent as YAML text (the server's resolved config). It imports nothing: each
    plugin it names must be imported already, by the node's own config (a file plugin is
    known by its file name, `hetfl.core.plugins.module_name`), else a ConfigError names it."""
    return validate(yaml.safe_load(text) or {}, import_plugins=False)


def build_node(node_config: Mapping[str, Any], server_config: str) -> Node:
    """A node's client from Flower's node config (see `hetfl.deploy.node`) and the
    server's config text: the server's config with the node's own data, device, threads."""
    if "partition-id" not in node_config:
        raise ValueError("the node has no partition-id in its node config (hetfl client sets it)")
    cid = int(node_config["partition-id"])
    own = node_config.get("hetfl-config")  # first: it imports the node's plugins
    own_config = validate(load_raw(str(own))) if "hetfl-config" in node_config else None
    server = parse_config(server_config)
    local = server if own_config is None else own_config
    if not 0 <= cid < local.data.num_clients:
        raise ValueError(
            f"partition-id {cid} is outside 0..{local.data.num_clients - 1} "
            f"(data.num_clients = {local.data.num_clients})"
        )
    cfg = server.model_copy(
        update={"data": local.data, "device": local.device, "threads": local.threads}
    )
    state_dir = node_config.get("hetfl-state-dir") or local.deploy.state_dir
    attrs = json.loads(str(node_config["hetfl-attrs"])) if "hetfl-attrs" in node_config else {}
    parts = build_parts(cfg, show_progress=False)
    return Node(
        cid=cid,
        seed=cfg.seed,
        fingerprint=data_fingerprint(local),
        data=parts.clients[cid],
        program=parts.programs.program_for(cid),
        models=ModelCache(parts.programs.family, parts.programs.device),
        attrs=attrs,
        state_dir=Path(str(state_dir)) / f"client-{cid}" if state_dir else None,
        # A server checkpoint is at most `checkpoint_every` rounds behind the node's latest
        # participation, so that many older states, plus the latest, are enough.
        keep=cfg.checkpoint_every + 1,
    )


def deployment(cfg: RunConfig) -> Deployment:
    """The Flower server's settings besides the run's parts."""
    return Deployment(
        algorithm=cfg.algorithm,
        config_text=cfg.to_yaml(),
        fingerprint=data_fingerprint(cfg),
        num_clients=cfg.data.num_clients,
        min_clients=cfg.deploy.min_clients,
        registration_timeout_s=cfg.deploy.registration_timeout_s,
        round_timeout_s=cfg.deploy.round_timeout_s,
        max_missed_rounds=cfg.deploy.max_missed_rounds,
        device_profiles=bool(cfg.system.preset or cfg.system.profiles),
        simulator_only=ALGORITHMS.get(cfg.algorithm).simulator_only,
    )


def flower_server(
    grid: Grid, cfg: RunConfig, run_dir: Path, *, show_progress: bool = True, poll_s: float = POLL_S
) -> FlowerServer:
    """The Flower server that runs `cfg` over `grid` into `run_dir` (with the config's
    `tracking` sinks, made first: a missing extra fails before the data is loaded)."""
    sinks = make_sinks(cfg.tracking, run_dir)
    parts = build_parts(cfg, show_progress=show_progress)
    return FlowerServer(grid, parts, deployment(cfg), run_dir, poll_s=poll_s, sinks=sinks)


client_app = make_client_app(build_node)
server_app = ServerApp()


@server_app.main()
def _main(grid: Grid, context: Context) -> None:
    run_dir = Path(str(context.run_config[RUN_DIR_KEY]))
    cfg = validate(load_raw(run_dir / "config.yaml"))
    flower_server(grid, cfg, run_dir).run(resume=bool(context.run_config.get(RESUME_KEY, False)))


def make_server_app(
    cfg: RunConfig, run_dir: Path, *, resume: bool = False, show_progress: bool = True
) -> ServerApp:
    """A server app that runs `cfg` into `run_dir`, whatever the Flower run config says."""
    app = ServerApp()

    @app.main()
    def _run(grid: Grid, context: Context) -> None:
        flower_server(grid, cfg, run_dir, show_progress=show_progress).run(resume=resume)

    return app
