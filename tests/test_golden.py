"""Golden outputs: every registered method's short run, and the engine's paths around it,
reproduce the results pinned in tests/golden/*.json (see tests/golden/harness.py).

Bit for bit where the fixture's numerics fingerprint is this machine's (the suite's pins
make it so on any x86-64 CPU with AVX2 or better and the fixtures' BLAS path); otherwise
every quantity within the tolerance measured beside the fixtures (tests/golden/measure.py).
`make golden` rewrites the fixtures; a change to a result must be a deliberate fixture
update in its own commit.
"""

from __future__ import annotations

import copy
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import SUITE_PINS
from golden.harness import (
    BIT_FOR_BIT,
    BY_NAME,
    SCENARIOS,
    Tolerance,
    compare,
    comparison_mode,
    fixture_files,
    fixture_path,
    mismatch_message,
    read_fixture,
    read_tolerance,
)
from hetfl.algorithms import ALGORITHMS
from hetfl.engine.numerics import NUMERIC_ENV, PINS, fingerprint, pins_for_this_machine

EXTRA = [s.name for s in SCENARIOS if s.name not in ALGORITHMS]


def _check(name: str, golden_runs) -> None:
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
    got = golden_runs[name]
    mode = golden_runs.modes[name] = comparison_mode(expected, got)
    problems = compare(expected, got)
    assert not problems, mismatch_message(name, problems, mode == BIT_FOR_BIT)


@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_every_algorithm_reproduces_its_golden_run(name: str, golden_runs) -> None:
    _check(name, golden_runs)


@pytest.mark.parametrize("name", EXTRA)
def test_every_extra_scenario_reproduces_its_golden_run(name: str, golden_runs) -> None:
    _check(name, golden_runs)


def test_every_fixture_belongs_to_a_scenario() -> None:
    stale = [p.stem for p in fixture_files() if p.stem not in BY_NAME]
    assert not stale, f"fixtures without a scenario: {stale}; `make golden` removes them"


# -- the comparison itself ------------------------------------------------------------------
#: A tolerance for the comparison tests (the measured one is tests/golden/tolerance.json).
TOLERANCE = Tolerance(
    {"weights": [1e-6, 1e-4, 1e-3], "loss": [1e-6, 1e-4, 1e-3], "acc": [1, 2, 3], "other": [0]}
)


def _elsewhere(fixture: dict) -> dict:
    """`fixture` as if run on a machine with other numerics."""
    other = copy.deepcopy(fixture)
    other["fingerprint"] = {**other["fingerprint"], "aten_isa": "AVX512"}
    return other


def test_same_fingerprint_compares_bits_and_another_compares_to_tolerance() -> None:
    fixture = read_fixture(fixture_path("fedavg"))
    name = next(k for k in fixture["rounds"][0]["tensors"] if k.startswith("global/"))
    assert compare(fixture, copy.deepcopy(fixture)) == []
    assert comparison_mode(fixture, _elsewhere(fixture)) == (
        f"aten_isa: {fixture['fingerprint']['aten_isa']!r} in the fixtures, 'AVX512' here"
    )

    flipped = copy.deepcopy(fixture)
    flipped["rounds"][0]["tensors"][name]["sha256"] = "0" * 64
    (problem,) = compare(fixture, flipped)
    assert f"round 1: {name} differs in its bits" in problem
    assert compare(fixture, _elsewhere(flipped), TOLERANCE) == []  # elsewhere, no bits

    nudged = _elsewhere(fixture)
    nudged["rounds"][0]["tensors"][name]["sum"] *= 1 + 1e-8
    nudged["metrics"][0]["global_acc"] += 0.9 * fixture["accuracy_atol"]  # under one sample
    nudged["rounds"][2]["tensors"][name]["norm"] *= 1 + 5e-4  # round 3 allows 1e-3
    nudged["metrics"][2]["loss"] *= 1 + 5e-4
    assert compare(fixture, nudged, TOLERANCE) == []
    nudged["rounds"][0]["tensors"][name]["norm"] *= 1 + 5e-4  # round 1 allows 1e-6
    nudged["metrics"][0]["loss"] *= 1 + 5e-4
    nudged["metrics"][1]["local_acc"] += 2.5 * fixture["accuracy_atol"]  # round 2 allows 2
    loss, acc, norm = compare(fixture, nudged, TOLERANCE)
    assert loss.startswith("metrics round 1/loss: ") and "`loss` in round 1" in loss
    assert acc.startswith("metrics round 2/local_acc: ") and ": 2.5 beyond" in acc
    assert norm.startswith(f"round 1: {name}") and "tolerance 1e-06 of `weights`" in norm


def test_a_mismatch_says_how_to_regenerate() -> None:
    message = mismatch_message("fedavg", ["round 1: global/x differs in its bits"], exact=True)
    assert "bit for bit" in message and "make golden" in message
    assert "its own commit" in message


