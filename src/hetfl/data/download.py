"""Checked download of Fashion-MNIST into a cache directory, on explicit request only.

`hetfl.data.sources` never touches the network; this module is what `hetfl data download
fashion-mnist` (or `download: true` in a config) calls. Every file is verified before it
is moved into place, because the upstream mirror is plain HTTP and a truncated or altered
file would otherwise only show up later as a confusing decode error, or worse, as wrong data.

A file passes if either of two checks holds:

1. the MD5 of the `.gz` bytes equals the value upstream publishes, or
2. the SHA-256 of the decompressed idx bytes equals the value hard-coded here.

Two checks because there are two legitimate kinds of `.gz` file for the same data. Upstream
publishes MD5s of its own `.gz` files, but other distributors recompress: the Debian package
`dataset-fashion-mnist` ships `.gz` files whose bytes (and so MD5s) differ from upstream's
while the decompressed idx bytes are identical. Hashing the decompressed bytes accepts any
faithful copy, whoever compressed it; the upstream MD5 is tried first because it is the
published reference and needs no decompression. The SHA-256 values were computed from the
Debian package's files (`gzip.decompress`, then `hashlib.sha256`).

A download goes to a `.part` file in the destination directory and is renamed over the final
name only after it passes, so the final names only ever hold verified data; a failed or
corrupted download is deleted and reported as a `DownloadError`.
"""

from __future__ import annotations

import gzip
import hashlib
import http.client
import os
import tempfile
import urllib.error
import urllib.request
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

#: Upstream's mirror (Zalando Research's S3 website for Fashion-MNIST).
DEFAULT_MIRROR = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"

#: The four files, in download order. Kept equal to `sources.FASHION_MNIST_FILES` (a test
#: checks it); defined here too so that `sources` can import this module without a cycle.
FASHION_MNIST_FILES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)

#: MD5 of upstream's `.gz` files, as published in the Fashion-MNIST README.
UPSTREAM_GZ_MD5 = {
    "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
    "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
    "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
    "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310",
}

#: SHA-256 of the decompressed idx bytes, computed from the Debian package's files.
IDX_SHA256 = {
    "train-images-idx3-ubyte.gz": (
        "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888"
    ),
    "train-labels-idx1-ubyte.gz": (
        "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9"
    ),
    "t10k-images-idx3-ubyte.gz": (
        "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b"
    ),
    "t10k-labels-idx1-ubyte.gz": (
        "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34"
    ),
}

#: Environment variable that overrides the cache root (default `~/.cache/hetfl`).
CACHE_ENV = "HETFL_CACHE"

#: Called as `progress(file_name, bytes_received, total_bytes_or_None)` after each chunk.
ProgressCallback = Callable[[str, int, int | None], None]

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


def fashion_mnist_cache_dir() -> Path:
    """Where a downloaded Fashion-MNIST lives by default: `<cache>/fashion-mnist`."""
    return default_cache_dir() / "fashion-mnist"


def file_url(mirror: str, name: str) -> str:
    """The URL of `name` on `mirror`, whether or not the mirror ends in a slash.

    Not `urllib.parse.urljoin`, which drops the mirror's last path segment when the slash
    is missing (`.../data` + `f.gz` gives `.../f.gz`).
    """
    return f"{mirror.rstrip('/')}/{name}"


@dataclass(frozen=True)
class FileCheck:
    """The outcome of checking one file, with the evidence for an error message.

    `method` says which check passed: "gz-md5" (upstream's own `.gz`) or "idx-sha256" (a
    faithful recompression). `idx_sha256` is None when it was not needed or the file could
    not be decompressed; `problem` says why a file failed.
    """

    ok: bool
    method: Literal["gz-md5", "idx-sha256"] | None
    gz_md5: str | None
    idx_sha256: str | None
    problem: str | None = None


def _expected(name: str) -> tuple[str, str]:
    if name not in UPSTREAM_GZ_MD5:
        raise ValueError(
            f"unknown Fashion-MNIST file {name!r}; expected one of {', '.join(FASHION_MNIST_FILES)}"
        )
    return UPSTREAM_GZ_MD5[name], IDX_SHA256[name]


