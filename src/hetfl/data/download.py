"""Checked downloads, on explicit request only: Fashion-MNIST's four files here, the
CIFAR and Tiny-ImageNet archives in `hetfl.data.archives`, and `DOWNLOADERS`, the table
behind `hetfl data download NAME` and `data.download: true` (with `BY_HAND`, what it says
of the datasets it cannot verify: CINIC-10, HAM10000).

a dataset source never touches the network. Every file is verified before it is moved
into place (`hetfl.data.fetch`, which also says why this is not pooch), because upstream
mirrors are plain HTTP and a truncated or altered file would otherwise only show up later
as a confusing decode error, or worse, as wrong data.

A Fashion-MNIST file passes if either of two checks holds:

1. the MD5 of the `.gz` bytes equals the value upstream publishes, or
2. the SHA-256 of the decompressed idx bytes equals the value hard-coded here.

Two checks because there are two legitimate kinds of `.gz` file for the same data. Upstream
publishes MD5s of its own `.gz` files, but other distributors recompress: the Debian package
`dataset-fashion-mnist` ships `.gz` files whose bytes (and so MD5s) differ from upstream's
while the decompressed idx bytes are identical. Hashing the decompressed bytes accepts any
faithful copy, whoever compressed it; the upstream MD5 is tried first because it is the
published reference and needs no decompression. The SHA-256 values were computed from the
Debian package's files (`gzip.decompress`, then `hashlib.sha256`).
"""

from __future__ import annotations

import gzip
import hashlib
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Literal

from hetfl.data import cinic10, ham10000, voc
from hetfl.data.archives import ARCHIVES, download_archive
from hetfl.data.fetch import (
    ProgressCallback,
    dataset_cache_dir,
    fetch_verified,
    file_url,
    md5_of,
)

#: Upstream's mirror (Zalando Research's S3 website for Fashion-MNIST).
FASHION_MNIST_MIRROR = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"

#: The four files, in download order (and the order `sources.load_fashion_mnist` reads).
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
    try:
        gz_md5 = md5_of(path)
    except OSError as exc:
        return FileCheck(False, None, None, None, f"cannot read the file ({exc})")
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


def _fashion_mnist_problem(path: Path, name: str) -> str | None:
    """None if `path` holds the Fashion-MNIST file `name`, else why not, with the hashes
    expected and received (the `Verifier` that `fetch_verified` takes)."""
    check = check_file(path, name)
    if check.ok:
        return None
    want_md5, want_sha = _expected(name)
    got_sha = check.idx_sha256 or "n/a (could not decompress)"
    return (
        f"{check.problem}.\n"
        f"  expected: MD5 of the .gz {want_md5} (upstream) "
        f"or SHA-256 of the decompressed data {want_sha}\n"
        f"  got:      MD5 {check.gz_md5}, SHA-256 {got_sha}"
    )


def download_file(
    name: str,
    dest: str | Path,
    mirror: str = FASHION_MNIST_MIRROR,
    *,
    timeout: float = 60,
    progress: ProgressCallback | None = None,
) -> Path:
    """Fetch one Fashion-MNIST file into `dest`, verify it, and return its final path.

    Skips the download if `dest/name` already verifies. An existing file that does not
    verify is left alone and reported rather than overwritten: the MNIST family shares
    these file names, so it may be someone's other dataset (`hetfl.data.fetch`).
    """
    _expected(name)
    return fetch_verified(
        file_url(mirror, name),
        Path(dest) / name,
        "the Fashion-MNIST file",
        lambda path: _fashion_mnist_problem(path, name),
        timeout=timeout,
        progress=progress,
    )


def download_fashion_mnist(
    dest: str | Path | None = None,
    mirror: str | None = None,
    *,
    timeout: float = 60,
    progress: ProgressCallback | None = None,
) -> Path:
    """Download and verify the four Fashion-MNIST files into `dest`; return `dest`.

    `dest` defaults to `dataset_cache_dir("fashion-mnist")`, `mirror` to upstream's. Files
    already present and verified are not fetched again, so an interrupted run can simply be
    repeated. Stops at the first failure with a `DownloadError`; files verified before it
    are kept. `timeout` is per network operation (connect, each read), in seconds.
    """
    dest = dataset_cache_dir("fashion-mnist") if dest is None else Path(dest)
    mirror = mirror or FASHION_MNIST_MIRROR
    for name in FASHION_MNIST_FILES:
        download_file(name, dest, mirror, timeout=timeout, progress=progress)
    return dest


#: Datasets `hetfl data download NAME` and `data.download: true` can fetch, each called as
#: `(dest=None, mirror=None, *, timeout=60, progress=None)` and returning the directory
#: that its loader reads (a dataset's `path`); None means the cache and upstream's mirror.
DOWNLOADERS: dict[str, Callable[..., Path]] = {
    "fashion-mnist": download_fashion_mnist,
    **{name: partial(download_archive, archive) for name, archive in ARCHIVES.items()},
    "voc2007": voc.download_voc2007,
}

#: Datasets whose files are fetched by hand (no name-addressed mirror or no known checksum):
#: what `hetfl data download NAME` says instead, where they come from.
BY_HAND: dict[str, str] = {"cinic10": cinic10.HOW_TO_GET, "ham10000": ham10000.HOW_TO_GET}
