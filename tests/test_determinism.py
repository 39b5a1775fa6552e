"""`deterministic` on CUDA, with the GPU mocked (`torch.cuda.is_available` says yes):
`build_parts` switches on PyTorch's, cuDNN's and cuBLAS's deterministic settings before it
puts anything on the device, and does not for `deterministic: false`, on the CPU, or when
HetFL is imported."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

import pytest
import torch
from torch.backends import cudnn

from hetfl import assembly
from hetfl.config import validate

CUBLAS = "CUBLAS_WORKSPACE_CONFIG"


@pytest.fixture(autouse=True)
def _pytorch_defaults(monkeypatch):
    """Start from PyTorch's defaults and no cuBLAS setting; restore everything afterwards."""
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        cudnn.deterministic,
        cudnn.benchmark,
    )
    monkeypatch.setenv(CUBLAS, "restored afterwards")  # so that delenv restores its absence
    monkeypatch.delenv(CUBLAS)
    torch.use_deterministic_algorithms(False)
    cudnn.deterministic = cudnn.benchmark = False
    yield
    torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
    cudnn.deterministic, cudnn.benchmark = saved[2], saved[3]


def _settings() -> dict[str, Any]:
    return {
        "algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn": cudnn.deterministic,
        "benchmark": cudnn.benchmark,
        CUBLAS: os.environ.get(CUBLAS),
    }


class _Stop(Exception):
    pass


def _settings_when_data_goes_to(device: str, monkeypatch, **keys: Any) -> dict[str, Any]:
    """Run `build_parts` with a GPU said to be present, stopped where it first puts data on
    the device; the settings at that moment."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    seen: dict[str, Any] = {}

    def build_federation(cfg, device):
        seen.update(_settings(), device=device.type)
        raise _Stop

    monkeypatch.setattr(assembly, "build_federation", build_federation)
    with pytest.raises(_Stop):
        assembly.build_parts(validate({"device": device, **keys}), show_progress=False)
    return seen


OFF = {"algorithms": False, "cudnn": False, CUBLAS: None}


def test_a_cuda_run_is_deterministic_before_its_data_reaches_the_gpu(monkeypatch):
    cudnn.benchmark = True  # switched on by someone before the run
    seen = _settings_when_data_goes_to("cuda", monkeypatch)
    assert seen == {"algorithms": True, "cudnn": True, "benchmark": False, CUBLAS: ":4096:8"} | {
        "device": "cuda"
    }


def test_a_cublas_setting_of_the_users_own_is_kept(monkeypatch):
    monkeypatch.setenv(CUBLAS, ":16:8")
    assert _settings_when_data_goes_to("cuda:0", monkeypatch)[CUBLAS] == ":16:8"


def test_deterministic_false_opts_out_even_after_a_deterministic_run(monkeypatch):
    _settings_when_data_goes_to("cuda", monkeypatch)  # an earlier point of the same sweep
    monkeypatch.delenv(CUBLAS)
    cudnn.benchmark = True
    seen = _settings_when_data_goes_to("cuda", monkeypatch, deterministic=False)
    assert seen == OFF | {"benchmark": True, "device": "cuda"}


def test_a_cpu_run_changes_nothing(monkeypatch):
    assert _settings_when_data_goes_to("cpu", monkeypatch) == OFF | {
        "benchmark": False,
        "device": "cpu",
    }


def test_importing_hetfl_changes_nothing(monkeypatch):
    """Import HetFL afresh, with a GPU said to be present: no setting may change."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in [m for m in sys.modules if m == "hetfl" or m.startswith("hetfl.")]:
        monkeypatch.delitem(sys.modules, name)  # restored after the test
    before = _settings()
    for module in ("hetfl.cli", "hetfl.runner", "hetfl.assembly"):
        importlib.import_module(module)
    assert _settings() == before == OFF | {"benchmark": False}
