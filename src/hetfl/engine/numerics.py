"""What decides the bits of a float32 result on a CPU, and the settings that pin them.

PyTorch chooses its kernels at run time from the CPU it finds: ATen's vectorised
element-wise and reduction kernels by the best instruction set the CPU offers (AVX-512,
AVX2, or none), oneDNN's convolutions by the same, and the BLAS library (MKL in PyTorch's
x86-64 wheels) its matrix-product code path by instruction set and, for MKL, by CPU vendor.
Kernels of different vector widths add in different orders, and float32 addition is not
associative, so one run gives bits that differ in the last places from one CPU to another;
training amplifies that round after round (a golden run's test loss moved by 1.8e-2
relative after 3 rounds between an AVX2 and an AVX-512 machine).

Two computations on the same machine with the same settings give the same bits. To
reproduce a run's bits on another x86-64 machine, give it the same `fingerprint()`: the
same torch and numpy, the same thread count, and instruction sets capped to a common level
with the environment variables of `PINS`, set before torch is imported; the BLAS path
must match as well (MKL takes its path by vendor, so an Intel CPU and an AMD CPU may still
differ in matrix products). HetFL never sets these for a user's run: capping the
instruction set costs speed. The test suite sets them (`tests/conftest.py`), so that its
golden fixtures compare bit for bit on any x86-64 CPU with AVX2 or better.

This module imports nothing at import time (the suite calls `pins_for_this_machine` before
torch is imported); the fingerprint imports torch and numpy when called.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

#: Environment variables that cap the instruction sets PyTorch's kernels use, at the level
#: every x86-64 CPU with AVX2 shares: ATen's dispatch and oneDNN's (read when torch loads).
PINS: Mapping[str, str] = {"ATEN_CPU_CAPABILITY": "avx2", "DNNL_MAX_CPU_ISA": "AVX2"}
#: Variables that cap the instruction sets of torch's own kernels (ATen's and oneDNN's).
KERNEL_ENV = ("ATEN_CPU_CAPABILITY", "DNNL_MAX_CPU_ISA", "ONEDNN_MAX_CPU_ISA")
#: Per BLAS library, the variables that change its code path and so its bits: MKL's
#: conditional-numerics and instruction-set overrides; OpenBLAS's kernel choice and the
#: cache size its blocking follows. A variable of another library than the one torch
#: computes with cannot change a bit of torch's results (numpy's own BLAS reads OpenBLAS's).
BLAS_ENV: Mapping[str, tuple[str, ...]] = {
    "mkl": ("MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "MKL_DEBUG_CPU_TYPE"),
    "openblas": ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"),
}
#: Every variable that changes which kernels run in torch or numpy, recorded where set
#: (and passed on to the processes a run starts); only some gate a comparison (`blas()`).
NUMERIC_ENV = KERNEL_ENV + tuple(k for names in BLAS_ENV.values() for k in names)
#: oneDNN's instruction-set levels (its `dnnl_cpu_isa_t` names), lowest first, with the
#: `/proc/cpuinfo` flags each needs.
_ONEDNN_LEVELS: tuple[tuple[str, frozenset[str]], ...] = (
    ("SSE41", frozenset({"sse4_1"})),
    ("AVX", frozenset({"avx"})),
    ("AVX2", frozenset({"avx2"})),
    ("AVX2_VNNI", frozenset({"avx2", "avx_vnni"})),
    ("AVX512_CORE", frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})),
    ("AVX512_CORE_VNNI", frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni"})),
    ("AVX512_CORE_BF16", frozenset({"avx512f", "avx512bw", "avx512_bf16"})),
    ("AVX512_CORE_FP16", frozenset({"avx512f", "avx512bw", "avx512_fp16"})),
    ("AVX512_CORE_AMX", frozenset({"avx512f", "avx512bw", "amx_tile", "amx_bf16"})),
)


@dataclass(frozen=True)
class Cpu:
    """The CPU as the OS describes it: vendor id, model name and feature flags."""

    vendor: str
    model: str
    flags: frozenset[str]


@cache
def cpu() -> Cpu:
    """This machine's CPU, from `/proc/cpuinfo` (Linux); elsewhere what `platform` says."""
    fields: dict[str, str] = {}
    path = Path("/proc/cpuinfo")
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            key, sep, value = line.partition(":")
            if sep and key.strip() not in fields:
                fields[key.strip()] = value.strip()
            if not line.strip() and fields:
                break  # the first processor's block is enough
    return Cpu(
        vendor=fields.get("vendor_id", platform.machine() or "unknown"),
        model=fields.get("model name", platform.processor() or "unknown"),
        flags=frozenset(fields.get("flags", "").split()),
    )


