"""One job: the folder a run writes into, checked before anything runs.

A run that cannot write its folder would otherwise fail only when it first writes
(`NotADirectoryError` deep in the run, after the data is loaded), and leave nothing to
resume. The check writes a file where the folder would be created (the folder itself, if it
exists, or its deepest existing parent), which is the only test that holds for every reason
a write can fail (permissions, a read-only disk); it creates nothing, so a command refused
later leaves no folder behind.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from hetfl.config.sections import ConfigError


def writable_folder(folder: Path) -> None:
    """A ConfigError naming `folder` and why, unless it can be created (or exists) and be
    written."""
    try:
        if "\x00" in str(folder):  # the OS cannot take it; `Path.exists` says False
            raise ValueError("the path holds a NUL character")
        existing = next(p for p in [folder, *folder.parents] if p.exists())
        if not existing.is_dir():
            raise NotADirectoryError(f"{existing} is a file, not a folder")
        try:
            with tempfile.TemporaryFile(dir=existing):
                pass
        except OSError as exc:
            raise OSError(f"nothing can be written in {existing} ({exc.strerror})") from None
    except (OSError, ValueError) as exc:
        why = str(exc)
    else:
        return
    raise ConfigError(
        f"output_dir: cannot write the run folder {folder}: {why}; set output_dir (or name) "
        "to a folder you can write"
    )
