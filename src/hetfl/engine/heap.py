"""The C heap: its free memory given back to the operating system between rounds, and the
allocator setting the command line runs under.

A round allocates and frees the training's activations and gradients; what outlives it
(the client store's entries, a few KiB per client) is allocated among them. glibc's malloc
keeps the freed space between such long-lived blocks: the process's resident memory then
grows round after round although what it holds does not. Measured with FedBN + FedPer on
`stage-cnn` over 10,000 clients (`benchmarks/bench_scale.py`): after 6 rounds the
resident set was 1,331 MiB, of which `malloc_trim(0)` handed 259 MiB back, while the store
held 10 MiB. `trim_heap` does that once per round; where the C library is not glibc it
does nothing.

Evaluation scores the test set in batches of 1,000 samples, whose activations (100-200 MB for
a 64-channel CNN at 28x28) are above glibc's mmap threshold: every such block is mapped
afresh and its pages zeroed by the kernel on first touch, batch after batch. Measured on
FLANC's CNN on Fashion-MNIST (2 rounds and an evaluation of every width on 10,000 images,
one thread): 125 s of CPU, 68 s of it system time; with `HEAP_TUNABLES` (large blocks from
the heap, which free() no longer trims) 58 s, 3 s of it system time, with the same
metrics and trace (where a block lives does not enter the arithmetic). glibc reads its
tunables once, at start-up, so the command line re-executes itself with them
(`tuned_environment`); `trim_heap` still hands the free pages back once per round.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Mapping
from functools import cache

#: glibc's tunables for a training process: no mmap for large blocks, and no trimming by
#: free() below 4 GiB of free heap (`trim_heap` trims once per round instead).
HEAP_TUNABLES = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=4294967296"


@cache
def _malloc_trim() -> ctypes._NamedFuncPointer | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc: no malloc_trim
        return None


def trim_heap() -> None:
    """Return the heap's free pages to the OS (glibc `malloc_trim(0)`); else nothing."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def c_library() -> str:
    """The C library's name and version where it is glibc ("glibc 2.36"), else ""."""
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (ValueError, OSError):  # musl, macOS, Windows
        return ""


def tuned_environment(environ: Mapping[str, str], libc: str) -> dict[str, str] | None:
    """The environment to re-execute a training command in, with `HEAP_TUNABLES`; None
    where nothing should change: the C library (`libc`, as `c_library()` names it) is not
    glibc, or `GLIBC_TUNABLES` is already set, which is the user's choice and wins (an
    empty value keeps glibc's defaults)."""
    if not libc.startswith("glibc") or "GLIBC_TUNABLES" in environ:
        return None
    return {**environ, "GLIBC_TUNABLES": HEAP_TUNABLES}
