"""Where a run's numbers came from, recorded in its `summary.json` (`"provenance"`).

A figure in a report is only as good as the trace back to what produced it: the code (the
HetFL version and, run from a git checkout, its commit and whether the tree had
uncommitted changes), the numeric libraries and the kernels they ran
(`hetfl.engine.numerics`: float32 results differ across CPUs), the thread count, any pins in
the environment, and the resolved config (its SHA-256, so that two runs with one hash ran
the same settings). `glibc_tunables` is the allocator setting in force (None when unset):
it changes the CPU time of a run, never its numbers.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any

from hetfl.config import RunConfig
from hetfl.engine.numerics import diagnosis, fingerprint


def provenance(cfg: RunConfig) -> dict[str, Any]:
    """The run's provenance record: code, numerics and config hash."""
    return {
        "hetfl": _version(),
        **_commit(),
        "numerics": fingerprint(),
        **diagnosis(),
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
        "config_sha256": hashlib.sha256(cfg.to_yaml().encode()).hexdigest(),
    }


def _version() -> str:
    try:
        return metadata.version("hetfl")
    except metadata.PackageNotFoundError:  # imported from a source tree not installed
        return "unknown"


@cache
def _commit() -> dict[str, Any]:
    """`commit` and `dirty` of the git checkout HetFL is imported from; empty otherwise
    (an installed wheel, or git absent)."""
    source = Path(__file__).resolve().parent
    try:
        head = _git(source, "rev-parse", "HEAD")
        status = _git(source, "status", "--porcelain", "--untracked-files=no", "--", ".")
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"commit": head, "dirty": bool(status)}


def _git(where: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(where), *args],
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    )
    return done.stdout.strip()
