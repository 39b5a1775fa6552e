"""`hetfl serve` and `hetfl client`: Flower's own processes, started and ended for the user.

Flower 1.41 runs a federation as long-lived processes: a SuperLink (the server's broker)
and one SuperNode per client; a run is a Flower App submitted with `flwr run`, whose
`ServerApp` the SuperLink starts in a subprocess and whose `ClientApp` each SuperNode starts
per message. That is the supported path of the Message API (the low-level `start_server`
and `start_client` entry points belong to the deprecated strategy API), so HetFL uses it:

- `hetfl serve CONFIG` writes the run folder and a minimal Flower App that names
  `hetfl.flower` (HetFL is installed on every machine, so the app carries no code),
  starts `flower-superlink`, registers the nodes' public keys when node authentication is
  on, submits the app with `flwr run --stream`, waits for the run to end and stops the
  SuperLink. The Flower CLI's home (`FLWR_HOME`) is a folder of the run, so the user's own
  Flower configuration is neither read nor changed.
- `hetfl client` replaces itself with `flower-supernode` (so signals and `kill` reach it
  directly), with the node config that tells the ClientApp its partition and local config.

Runtime installation of app dependencies (`uv sync`) is disabled on both sides: the app has
none. Security is explicit: TLS certificates, or `--insecure` spelled out.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import yaml

from hetfl.config import ConfigError, RunConfig, expand_sweep, load_raw, validate
from hetfl.engine.outputs import NOTHING_AGGREGATED_EXIT, nothing_aggregated

#: Set in the environment of every process `Processes` starts; their descendants inherit it,
#: so they can be found and ended even after Flower detached them into new sessions. Tags
#: accumulate (colon-separated), so an outer `Processes` (a test) still finds the processes
#: an inner one (`hetfl serve`) started.
TAG_ENV = "HETFL_PROCESS_TAG"


@dataclass(frozen=True)
class Security:
    """How a connection is secured: TLS files, or insecure by explicit choice.

    For the server, `certfile`/`keyfile` are the SuperLink's certificate and key and
    `ca_certfile` the CA that signed them; for a client, only `ca_certfile` (the root it
    verifies the SuperLink with).
    """

    insecure: bool = False
    ca_certfile: Path | None = None
    certfile: Path | None = None
    keyfile: Path | None = None

    def check(self, *, server: bool) -> None:
        files = {"--ssl-ca-certfile" if server else "--root-certificates": self.ca_certfile}
        if server:
            files |= {"--ssl-certfile": self.certfile, "--ssl-keyfile": self.keyfile}
        given = {k: v for k, v in files.items() if v is not None}
        if self.insecure:
            if given:
                raise ConfigError(f"--insecure cannot be combined with {', '.join(given)}")
            return
        if len(given) != len(files):
            raise ConfigError(
                "TLS is on by default and needs "
                + ", ".join(files)
                + " (see docs/deploy.md for making certificates); for a trusted local network, "
                "pass --insecure explicitly"
            )
        for flag, path in given.items():
            if not Path(path).is_file():
                raise ConfigError(f"{flag}: file {str(path)!r} does not exist")


class Processes:
    """Processes started together and ended together, descendants included.

    Flower starts its helpers (`flower-superexec`, `flwr-serverapp`, `flwr-clientapp`) in
    sessions of their own, so a process group does not reach them; the tag in their
    inherited environment does. `stop` ends the started processes gently, then kills, by
    id, every process still carrying the tag.
    """

    def __init__(self) -> None:
        self.tag = uuid.uuid4().hex
        self.started: list[subprocess.Popen[bytes]] = []

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment for a child: ours, the tag, and this interpreter's bin folder
        first on PATH (Flower starts its helpers by name)."""
        env = dict(os.environ)
        env.update(extra or {})
        env[TAG_ENV] = ":".join(t for t in (os.environ.get(TAG_ENV), self.tag) if t)
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        return env

    def start(
        self,
        argv: Sequence[str],
        *,
        log: Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        out = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115
        try:
            proc = subprocess.Popen(
                list(argv),
                env=self.env(env),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            if not isinstance(out, int):  # an open log file (DEVNULL is an int)
                out.close()  # the child holds its own descriptor
        self.started.append(proc)
        return proc

    def tagged(self) -> list[int]:
        """Ids of live processes carrying this tag (Linux `/proc`; elsewhere none)."""
        prefix = f"{TAG_ENV}=".encode()
        found = []
        for entry in Path("/proc").glob("[0-9]*"):
            with contextlib.suppress(OSError):
                for var in (entry / "environ").read_bytes().split(b"\0"):
                    if var.startswith(prefix) and self.tag in var[len(prefix) :].decode().split(
                        ":"
                    ):
                        found.append(int(entry.name))
        return sorted(p for p in found if p != os.getpid())

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the started processes, wait up to `grace_s`, then SIGKILL whatever of
        theirs is left; returns once none is alive (or after a bounded wait)."""
        for proc in self.started:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and (
            any(p.poll() is None for p in self.started) or self.tagged()
        ):
            time.sleep(0.2)
        for pid in self.tagged():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for proc in self.started:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        deadline = time.monotonic() + 5
        while self.tagged() and time.monotonic() < deadline:
            time.sleep(0.1)  # killed processes disappear once their parents reap them


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def wait_for_port(host: str, port: int, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Wait until `host:port` accepts connections; fail early if `proc` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            program = cast(list[str], proc.args)[0]  # `Processes.start` passes a list of str
            raise RuntimeError(f"{program} exited with status {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
            return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout_s:g} s")


def _bin(name: str) -> str:
    """A Flower command of this environment (beside this interpreter), else from PATH."""
    local = Path(sys.executable).parent / name
    if local.exists():
        return str(local)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(
            f"{name} not found: install Flower with `pip install 'hetfl[flower]'`"
        )
    return found


# -- the server ----------------------------------------------------------------------------
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
                        "clientapp": "hetfl.flower:client_app",
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

    argv = [_bin("flower-superlink"), "--host", bind or host, "--port", str(port)]
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
                [_bin("flwr"), "supernode", "register", str(key), "hetfl"],
                env=procs.env(env),
                check=True,
            )
        # `--stream` follows the run's log and returns when the run has ended.
        subprocess.run(
            [_bin("flwr"), "run", str(app_dir), "hetfl", "--stream"],
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
    argv = [_bin("flower-supernode"), "--superlink", superlink or cfg.deploy.superlink]
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
def require_flower() -> None:
    if importlib.util.find_spec("flwr") is None:
        raise ConfigError("Flower is not installed: pip install 'hetfl[flower]'")


def serve_config(raw: dict[str, Any], args: argparse.Namespace) -> int:
    """`hetfl serve`: check the config and the method, prepare the run folder, serve it.

    A sweep cannot be served (a federation runs one configuration). Everything that can be
    checked without the network is checked before any process starts: the config, that
    the method needs no server program, that the strategy sets up, that the dataset
    loads (the server tests on it).
    """
    from hetfl.assembly import build_parts
    from hetfl.deploy.server import refuse_server_program
    from hetfl.engine.rounds import setup_strategy

    require_flower()
    if raw.get("sweep"):
        raise ConfigError("a sweep cannot be served: serve one point (sweep=null key=value ...)")
    cfg = validate(next(iter(expand_sweep(raw)))[1])
    run_dir = Path(cfg.output_dir) / cfg.name
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
    refuse_server_program(parts.strategy, cfg.algorithm)
    # With the server's own view of the clients; the run registers the real ones.
    setup_strategy(parts.strategy, [c.info() for c in parts.clients], parts.settings)
    run_dir.mkdir(parents=True, exist_ok=True)
    if not args.resume:
        saved.write_text(cfg.to_yaml())
    return serve(
        cfg, run_dir, security, node_keys=args.node_public_key, resume=args.resume, bind=args.bind
    )


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
