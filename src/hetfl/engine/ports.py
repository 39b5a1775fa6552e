"""Ports and `host:port` addresses: a free port, an address split, and waiting, bounded,
until an address accepts connections (a server HetFL started, a cluster it joins)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from typing import cast


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def wait_for_port(
    host: str, port: int, proc: subprocess.Popen[bytes] | None, timeout_s: float
) -> None:
    """Wait until `host:port` accepts connections, at most `timeout_s`; fail early if
    `proc` (the server's process, when this one started it) exits."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        if proc is not None and proc.poll() is not None:
            program = cast(list[str], proc.args)[0]  # `Processes.start` passes a list of str
            raise RuntimeError(f"{program} exited with status {proc.returncode}")
        with (
            contextlib.suppress(OSError),
            socket.create_connection((host, port), timeout=min(1.0, left)),
        ):
            return
        time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout_s:g} s")
