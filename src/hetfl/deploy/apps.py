"""The Flower apps: `server_app` and `client_app`, as Flower loads them by name.

`hetfl serve` writes a Flower App whose components are `hetfl.deploy.apps:server_app` and
`hetfl.deploy.apps:client_app` (HetFL itself is installed on every machine, so the app
carries no code); its run config names the run directory, whose `config.yaml` drives the
run. `make_server_app` builds a server app for a config held in memory, for Flower's
simulation engine (`flwr.simulation.run_simulation`), which takes app objects.
"""

from __future__ import annotations

from pathlib import Path

from flwr.app import Context
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from hetfl.config import RunConfig, load_raw, validate
from hetfl.deploy import node
from hetfl.deploy.server import FlowerServer

#: Keys of the Flower run config that `hetfl serve` sets.
RUN_DIR_KEY = "hetfl-run-dir"
RESUME_KEY = "hetfl-resume"

client_app = ClientApp()
client_app.query("register")(node.register)
client_app.query("stats")(node.stats)
client_app.train()(node.train)
client_app.evaluate()(node.evaluate)

server_app = ServerApp()


@server_app.main()
def _main(grid: Grid, context: Context) -> None:
    run_dir = Path(str(context.run_config[RUN_DIR_KEY]))
    cfg = validate(load_raw(run_dir / "config.yaml"))
    FlowerServer(grid, cfg, run_dir).run(resume=bool(context.run_config.get(RESUME_KEY, False)))


def make_server_app(
    cfg: RunConfig, run_dir: Path, *, resume: bool = False, show_progress: bool = True
) -> ServerApp:
    """A server app that runs `cfg` into `run_dir`, whatever the Flower run config says."""
    app = ServerApp()

    @app.main()
    def _run(grid: Grid, context: Context) -> None:
        FlowerServer(grid, cfg, run_dir, show_progress=show_progress).run(resume=resume)

    return app
