"""Start-up: `hetfl --help` and `hetfl list` import neither torch, Flower, matplotlib,
rich nor TensorBoard (the first three cost seconds each; rich is only for a run's bar), and
`list`, which reads `hetfl.catalogue`, still shows every entry of the live registries."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import hetfl
import hetfl.attacks  # registers the attacks, as the config does
from hetfl import catalogue
from hetfl.algorithms import ALGORITHMS
from hetfl.attacks.registry import ATTACKS
from hetfl.core.client.wrappers import WRAPPERS
from hetfl.core.server.reducers import REDUCERS
from hetfl.data import DATASETS, PARTITIONERS
from hetfl.data.detection_sources import DETECTION_DATASETS
from hetfl.models import ARCHITECTURES, COMPOSED, MODELS, SPLIT

HEAVY = ("torch", "flwr", "matplotlib", "rich", "tensorboard")

# `python -m hetfl.cli ARGS` in a fresh interpreter, then the heavy modules it imported.
PROBE = f"""
import runpy, sys
sys.argv = ["hetfl", *sys.argv[1:]]
try:
    runpy.run_module("hetfl.cli", run_name="__main__")
except SystemExit as exc:
    assert not exc.code, exc.code
print(sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY!r}))
"""


def _cli_in_fresh_process(*args: str) -> tuple[list[str], list[str]]:
    """The command's output lines and the heavy modules loaded by the time it ended."""
    src = Path(hetfl.__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(src)},
        check=True,
    )
    *lines, heavy = done.stdout.splitlines()
    return lines, ast.literal_eval(heavy)


@pytest.mark.parametrize("command", ["--help", "list"])
def test_help_and_list_import_no_heavy_module(command):
    lines, heavy = _cli_in_fresh_process(command)
    assert lines
    assert heavy == []


def test_list_shows_every_registered_entry():
    lines, _ = _cli_in_fresh_process("list")
    for name in ALGORITHMS:
        assert f"  {name:<12} {ALGORITHMS.get(name).summary}" in lines
    for name in ARCHITECTURES:
        assert f"  {name:<12} {ARCHITECTURES.get(name).summary}" in lines
    for name in COMPOSED:
        assert f"  {name:<12} {COMPOSED.get(name).summary}" in lines
    for name in SPLIT:
        assert f"  {name:<12} {SPLIT.get(name).summary}" in lines
    for title, registry in (
        ("models", MODELS),
        ("datasets", DATASETS),
        ("partitioners", PARTITIONERS),
    ):
        assert f"{title}: {', '.join(registry.names())}" in lines
    assert f"detection datasets: {', '.join(DETECTION_DATASETS.names())}" in lines
    for registry in (REDUCERS, WRAPPERS, ATTACKS):
        for name in registry:
            assert f"  {name:<12} {registry.get(name).summary}" in lines


def test_the_catalogue_equals_the_registries():
    assert {n: ALGORITHMS.get(n).summary for n in ALGORITHMS} == catalogue.ALGORITHMS
    assert {n: ARCHITECTURES.get(n).summary for n in ARCHITECTURES} == catalogue.ARCHITECTURES
    assert {n: COMPOSED.get(n).summary for n in COMPOSED} == catalogue.COMPOSED
    assert {n: SPLIT.get(n).summary for n in SPLIT} == catalogue.SPLIT
    assert sorted(catalogue.MODELS) == MODELS.names()
    assert sorted(catalogue.DATASETS) == DATASETS.names()
    assert sorted(catalogue.DETECTION_DATASETS) == DETECTION_DATASETS.names()
    assert sorted(catalogue.PARTITIONERS) == PARTITIONERS.names()
    assert {n: REDUCERS.get(n).summary for n in REDUCERS} == catalogue.REDUCERS
    assert {n: WRAPPERS.get(n).summary for n in WRAPPERS} == catalogue.WRAPPERS
    assert {n: ATTACKS.get(n).summary for n in ATTACKS} == catalogue.ATTACKS