# -- numerics ---------------------------------------------------------------------------------
def test_the_goldens_ran_with_the_suites_pins(golden_runs) -> None:
    """On x86-64 with AVX2, tests/conftest.py capped ATen and oneDNN at AVX2 before torch
    loaded, and torch dispatches accordingly; the goldens' fingerprint says so."""
    if not pins_for_this_machine():
        pytest.skip(f"no pins apply on {platform.machine()} without AVX2: tolerance mode")
    if os.environ.get("HETFL_UNPINNED"):
        pytest.skip("HETFL_UNPINNED is set: this run leaves the machine's numerics")
    assert PINS.items() <= os.environ.items() and dict(PINS) == SUITE_PINS
    assert torch.backends.cpu.get_cpu_capability() == "AVX2"
    fingerprint = golden_runs["fedavg"]["fingerprint"]
    assert (fingerprint["aten_isa"], fingerprint["onednn_isa"]) == ("AVX2", "AVX2")


#: Variables some machines of this kind set for numpy's OpenBLAS, and an MKL override that
#: does change MKL's path (conditional numerical reproducibility at its compatible level).
_FOR_NUMPY = {"OPENBLAS_CORETYPE": "Haswell", "OPENBLAS_L2_SIZE": "512"}
_MKL_OVERRIDE = {"MKL_CBWR": "COMPATIBLE"}
#: Per BLAS that torch computes with, which of the two keeps the goldens bit for bit.
_KEEPS_BITS = {"mkl": (True, False), "openblas": (False, True)}


@pytest.mark.parametrize("env", [_FOR_NUMPY, _MKL_OVERRIDE], ids=["for-numpy", "mkl-override"])
def test_only_variables_of_torchs_own_blas_take_the_goldens_off_bit_for_bit(
    env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mode decision under a machine's BLAS variables: those of another library than
    torch's (OPENBLAS_* beside torch's MKL) leave the fingerprint, and so the verdict, as
    they were; the library's own (MKL_CBWR) add to its path and send it to the tolerance."""
    for key in NUMERIC_ENV:
        if key.startswith(("MKL_", "OPENBLAS_")):
            monkeypatch.delenv(key, raising=False)
    clean = {"fingerprint": fingerprint()}
    fixture = read_fixture(fixture_path("fedavg"))
    verdict_without = comparison_mode(fixture, clean)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    here = {"fingerprint": fingerprint()}
    library, path = clean["fingerprint"]["blas"], clean["fingerprint"]["blas_path"]
    if library not in _KEEPS_BITS:
        pytest.skip(f"torch's BLAS here is {library!r}: neither MKL nor OpenBLAS")
    keeps = _KEEPS_BITS[library][0 if env is _FOR_NUMPY else 1]
    if keeps:
        assert comparison_mode(clean, here) == BIT_FOR_BIT
        assert comparison_mode(fixture, here) == verdict_without
    else:
        overrides = ",".join(f"{k}={v}" for k, v in env.items())
        assert comparison_mode(clean, here) == (
            f"blas_path: {path!r} in the fixtures, {path + ',' + overrides!r} here"
        )
        assert comparison_mode(fixture, here) != BIT_FOR_BIT


_FALLBACK = """
import json, sys, tempfile
from pathlib import Path
sys.path.insert(0, {tests!r})
from golden.harness import BY_NAME, compare, comparison_mode, fixture_path, read_fixture
from golden.harness import run_scenario
import torch
torch.set_num_threads(1)
out = {{}}
for name in {names!r}:
    with tempfile.TemporaryDirectory() as d:
        got = run_scenario(BY_NAME[name], Path(d))
    want = read_fixture(fixture_path(name))
    out[name] = [comparison_mode(want, got), compare(want, got)]
print(json.dumps(out))
"""


def test_under_other_numerics_the_goldens_hold_to_their_measured_tolerance() -> None:
    """The fallback path, run where it applies: ATen without vector kernels (another
    fingerprint), a convolutional scenario with BatchNorm and an MLP one."""
    names = ["fedbn", "fedprox"]
    env = {**os.environ, "HETFL_UNPINNED": "1", "ATEN_CPU_CAPABILITY": "default"}
    code = _FALLBACK.format(tests=str(Path(__file__).parent), names=names)
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    results = json.loads(done.stdout.splitlines()[-1])
    for name in names:
        mode, problems = results[name]
        assert mode.startswith("aten_isa: 'AVX2' in the fixtures, 'DEFAULT' here"), mode
        assert problems == [], mismatch_message(name, problems, exact=False)


def test_the_measured_tolerance_still_catches_an_lr_off_by_one_in_ten_thousand(tmp_path):
    """What the fallback can still see: FedAvg run with its lr off by 1e-4 relative moves
    round 1's weights by 3.6e-5 relative, beyond its measured tolerance (1e-5), compared as
    if on another machine (1e-5 relative moves them by 3.7e-6: within it)."""
    from golden.harness import Scenario, configured, run_scenario

    fixture = read_fixture(fixture_path("fedavg"))
    changed = Scenario("fedavg", "lr off", configured("fedavg", {"train.lr": 0.3 * (1 + 1e-4)}))
    got = run_scenario(changed, tmp_path)
    got["config"] = fixture["config"]
    got["fingerprint"] = {**got["fingerprint"], "aten_isa": "another"}
    problems = compare(fixture, got, read_tolerance("fedavg"))
    assert any(p.startswith("round 1: global/") and "`weights` in round 1" in p for p in problems)
