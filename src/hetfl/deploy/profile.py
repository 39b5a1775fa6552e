"""One job: the timing log of deployment messages, written only when the environment
variable `HETFL_DEPLOY_PROFILE` names a file (benchmarks/bench_deploy.py sets it).

Each node appends one JSON line per message it handles (when the message was created on
the server, when this process started, when the handler began, when the node was built and
when the reply was ready); the server appends one per reply it pulled (when it saw it). The
benchmark joins them by message id into a per-message profile. Without the variable nothing
is timed or written.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

ENV = "HETFL_DEPLOY_PROFILE"


def enabled() -> bool:
    return bool(os.environ.get(ENV))


def process_started() -> float:
    """This process's start, in seconds since the epoch (Linux `/proc`, to 10 ms;
    elsewhere now)."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            ticks = int(stat.read().rpartition(")")[2].split()[19])  # stat(5) field 22
            up = float(uptime.read().split()[0])
    except (OSError, ValueError, IndexError):
        return time.time()
    return time.time() - up + ticks / os.sysconf("SC_CLK_TCK")


def record(**fields: Any) -> None:
    """Append one line of `fields` to the profile file (nothing without `ENV`)."""
    path = os.environ.get(ENV)
    if not path:
        return
    with open(path, "a") as out:
        out.write(json.dumps(fields) + "\n")
