"""`hetfl serve` and `hetfl client`: Flower's own processes, started and ended for the user.

Flower 1.41 runs a federation as long-lived processes: a SuperLink (the server's broker)
and one SuperNode per client; a run is a Flower App submitted with `flwr run`, whose
`ServerApp` the SuperLink starts in a subprocess and whose `ClientApp` each SuperNode
starts per message by default. That is the supported path of the Message API (the
low-level `start_server` and `start_client` entry points belong to the deprecated strategy
API), so HetFL uses it:

- `hetfl serve CONFIG` writes the run folder and a minimal Flower App that names
  `hetfl.flower` (HetFL is installed on every machine, so the app carries no code),
  starts `flower-superlink`, registers the nodes' public keys when node authentication is
  on, submits the app with `flwr run --stream`, waits for the run to end and stops the
  SuperLink. The Flower CLI's home (`FLWR_HOME`) is a folder of the run, so the user's own
  Flower configuration is neither read nor changed.
- `hetfl client` runs Flower's SuperNode in its own process (so signals and `kill` reach
  it directly), with the node config that tells the ClientApp its partition and local
  config, in `process` isolation: the ClientApp's tasks are served in that same process,
  which imports HetFL and builds the node's partition once (`hetfl.launch.supernode`),
  rather than by a `flwr-clientapp` process per message.

Runtime installation of app dependencies (`uv sync`) is disabled on both sides: the app has
none. Security is explicit: TLS certificates, or `--insecure` spelled out.
"""

from hetfl.engine.ports import free_port
from hetfl.launch.client import node_config, start_client
from hetfl.launch.plumbing import Processes
from hetfl.launch.security import Security
from hetfl.launch.serve import finish_served_run, serve_config

__all__ = [
    "Processes",
    "Security",
    "finish_served_run",
    "free_port",
    "node_config",
    "serve_config",
    "start_client",
]
