"""One job: the processes `hetfl serve` and `hetfl client` start, found and ended together
(descendants included), and Flower's commands of this environment (the ports and
addresses they listen on: `hetfl.engine.ports`)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

from hetfl.config import ConfigError

#: Set in the environment of every process `Processes` starts; their descendants inherit it,
#: so they can be found and ended even after Flower detached them into new sessions. Tags
#: accumulate (colon-separated), so an outer `Processes` (a test) still finds the processes
#: an inner one (`hetfl serve`) started.
TAG_ENV = "HETFL_PROCESS_TAG"


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


def flower_bin(name: str) -> str:
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


def require_flower() -> None:
    if importlib.util.find_spec("flwr") is None:
        raise ConfigError("Flower is not installed: pip install 'hetfl[flower]'")