def check_file(path: str | Path, name: str) -> FileCheck:
    """Check `path` against the hashes of the Fashion-MNIST file `name`; never raises on bad data.

    Tries the upstream `.gz` MD5 first (cheap, no decompression), then the SHA-256 of the
    decompressed bytes. A missing, empty, non-gzip or truncated file is a failed check with
    a `problem` saying so, not a gzip traceback.
    """
    want_md5, want_sha = _expected(name)
    path = Path(path)
    md5 = hashlib.md5(usedforsecurity=False)
    try:
        with path.open("rb") as f:
            while chunk := f.read(1 << 20):
                md5.update(chunk)
    except OSError as exc:
        return FileCheck(False, None, None, None, f"cannot read the file ({exc})")
    gz_md5 = md5.hexdigest()
    if gz_md5 == want_md5:
        return FileCheck(True, "gz-md5", gz_md5, None)
    if path.stat().st_size == 0:
        return FileCheck(False, None, gz_md5, None, "the file is empty")
    sha = hashlib.sha256()
    try:
        with gzip.open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                sha.update(chunk)
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        return FileCheck(False, None, gz_md5, None, f"not valid gzip data ({exc})")
    except OSError as exc:
        return FileCheck(False, None, gz_md5, None, f"cannot read the file ({exc})")
    idx_sha = sha.hexdigest()
    if idx_sha == want_sha:
        return FileCheck(True, "idx-sha256", gz_md5, idx_sha)
    return FileCheck(False, None, gz_md5, idx_sha, "hash mismatch")


def verify_file(path: str | Path, name: str) -> bool:
    """True if `path` holds the Fashion-MNIST file `name` (either check passes)."""
    return check_file(path, name).ok


def _mismatch_message(name: str, url: str, check: FileCheck) -> str:
    want_md5, want_sha = _expected(name)
    got_sha = check.idx_sha256 or "n/a (could not decompress)"
    return (
        f"{name} downloaded from {url} is corrupted or not the Fashion-MNIST file: "
        f"{check.problem}.\n"
        f"  expected: MD5 of the .gz {want_md5} (upstream) "
        f"or SHA-256 of the decompressed data {want_sha}\n"
        f"  got:      MD5 {check.gz_md5}, SHA-256 {got_sha}\n"
        "The downloaded file was deleted. Run the download again; if it fails the same way, "
        "the mirror serves a damaged or different file, so use another mirror URL."
    )


def download_file(
    name: str,
    dest: str | Path,
    mirror: str = DEFAULT_MIRROR,
    *,
    timeout: float = 60,
    progress: ProgressCallback | None = None,
) -> Path:
    """Fetch one Fashion-MNIST file into `dest`, verify it, and return its final path.

    Skips the download if `dest/name` already verifies. An existing file that does not
    verify is left alone and reported rather than overwritten: the MNIST family shares
    these file names, so it may be someone's other dataset. The download goes to a unique
    `.part` file that is deleted on any failure (including Ctrl-C) and renamed atomically
    over `dest/name` only after it verifies.
    """
    _expected(name)
    dest = Path(dest)
    final = dest / name
    url = file_url(mirror, name)
    if final.exists():
        existing = check_file(final, name)
        if existing.ok:
            return final
        raise DownloadError(
            f"{final} exists but is not the Fashion-MNIST file ({existing.problem}); "
            f"it was not overwritten. Delete or move it, then run the download again."
        )
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
        received, total = 0, None
        try:
            with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout) as resp:
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
                "Check the mirror URL: it must be the directory that holds the four .gz files."
            ) from exc
        except (OSError, http.client.HTTPException, ValueError) as exc:
            # URLError (refused, DNS, timeouts) is an OSError; ValueError is a malformed URL.
            reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            raise DownloadError(
                f"could not download {name} from {url}: {reason}. "
                f"Check the network connection, the mirror URL and that {dest} is writable, "
                "then run the download again; files already verified are kept."
            ) from exc
        if total is not None and received != total:
            raise DownloadError(
                f"could not download {name} from {url}: the connection ended after "
                f"{received} of {total} bytes; the partial file was deleted. "
                "Run the download again."
            )
        check = check_file(tmp, name)
        if not check.ok:
            raise DownloadError(_mismatch_message(name, url, check))
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the data is public, caches are shared
        os.replace(tmp, final)
        placed = True
    finally:
        if not placed:
            tmp.unlink(missing_ok=True)
    return final


def download_fashion_mnist(
    dest: str | Path | None = None,
    mirror: str = DEFAULT_MIRROR,
    *,
    timeout: float = 60,
    progress: ProgressCallback | None = None,
) -> Path:
    """Download and verify the four Fashion-MNIST files into `dest`; return `dest`.

    `dest` defaults to `fashion_mnist_cache_dir()`. Files already present and verified are
    not fetched again, so an interrupted run can simply be repeated. Stops at the first
    failure with a `DownloadError`; files verified before it are kept. `timeout` is per
    network operation (connect, each read), in seconds.
    """
    dest = fashion_mnist_cache_dir() if dest is None else Path(dest)
    for name in FASHION_MNIST_FILES:
        download_file(name, dest, mirror, timeout=timeout, progress=progress)
    return dest


#: Datasets `hetfl data download NAME` and `data.download: true` can fetch.
DOWNLOADERS: dict[str, Callable[..., Path]] = {"fashion-mnist": download_fashion_mnist}
