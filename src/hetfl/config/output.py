"""One job: the folder a run writes into, checked before anything runs.

A run that cannot write its folder would otherwise fail only when it first writes
(`NotADirectoryError` deep in the run, after the data is loaded), and leave nothing to
resume. The check creates the folder and a file in it, which is the only test that holds
for every reason a write can fail (a path under a file, permissions, a read-only disk).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from hetfl.config.sections import ConfigError


def writable_folder(folder: Path) -> None:
    """Create `folder` (and its parents) and write a file in it; a ConfigError naming
    `folder` and why when that fails."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        raise ConfigError(
            f"output_dir: cannot write the run folder {folder}: {_why(folder, exc)}; set "
            "output_dir (or name) to a folder you can write"
        ) from None


def _why(folder: Path, exc: OSError | ValueError) -> str:
    """The reason in words: the first part of the path that is a file, or the OS's own."""
    for part in [*reversed(folder.parents), folder]:
        if part.exists() and not part.is_dir():
            return f"{part} is a file, not a folder"
    return getattr(exc, "strerror", None) or str(exc)
