"""Dataset archives: downloaded with `hetfl.data.fetch`'s guarantees, verified by MD5, then
extracted so that an archive is never left half-extracted.

An archive is fetched to `<dest>/<file>` (a `.part` file until its MD5 matches), then
extracted into a fresh temporary directory beside it (`<dest>/.<folder>.*.part`); its one
top-level folder is renamed to `<dest>/<folder>` only when every member is out. A loader
therefore sees either the whole folder or none, and the folder's presence is what a
repeated download takes as "done". Anything that fails (a damaged or truncated archive, a
full disk, Ctrl-C) removes the temporary directory, and an archive that turns out to be
truncated or damaged is deleted too. A good archive is kept after extraction, so that its
MD5 can be checked again; delete it to save the space.

Members are checked before they are written: an absolute path or a `..` component (tar or
zip path traversal) and, in a tar, a link or device member are refused, since none of the
official archives holds one; tar members are also extracted through tarfile's `data`
filter. The MD5s are looked up in `ARCHIVE_MD5` at call time (tests inject the checksum of
their fabricated archives there).
"""

from __future__ import annotations

import gzip
import os
import shutil
import tarfile
import tempfile
import zipfile
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path, PurePosixPath

from hetfl.data.fetch import (
    DownloadError,
    ProgressCallback,
    dataset_cache_dir,
    fetch_verified,
    file_url,
    md5_of,
)
from hetfl.data.locate import DATA_ENV, find_directory, search_places

_CIFAR_PAGE = "https://www.cs.toronto.edu/~kriz/cifar.html"
_AVALANCHE = (
    "third-party: no official checksum exists; the value that widely used loaders publish, "
    "e.g. Avalanche's avalanche/benchmarks/datasets/tiny_imagenet/tiny_imagenet.py"
)


@dataclass(frozen=True)
class Archive:
    """One dataset archive: its file, the folder it extracts to, where it is published.

    `dataset` names the dataset (and its cache directory, `<cache>/<dataset>`); `mirror` is
    the upstream base URL; `md5_source` says who publishes `ARCHIVE_MD5[file]`.
    """

    dataset: str
    file: str
    folder: str
    mirror: str
    md5_source: str

    @property
    def command(self) -> str:
        """The command that fetches it, for messages."""
        return f"hetfl data download {self.dataset}"


#: MD5 of each archive file, by file name.
ARCHIVE_MD5: dict[str, str] = {
    "cifar-10-binary.tar.gz": "c32a1d4ab5d03f1284b67883e8d87530",
    "cifar-100-binary.tar.gz": "03b5dce01913d631647c71ecec9e9cb8",
    "tiny-imagenet-200.zip": "90528d7ca1a48142e341f4ef8d21d0de",
    "wikitext-2-v1.zip": "542ccefacc6c27f945fb54453812b3cd",
}

#: The downloadable archives, by dataset name.
ARCHIVES: dict[str, Archive] = {
    "cifar10": Archive(
        "cifar10",
        "cifar-10-binary.tar.gz",
        "cifar-10-batches-bin",
        "https://www.cs.toronto.edu/~kriz/",
        f"published on {_CIFAR_PAGE} (binary version)",
    ),
    "cifar100": Archive(
        "cifar100",
        "cifar-100-binary.tar.gz",
        "cifar-100-binary",
        "https://www.cs.toronto.edu/~kriz/",
        f"published on {_CIFAR_PAGE} (binary version)",
    ),
    "tiny-imagenet": Archive(
        "tiny-imagenet",
        "tiny-imagenet-200.zip",
        "tiny-imagenet-200",
        "http://cs231n.stanford.edu/",
        _AVALANCHE,
    ),
    "wikitext2": Archive(
        "wikitext2",
        "wikitext-2-v1.zip",
        "wikitext-2",
        "https://s3.amazonaws.com/research.metamind.io/wikitext/",
        "third-party: the value torchtext's WikiText2 loader publishes "
        "(torchtext/datasets/wikitext2.py, MD5)",
    ),
}


def find_extracted(path: str | Path | None, archive: Archive, files: tuple[str, ...]) -> Path:
    """The extracted `archive.folder` holding every one of `files`: under `path` (or `path`
    itself) when given, else under `$HETFL_DATA` (directly or in `<dataset>/`), then in
    the download cache; the error names the places, the archive and the command."""
    folder, cache = archive.folder, dataset_cache_dir(archive.dataset)
    places = search_places(
        path, (folder, ""), (folder, f"{archive.dataset}/{folder}"), [cache / folder]
    )
    return find_directory(
        archive.dataset,
        files,
        places,
        [
            f"running: {archive.command} (fetches and verifies {archive.file} and extracts "
            f"it into {cache})",
            f"setting {DATA_ENV}, or data.path, to the directory holding {folder}/ "
            f"(extracted from {archive.file})",
        ],
    )


