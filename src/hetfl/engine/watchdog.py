"""A watchdog process: once the process that started it is gone, by any signal, it kills
every process that writes into the folders it was told of.

Why: a process killed by SIGKILL (the out-of-memory killer, a job scheduler) runs no
clean-up of its own, and the processes it started may outlive it: a local Ray's agents,
started by Ray's raylet in sessions of their own and renamed (`ray::DashboardAgent`), ran
on for a minute once the driver was killed. Neither a process group, a parent, a name nor
an environment variable finds them reliably (Ray's renaming overwrites the environment
Linux shows); the files they write do: every process of a Ray session writes its logs
under the session's folder.

How: the watchdog runs in a session of its own (a signal to its starter's group leaves it
to clean up) and reads a pipe from its starter, one folder per line. End of file (the
starter died, or called `close`), or a parent other than its starter, means the end: it
kills, with SIGKILL, every process (its starter and itself excepted) that holds a file under
one of the folders open for writing, again until none is left, then exits. Run as
`python -m hetfl.engine.watchdog` (`Watchdog` starts it); it imports only the standard library.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Collection, Sequence
from pathlib import Path

#: How often the watchdog checks that its starter is still its parent (a child forked
#: without exec holds the pipe too, so end of file alone may come late).
POLL_S = 0.5

#: How long the watchdog goes on killing, at most (a dying raylet may start a worker).
KILL_WITHIN_S = 10.0


class Watchdog:
    """The watchdog of this process: `watch(folder)` names a folder whose writers it ends
    once this process is gone or `close` is called."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "hetfl.engine.watchdog"],
            stdin=subprocess.PIPE,
            start_new_session=True,
        )

    def watch(self, folder: str | Path) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.write(f"{Path(folder).resolve()}\n".encode())
        self._proc.stdin.flush()

    def close(self) -> None:
        """End the folders' writers (this process excepted) and wait for the watchdog."""
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            self._proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=2 * KILL_WITHIN_S)


def writers(folders: Sequence[str | Path], but: Collection[int] = ()) -> list[int]:
    """Ids of the processes (those in `but` excepted) that hold a file under one of
    `folders` open for writing (Linux `/proc`; elsewhere none)."""
    roots = tuple(f"{Path(f).resolve()}{os.sep}" for f in folders)
    found: list[int] = []
    for entry in Path("/proc").glob("[0-9]*") if roots else ():
        if int(entry.name) in but:
            continue
        with contextlib.suppress(OSError):
            for fd in (entry / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd).startswith(roots) and _writes(entry / "fdinfo" / fd.name):
                        found.append(int(entry.name))
                        break
    return sorted(found)


def _writes(fdinfo: Path) -> bool:
    """Whether the descriptor is open for writing (its flags, in octal, say)."""
    for line in fdinfo.read_text().splitlines():
        if line.startswith("flags:"):
            return int(line.split()[1], 8) & os.O_ACCMODE != os.O_RDONLY
    return False


def kill_writers(folders: Sequence[str | Path], but: Collection[int] = ()) -> None:
    """SIGKILL the writers of `folders`, again for any that a dying one started, until none
    is left (or `KILL_WITHIN_S` has passed)."""
    deadline = time.monotonic() + KILL_WITHIN_S
    while (left := writers(folders, but)) and time.monotonic() < deadline:
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)  # killed processes disappear once reaped


def main() -> None:
    """The watchdog: collect folders from standard input until it ends or the starter is
    no longer this process's parent, then end their writers."""
    starter = os.getppid()
    folders: list[str] = []
    pending = b""
    while os.getppid() == starter:
        readable, _, _ = select.select([sys.stdin.buffer], [], [], POLL_S)
        if readable:
            chunk = os.read(sys.stdin.buffer.fileno(), 4096)
            if not chunk:
                break
            *lines, pending = (pending + chunk).split(b"\n")
            folders += [line.decode() for line in lines if line]
    kill_writers(folders, but={starter, os.getpid()})


if __name__ == "__main__":
    main()
