"""Where a dataset's files are looked for, and the error that names every place searched.

Every file-backed loader searches the same way: an explicit `path` is the only place looked
at (a user who names a directory and gets data from somewhere else would not notice the
typo); without one, `$HETFL_DATA` first, then the loader's own places, ending with the
download cache (`hetfl.data.fetch.dataset_cache_dir`). When no place holds every file, the
error lists each place with what it lacks, and the fixes.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

#: Environment variable naming a directory of datasets.
DATA_ENV = "HETFL_DATA"


class DatasetNotFoundError(FileNotFoundError):
    """A dataset's files are in none of the places searched; the message names the fixes."""


def search_places(
    path: str | Path | None,
    under_path: Sequence[str],
    under_data: Sequence[str],
    fallback: Sequence[Path],
) -> list[Path]:
    """The directories to search, in order: `path/s` for each `s` in `under_path` when a
    path is given; else `$HETFL_DATA/s` for each `s` in `under_data` (when set), then
    `fallback`. An empty `s` is the directory itself."""
    if path is not None:
        return [Path(path) / s for s in under_path]
    env = os.environ.get(DATA_ENV)
    places = [Path(env) / s for s in under_data] if env else []
    return places + list(fallback)


def find_directory(
    title: str, files: Sequence[str], places: Sequence[Path], fixes: Sequence[str]
) -> Path:
    """The first of `places` that holds every one of `files` (a name ending in `/` is a
    directory, for datasets kept as folders of images).

    Raises `DatasetNotFoundError` listing each place and the files it lacks, then `fixes`
    (one line each, e.g. the `hetfl data download` command).
    """
    for place in places:
        if all(_present(place, name) for name in files):
            return place
    searched = "\n".join(f"  - {_describe(place, files)}" for place in places)
    remedies = "\n".join(f"  - {fix}" for fix in fixes)
    raise DatasetNotFoundError(
        f"{title} not found; it needs {', '.join(files)}.\n"
        f"Searched:\n{searched}\n"
        f"Fix it by one of:\n{remedies}"
    )


def _describe(place: Path, files: Sequence[str]) -> str:
    if not place.is_dir():
        return f"{place} (no such directory)"
    present = [name for name in files if _present(place, name)]
    if not present:
        return f"{place} (none of the files)"
    missing = [name for name in files if name not in present]
    return f"{place} (missing {', '.join(missing)})"


def _present(place: Path, name: str) -> bool:
    return (place / name).is_dir() if name.endswith("/") else (place / name).is_file()
