"""Verified download of one file, on explicit request only: the step every dataset download
(`hetfl.data.download` for Fashion-MNIST, `hetfl.data.archives` for CIFAR and Tiny-ImageNet)
goes through.

The guarantees, each checked by tests/test_download.py and the archive tests:

- a download goes to a unique `.part` file beside its final name and is renamed over the
  final name only after it verifies, so a final name only ever holds verified data;
- the `.part` file is deleted on any failure, Ctrl-C included, and a file that does not
  verify is reported with what was expected, what was received, and that it was deleted;
- a file already at the final name is kept when it verifies (no second download) and never
  overwritten when it does not: it may be someone's other data;
- a connection that ends before its Content-Length is an error, not a short file;
- `progress(name, bytes_received, total_or_None)` is called after each chunk.

Why not pooch (issue 17, item 5; pooch 1.9, read from its source): `pooch.retrieve` keeps
the first guarantee (a temporary file in the destination, moved after the hash matches),
but breaks three others. (1) A local file whose hash does not match is "updated", that is,
downloaded over, where ours refuses to touch a foreign file. (2) `known_hash` is a single
hash of the downloaded bytes, so Fashion-MNIST's check "upstream `.gz` MD5 OR SHA-256 of the
decompressed bytes" (which accepts Debian's recompressed copies) cannot be expressed; with
`known_hash=None` and our check afterwards, the unverified file would already sit at its
final name. (3) Its `Untar`/`Unzip` processors extract straight into the final directory
and, on a later call, take that directory's existence as proof of a complete extraction,
so an interrupted extraction is left half-done and then trusted; on Python < 3.12 `Untar`
extracts without tarfile's `data` filter. It would also bring `requests` and
`platformdirs` in, and its progress bar wants a tqdm-like object rather than a callback.
What it would replace here is one urllib loop; so this module stays hand-written.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

#: Environment variable that overrides the cache root (default `~/.cache/hetfl`).
CACHE_ENV = "HETFL_CACHE"

#: Called as `progress(file_name, bytes_received, total_bytes_or_None)` after each chunk.
ProgressCallback = Callable[[str, int, int | None], None]

#: Checks a file: None when it is the expected file, else why not (it may span lines, e.g.
#: "hash mismatch.\n  expected: ...\n  got: ...").
Verifier = Callable[[Path], str | None]

_CHUNK = 1 << 16


class DownloadError(OSError):
    """A download failed or did not verify; the message names the file, URL and fix.

    An `OSError` because it is an I/O failure like the network errors it wraps, so callers
    that already handle `OSError` handle this too.
    """


def default_cache_dir() -> Path:
    """`$HETFL_CACHE` if set, else `~/.cache/hetfl`; read at call time, not import time.

    Read per call so that tests and long-lived processes see a changed environment.
    """
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "hetfl"


def dataset_cache_dir(dataset: str) -> Path:
    """Where `hetfl data download DATASET` puts its files by default: `<cache>/<dataset>`."""
    return default_cache_dir() / dataset


def file_url(mirror: str, name: str) -> str:
    """The URL of `name` on `mirror`, whether or not the mirror ends in a slash.

    Not `urllib.parse.urljoin`, which drops the mirror's last path segment when the slash
    is missing (`.../data` + `f.gz` gives `.../f.gz`).
    """
    return f"{mirror.rstrip('/')}/{name}"


def md5_of(path: Path) -> str:
    """The hex MD5 of a file's bytes, read in 1 MiB chunks (archives are hundreds of MB)."""
    md5 = hashlib.md5(usedforsecurity=False)
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            md5.update(chunk)
    return md5.hexdigest()


def fetch_verified(
    url: str,
    final: Path,
    what: str,
    verify: Verifier,
    *,
    timeout: float = 60,
    progress: ProgressCallback | None = None,
) -> Path:
    """Download `url` to `final` with the guarantees of this module; return `final`.

    `what` names the expected file in messages ("the Fashion-MNIST file"); `verify` says
    whether a file is it. `timeout` is per network operation (connect, each read), in
    seconds.
    """
    name = final.name
    if final.exists():
        problem = verify(final)
        if problem is None:
            return final
        raise DownloadError(
            f"{final} exists but is not {what}: {problem}\n"
            "It was not overwritten. Delete or move it, then run the download again."
        )
    dest = final.parent
    try:
        dest.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f"{name}.", suffix=".part", dir=dest)
    except OSError as exc:
        raise DownloadError(
            f"cannot write {name} to {dest}: {exc}. Choose another destination "
            f"(or set {CACHE_ENV} to a writable directory)."
        ) from exc
    tmp = Path(tmp_name)
    placed = False
    try:
        with os.fdopen(fd, "wb") as out:
            _stream(url, final, out, timeout, progress)
        problem = verify(tmp)
        if problem is not None:
            raise DownloadError(
                f"{name} downloaded from {url} is corrupted or not {what}: {problem}\n"
                "The downloaded file was deleted. Run the download again; if it fails the "
                "same way, the mirror serves a damaged or different file, so use another "
                "mirror URL."
            )
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the data is public, caches are shared
        os.replace(tmp, final)
        placed = True
    finally:
        if not placed:
            tmp.unlink(missing_ok=True)
    return final


def _stream(
    url: str, final: Path, out: BinaryIO, timeout: float, progress: ProgressCallback | None
) -> None:
    """Copy the body at `url` (bound for `final`) into `out`, checked against its
    Content-Length."""
    name = final.name
    received, total = 0, None
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            try:
                total = int(resp.headers.get("Content-Length", ""))
            except ValueError:
                total = None
            while chunk := resp.read(_CHUNK):
                out.write(chunk)
                received += len(chunk)
                if progress is not None:
                    progress(name, received, total)
    except urllib.error.HTTPError as exc:
        exc.close()  # it holds the error response's socket
        raise DownloadError(
            f"could not download {name} from {url}: HTTP {exc.code} {exc.reason}. "
            f"Check the mirror URL: it must be the directory that holds {name}."
        ) from exc
    except (OSError, http.client.HTTPException, ValueError) as exc:
        # URLError (refused, DNS, timeouts) is an OSError; ValueError is a malformed URL.
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        raise DownloadError(
            f"could not download {name} from {url}: {reason}. "
            f"Check the network connection, the mirror URL and that {final.parent} is "
            "writable, then run the download again; files already verified are kept."
        ) from exc
    if total is not None and received != total:
        raise DownloadError(
            f"could not download {name} from {url}: the connection ended after "
            f"{received} of {total} bytes; the partial file was deleted. "
            "Run the download again."
        )