def _md5_problem(archive: Archive, path: Path) -> str | None:
    """None if `path` has the archive's MD5, else the expected and received values."""
    want = ARCHIVE_MD5[archive.file]
    try:
        got = md5_of(path)
    except OSError as exc:
        return f"cannot read the file ({exc})"
    if got == want:
        return None
    return (
        f"MD5 mismatch.\n  expected: MD5 {want} ({archive.md5_source})\n"
        f"  got:      MD5 {got} ({path.stat().st_size} bytes)"
    )


def download_archive(
    archive: Archive,
    dest: str | Path | None = None,
    mirror: str | None = None,
    *,
    timeout: float = 60,
    progress: ProgressCallback | None = None,
) -> Path:
    """Fetch, verify and extract `archive` into `dest`; return `dest`, the directory that
    holds `archive.folder` (what the dataset's loader takes as `path`).

    `dest` defaults to `<cache>/<dataset>`, `mirror` to upstream's. Nothing is fetched when
    `dest/folder` exists (it is only ever placed whole), and a verified archive already in
    `dest` is extracted without a download.
    """
    return download_archives((archive,), dest, mirror, timeout=timeout, progress=progress)


def download_archives(
    archives: Sequence[Archive],
    dest: str | Path | None = None,
    mirror: str | None = None,
    *,
    timeout: float = 60,
    progress: ProgressCallback | None = None,
) -> Path:
    """`download_archive` for a dataset released as several archives of one top-level
    folder (PASCAL VOC's trainval and test): each is fetched and verified, then all are
    extracted together and their merged folder placed whole. The first names the dataset,
    the folder and the default `dest`."""
    first = archives[0]
    if any(a.folder != first.folder or a.dataset != first.dataset for a in archives):
        raise ValueError("archives merged into one folder must share dataset and folder")
    dest = dataset_cache_dir(first.dataset) if dest is None else Path(dest)
    if (dest / first.folder).is_dir():
        return dest
    paths = [
        fetch_verified(
            file_url(mirror or a.mirror, a.file),
            dest / a.file,
            f"the {a.dataset} archive {a.file}",
            partial(_md5_problem, a),
            timeout=timeout,
            progress=progress,
        )
        for a in archives
    ]
    extract_archive(paths[0], first.folder, dest, *paths[1:])
    return dest


def extract_archive(path: Path, folder: str, dest: Path, *more: Path) -> Path:
    """Extract the archive `path` (and the archives `more`, into the same place: their
    members merge) and place their top-level `folder` at `dest/folder`, whole.

    Raises `DownloadError` naming the archive when it is damaged or truncated (the archive
    is deleted), holds an unsafe member, or has no `folder`; no extracted file is left
    behind then.
    """
    final = dest / folder
    if final.exists():
        raise DownloadError(f"{final} exists; it was not overwritten. Delete or move it first.")
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder}.", suffix=".part", dir=dest))
    except OSError as exc:
        raise DownloadError(f"cannot extract {path.name} into {dest}: {exc}") from exc
    try:
        for each in (path, *more):
            _unpack(each, tmp)
        if not (tmp / folder).is_dir():
            raise DownloadError(
                f"{path} holds no folder {folder}/ (it holds {_listing(tmp)}); it is not "
                "the expected archive. Delete it and run the download again."
            )
        os.rename(tmp / folder, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _listing(directory: Path) -> str:
    names = sorted(p.name for p in directory.iterdir())
    return ", ".join(names) if names else "nothing"


def _unpack(path: Path, into: Path) -> None:
    """Every member of the tar or zip archive `path` into `into`, checked first."""
    try:
        if path.suffix == ".zip":
            _unzip(path, into)
        else:
            _untar(path, into)
    except DownloadError:
        raise
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, zlib.error, gzip.BadGzipFile) as exc:
        path.unlink(missing_ok=True)  # useless as it is; a new download is the fix
        raise DownloadError(
            f"{path} could not be extracted, it is truncated or damaged "
            f"({type(exc).__name__}: {exc}); it was deleted and nothing was extracted. "
            "Run the download again."
        ) from exc
    except OSError as exc:
        raise DownloadError(
            f"cannot extract {path.name} into {into.parent}: {exc}; nothing was extracted."
        ) from exc


def _untar(path: Path, into: Path) -> None:
    with tarfile.open(path, "r:*") as tar:
        for member in tar:
            _check_member(path, member.name)
            if not (member.isfile() or member.isdir()):
                raise DownloadError(
                    f"{path}: member {member.name!r} is a link or a device, which the "
                    "dataset archives never hold; refusing to extract it"
                )
            tar.extract(member, into, filter="data")


def _unzip(path: Path, into: Path) -> None:
    with zipfile.ZipFile(path) as zf:
        members = zf.infolist()
        for info in members:
            _check_member(path, info.filename)
        zf.extractall(into, members)


def _check_member(path: Path, name: str) -> None:
    """Refuse a member that would land outside the extraction directory."""
    parts = PurePosixPath(name.replace("\\", "/")).parts
    if not parts or parts[0] == "/" or ".." in parts or ":" in parts[0]:
        raise DownloadError(
            f"{path}: member {name!r} has an absolute path or a '..' component and would be "
            "written outside the extraction folder (path traversal); refusing to extract "
            "this archive"
        )
