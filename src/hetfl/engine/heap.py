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

A worker of the process executor is another case: it trains a client after another, then
evaluates, and several workers do so at once. Keeping large blocks in the heap there
(`HEAP_TUNABLES`, inherited from the command line) fragments it: on workload H of
`benchmarks/` (HeteroFL at four widths, two workers) the peak PSS of the run's processes
was 4.18 GiB against 2.47 with `tune_worker_heap`. With glibc's defaults instead, the
threshold above which a block is mapped apart moves with what is freed, and free() trims
the heap's top: every training unit of round 1 then spent 0.3-0.4 s of system time (of
~1.2 s) on page faults, none after (workload A, two workers). `tune_worker_heap` fixes the
threshold at glibc's own upper bound (blocks from 32 MiB, an evaluation batch's
activations, are mapped and unmapped; smaller ones come from the heap) and turns free()'s
trimming off, and the worker trims once per exchange (`hetfl.sim.worker`): round 1's
system time is gone (A: round 1 12.0-14.6 s against 13.2-17.8 s) at the defaults' memory.
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


#: glibc's `mallopt` parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4
#: glibc's default for the number of blocks mapped apart (`HEAP_TUNABLES` sets it to 0).
_MMAP_MAX_DEFAULT = 65536
#: A worker's blocks from this size up are mapped apart: glibc's largest dynamic threshold
#: on 64-bit systems (`DEFAULT_MMAP_THRESHOLD_MAX`), where the defaults end up anyway.
WORKER_MMAP_THRESHOLD = 32 << 20
#: No trimming by free() below this much free heap top (mallopt takes an int).
_NO_TRIM = 2**31 - 1


@cache
def _glibc_function(name: str) -> ctypes._NamedFuncPointer | None:
    library = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(library), name) if library else None
    except (OSError, AttributeError):  # not glibc: no such function
        return None


def _malloc_trim() -> ctypes._NamedFuncPointer | None:
    return _glibc_function("malloc_trim")


def tune_worker_heap(environ: Mapping[str, str]) -> bool:
    """Set this process's heap as a worker's (module docstring), unless the user chose
    glibc's tunables (GLIBC_TUNABLES set to anything but the command line's own
    `HEAP_TUNABLES`) or the C library is not glibc. Whether it was set."""
    mallopt = _glibc_function("mallopt")
    chosen = environ.get("GLIBC_TUNABLES", HEAP_TUNABLES) != HEAP_TUNABLES
    if mallopt is None or chosen:
        return False
    # A threshold set explicitly also ends glibc's moving of it; mallopt's 0 is a refusal.
    settings = (
        (_M_MMAP_MAX, _MMAP_MAX_DEFAULT),  # mapping on again where HEAP_TUNABLES was inherited
        (_M_MMAP_THRESHOLD, WORKER_MMAP_THRESHOLD),
        (_M_TRIM_THRESHOLD, _NO_TRIM),
    )
    return all([mallopt(parameter, value) for parameter, value in settings])


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