def pins_for_this_machine() -> dict[str, str]:
    """`PINS` on an x86-64 CPU with AVX2 (where they give the fixtures' kernels); none
    elsewhere (aarch64, or an x86-64 CPU without AVX2), where no setting reproduces them."""
    if platform.machine().lower() in ("x86_64", "amd64") and "avx2" in cpu().flags:
        return dict(PINS)
    return {}


def onednn_isa() -> str:
    """The instruction set oneDNN runs at: the CPU's best level, capped by
    `DNNL_MAX_CPU_ISA` (or `ONEDNN_MAX_CPU_ISA`) where set; "none" off x86-64."""
    flags = cpu().flags
    names = [name for name, _ in _ONEDNN_LEVELS]
    best = max((i for i, (_, need) in enumerate(_ONEDNN_LEVELS) if need <= flags), default=-1)
    if best < 0:
        return "none"
    cap = os.environ.get("DNNL_MAX_CPU_ISA") or os.environ.get("ONEDNN_MAX_CPU_ISA")
    if cap and cap.upper() in names:
        best = min(best, names.index(cap.upper()))
    return names[best]


def blas() -> tuple[str, str]:
    """The BLAS library torch was built with, and the path it takes here: for MKL, the CPU
    vendor (MKL picks its kernels by vendor); then whichever of that library's own
    variables (`BLAS_ENV`) are set. Another library's variables are left out: they reach
    numpy's BLAS, never torch's (an `OPENBLAS_CORETYPE` set for numpy beside torch's MKL)."""
    import torch

    shown = torch.__config__.show()
    library = "mkl" if torch.backends.mkl.is_available() else _build_setting(shown, "BLAS_INFO")
    overrides = [f"{k}={os.environ[k]}" for k in BLAS_ENV.get(library, ()) if k in os.environ]
    path = cpu().vendor if library == "mkl" else "default"
    return library, ",".join([path, *overrides])


def _build_setting(shown: str, key: str) -> str:
    for part in shown.replace("\n", ",").split(","):
        name, sep, value = part.strip().partition("=")
        if sep and name == key:
            return value or "none"
    return "unknown"


def fingerprint() -> dict[str, Any]:
    """Every field that gates a bit-for-bit comparison of two float32 runs: equal
    fingerprints, equal bits (for the same code and inputs)."""
    import numpy as np
    import torch

    library, path = blas()
    return {
        "torch": torch.__version__,
        "numpy": np.__version__,
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
        "aten_isa": torch.backends.cpu.get_cpu_capability(),
        "onednn_isa": onednn_isa(),
        "blas": library,
        "blas_path": path,
    }


def diagnosis() -> dict[str, Any]:
    """What helps explain a difference but does not gate a comparison: the CPU model,
    its widest vector extensions, numpy's BLAS (the goldens are torch's numbers, which it
    never computes) and every numeric variable set in the environment, gating or not."""
    flags = cpu().flags
    return {
        "cpu_model": cpu().model,
        "cpu_simd": sorted(f for f in flags if f.startswith(("avx", "amx")) or f == "fma"),
        "numpy_blas": numpy_blas(),
        "numeric_env": {k: os.environ[k] for k in NUMERIC_ENV if k in os.environ},
    }


def numpy_blas() -> str:
    """numpy's BLAS as its build describes it (name and version), "unknown" where the build
    does not say."""
    import numpy as np

    try:
        deps = np.show_config(mode="dicts")["Build Dependencies"]
    except (TypeError, KeyError):  # numpy before 1.26 prints its configuration only
        return "unknown"
    info = deps.get("blas", {})
    return " ".join(str(info[k]) for k in ("name", "version") if info.get(k)) or "unknown"
