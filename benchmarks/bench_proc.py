"""What a benchmark side costs the machine, measured from outside by the driver (Linux /proc).

- Memory: the peak of the summed PSS (`/proc/<pid>/smaps_rollup`) of the side's whole
  process tree: its process and every descendant (worker pools included), watched every
  100 ms (`PeakTreePss` says how, cheaply). PSS charges a shared page to each process that maps
  it in proportion, so the sum over a tree counts shared memory (torch's libraries, shared
  client data) once, where a sum of RSS would count it once per process.
- Noise: how many cores *other* processes kept busy while the side ran: the machine's busy
  time (`/proc/stat`) minus the CPU time of the side's tree (its reaped descendants'
  included, from `RUSAGE_CHILDREN`) minus the driver's own (its sampling thread), over the
  wall time. CPU that a side's own child processes use is the side's, not noise.

Where /proc is missing, memory reads 0 and the noise None.
"""

from __future__ import annotations

import os
import resource
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


def parse_pss_kib(smaps_rollup: str) -> int:
    """The `Pss:` value (KiB) of a `/proc/<pid>/smaps_rollup` text."""
    for line in smaps_rollup.splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    raise ValueError("no 'Pss:' line in the smaps_rollup text")


def parse_parent(stat: str) -> int:
    """The parent pid from a `/proc/<pid>/stat` line. The command name (field 2) is in
    parentheses and may itself hold spaces and parentheses, so fields are counted from
    the last ')': state, then ppid."""
    return int(stat[stat.rindex(")") + 1 :].split()[1])


def descendants(root: int, parents: Mapping[int, int]) -> set[int]:
    """`root` and every process whose chain of parents (`parents`: pid -> ppid) reaches it."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    tree, todo = {root}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in tree:
                tree.add(child)
                todo.append(child)
    return tree


def others_cores(busy_s: float, tree_cpu_s: float, own_cpu_s: float, wall_s: float) -> float:
    """Cores that processes other than the side's tree and the driver kept busy on average:
    (machine busy - tree CPU - driver CPU) / wall, at least 0."""
    if wall_s <= 0:
        raise ValueError(f"wall time must be positive, got {wall_s}")
    return max(busy_s - tree_cpu_s - own_cpu_s, 0.0) / wall_s


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:  # the process ended between listing and reading, or no /proc
        return None


def read_parents() -> dict[int, int]:
    """pid -> ppid of every process visible now."""
    out: dict[int, int] = {}
    for entry in PROC.glob("[0-9]*"):
        stat = _read(entry / "stat")
        if stat is not None:
            out[int(entry.name)] = parse_parent(stat)
    return out


def tree_members(root: int) -> set[int]:
    """`root`'s process tree now."""
    return descendants(root, read_parents())


def pss_kib(pids: set[int]) -> int:
    """The summed PSS of `pids` (0 for those that cannot be read)."""
    texts = (_read(PROC / str(pid) / "smaps_rollup") for pid in pids)
    return sum(parse_pss_kib(t) for t in texts if t is not None)


def rss_pages(pids: set[int]) -> int:
    """The summed resident pages of `pids` (`/proc/<pid>/statm`, cheap to read)."""
    texts = (_read(PROC / str(pid) / "statm") for pid in pids)
    return sum(int(t.split()[1]) for t in texts if t is not None)


def tree_pss_kib(root: int) -> int:
    """The summed PSS of `root`'s process tree now (0 where nothing can be read)."""
    return pss_kib(tree_members(root))


def machine_busy_s() -> float | None:
    """Seconds all cores spent busy since boot (`/proc/stat`: all but idle and iowait)."""
    text = _read(PROC / "stat")
    if text is None:
        return None
    ticks = [int(v) for v in text.split("\n", 1)[0].split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


class PeakTreePss:
    """The peak PSS of `root`'s tree, watched every `interval_s` in a thread until `stop()`.

    Reading `smaps_rollup` walks a process's page tables (tens of ms for a 1 GiB process on
    the project's machine), too dear every 100 ms on two cores. So every `interval_s` the
    tree's resident size is read from `statm` (well under a ms), and the PSS whenever that
    reaches a new high (by `SLACK`) and at least every `PSS_EVERY_S`: PSS never exceeds RSS,
    and a side's peak is private memory (activations, client data), so the PSS peak falls
    where the RSS peaks. The tree's members are listed anew every `RESCAN_S`."""

    SLACK = 0.01
    PSS_EVERY_S = 2.0
    RESCAN_S = 1.0

    def __init__(self, root: int, interval_s: float = 0.1) -> None:
        self.root, self.interval_s, self.peak_kib = root, interval_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        members: set[int] = set()
        scanned = read_pss = -float("inf")
        top_rss = 0
        while not self._stop.is_set():
            now = time.monotonic()
            if now - scanned >= self.RESCAN_S:
                members, scanned = tree_members(self.root), now
            rss = rss_pages(members)
            if rss > top_rss * (1 + self.SLACK) or now - read_pss >= self.PSS_EVERY_S:
                self.peak_kib = max(self.peak_kib, pss_kib(members))
                top_rss, read_pss = max(top_rss, rss), now
            self._stop.wait(self.interval_s)

    def stop(self) -> int:
        """Stop sampling; the peak in KiB."""
        self._stop.set()
        self._thread.join()
        return self.peak_kib


@dataclass(frozen=True)
class Usage:
    """A side's footprint: peak tree PSS, the CPU its tree used, and the cores others kept
    busy meanwhile (None without /proc/stat)."""

    peak_pss_mib: float
    tree_cpu_s: float
    others_cores: float | None


class CpuWindow:
    """Machine, children's and driver's CPU between construction and `usage(...)`; the
    side's subprocess must be started and reaped inside the window."""

    def __init__(self) -> None:
        self.busy = machine_busy_s()
        self.children = _cpu(resource.RUSAGE_CHILDREN)
        self.own = _cpu(resource.RUSAGE_SELF)
        self.wall = time.perf_counter()

    def usage(self, peak_pss_kib: int) -> Usage:
        busy = machine_busy_s()
        tree = _cpu(resource.RUSAGE_CHILDREN) - self.children
        own = _cpu(resource.RUSAGE_SELF) - self.own
        wall = time.perf_counter() - self.wall
        others = None
        if busy is not None and self.busy is not None:
            others = others_cores(busy - self.busy, tree, own, wall)
        return Usage(peak_pss_kib / 1024, tree, others)


def become_subreaper() -> None:
    """Make this process the one orphaned descendants are reparented to (Linux
    `PR_SET_CHILD_SUBREAPER`); nothing where prctl is missing."""
    import contextlib
    import ctypes

    with contextlib.suppress(AttributeError, OSError):
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def reap_orphans() -> None:
    """Wait for every remaining child (orphaned descendants of a finished side), so that
    their CPU time counts in `RUSAGE_CHILDREN`."""
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def _cpu(who: int) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime
