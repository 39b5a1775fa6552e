"""Golden outputs: every registered method's short run, and the engine's paths around it,
reproduce the results pinned in tests/golden/*.json (see tests/golden/harness.py).

Bit for bit where the fixture's fingerprint (torch, numpy, CPU capability, threads) is this
machine's; otherwise every tensor's sum, norm and max |x| and the metrics to 1e-6, the
accuracies to one test sample. `make golden` rewrites the fixtures; a change to a result
must be a deliberate fixture update in its own commit.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from golden.harness import (
    BY_NAME,
    GOLDEN_DIR,
    SCENARIOS,
    compare,
    fixture_path,
    mismatch_message,
    read_fixture,
    run_scenario,
)
from hetfl.algorithms import ALGORITHMS

EXTRA = [s.name for s in SCENARIOS if s.name not in ALGORITHMS]


def _check(name: str, run_dir: Path) -> None:
    scenario = BY_NAME.get(name)
    if scenario is None:
        pytest.fail(
            f"algorithm {name!r} has no golden scenario: add Scenario({name!r}, ...) to "
            f"SCENARIOS in tests/golden/harness.py, run `python tests/golden/generate.py "
            f"--only {name}` and commit the new fixture tests/golden/{name}.json"
        )
    path = fixture_path(name)
    if not path.exists():
        pytest.fail(
            f"golden scenario {name!r} has no fixture {path}: run `python "
            f"tests/golden/generate.py --only {name}` (or `make golden`) and commit it"
        )
    expected = read_fixture(path)
    got = run_scenario(scenario, run_dir)
    problems = compare(expected, got)
    exact = expected["fingerprint"] == got["fingerprint"]
    assert not problems, mismatch_message(name, problems, exact)


@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_every_algorithm_reproduces_its_golden_run(name: str, tmp_path: Path) -> None:
    _check(name, tmp_path)


@pytest.mark.parametrize("name", EXTRA)
def test_every_extra_scenario_reproduces_its_golden_run(name: str, tmp_path: Path) -> None:
    _check(name, tmp_path)


def test_every_fixture_belongs_to_a_scenario() -> None:
    stale = sorted(p.stem for p in GOLDEN_DIR.glob("*.json") if p.stem not in BY_NAME)
    assert not stale, f"fixtures without a scenario: {stale}; `make golden` removes them"


# -- the comparison itself ------------------------------------------------------------------
def _elsewhere(fixture: dict) -> dict:
    """`fixture` as if run on a machine with other numerics."""
    other = copy.deepcopy(fixture)
    other["fingerprint"] = {**other["fingerprint"], "cpu_capability": "another"}
    return other


def test_same_fingerprint_compares_bits_and_another_compares_to_tolerance() -> None:
    fixture = read_fixture(fixture_path("fedavg"))
    name = next(k for k in fixture["rounds"][0]["tensors"] if k.startswith("global/"))
    assert compare(fixture, copy.deepcopy(fixture)) == []

    flipped = copy.deepcopy(fixture)
    flipped["rounds"][0]["tensors"][name]["sha256"] = "0" * 64
    (problem,) = compare(fixture, flipped)
    assert f"round 1: {name} differs in its bits" in problem
    assert compare(fixture, _elsewhere(flipped)) == []  # elsewhere, bits are not compared

    nudged = _elsewhere(fixture)
    record = nudged["rounds"][0]["tensors"][name]
    record["sum"] *= 1 + 1e-8
    nudged["metrics"][0]["global_acc"] += 0.9 * fixture["accuracy_atol"]  # under one sample
    assert compare(fixture, nudged) == []
    record["norm"] *= 1 + 1e-4
    nudged["metrics"][0]["loss"] *= 1 + 1e-4
    loss, norm = compare(fixture, nudged)
    assert loss.startswith("metrics round 1/loss: ")
    assert norm.startswith(f"round 1: {name} norm: ")


def test_a_mismatch_says_how_to_regenerate() -> None:
    message = mismatch_message("fedavg", ["round 1: global/x differs in its bits"], exact=True)
    assert "bit for bit" in message and "make golden" in message
    assert "its own commit" in message
