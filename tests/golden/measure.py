"""Measure how far the golden runs move under other numerics, and write the tolerance the
suite compares with where its pins cannot apply: python tests/golden/measure.py

Where the suite's pins cannot give the fixtures' kernels (aarch64, an x86-64 CPU without
AVX2, another BLAS path, another torch or numpy), a golden run cannot match its fixture bit
for bit. This script runs every scenario once per numerics variant below, each pass in a
child process with the variant's environment (the suite's pins otherwise), and records,
per variant, per scenario, per quantity (`harness.QUANTITIES`) and per round, the largest
difference from the fixture. A scenario's tolerance is, per quantity and round, `MULTIPLE`
times the largest difference any variant showed in that round or an earlier one, and at
least `FLOOR`: a difference that training amplifies grows from round to round, so each
round has its own bound and round 1 the smallest; and a scenario that no variant moves
(an MLP on matrix products) keeps a bound far tighter than one that training makes
chaotic (HeteroFL at lr 0.3). A scenario not measured yet gets the largest bound of all.
Written to `tests/golden/tolerance.json`, beside the fixtures; `make golden` reruns it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: golden, test modules

from golden.generate import run_pass
from golden.harness import (
    QUANTITIES,
    SCENARIOS,
    TOLERANCE_PATH,
    fixture_path,
    largest_differences,
    read_fixture,
)
from hetfl.engine.numerics import diagnosis, fingerprint

#: Numerics that differ from the pinned ones on any x86-64 machine with AVX2: ATen's
#: kernels without vector instructions, oneDNN's at SSE4.1, MKL's conditional-numerics
#: path, and all three at once.
VARIANTS: dict[str, dict[str, str]] = {
    "aten-default": {"ATEN_CPU_CAPABILITY": "default"},
    "onednn-sse41": {"DNNL_MAX_CPU_ISA": "SSE41"},
    "mkl-compatible": {"MKL_CBWR": "COMPATIBLE"},
    "all-three": {
        "ATEN_CPU_CAPABILITY": "default",
        "DNNL_MAX_CPU_ISA": "SSE41",
        "MKL_CBWR": "COMPATIBLE",
    },
}
#: How many times the largest measured difference a round may show.
MULTIPLE = 10.0
#: The smallest bound of each quantity (relative; `acc` in test samples): a quantity the
#: variants barely moved may still move by this much on a machine that was not measured.
FLOOR = {"weights": 1e-5, "loss": 1e-5, "acc": 1.0, "other": 1e-9}


def measure(names: list[str], variants: dict[str, dict[str, str]]) -> dict[str, dict]:
    """variant -> scenario -> quantity -> largest difference per round."""
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant, env in variants.items():
            where = Path(tmp) / variant
            where.mkdir()
            run_pass(names, where, "0", {**env, "HETFL_UNPINNED": "1"})
            out[variant] = {
                name: largest_differences(
                    read_fixture(fixture_path(name)), read_fixture(where / f"{name}.json")
                )
                for name in names
            }
    return out


def tolerance(measured: dict[str, dict]) -> dict[str, dict[str, list[float]]]:
    """Per scenario, quantity and round: `MULTIPLE` x the largest difference of any variant
    up to that round, at least `FLOOR`."""
    out: dict[str, dict[str, list[float]]] = {}
    variants = list(measured.values())
    for name in variants[0]:
        out[name] = {}
        for quantity in QUANTITIES:
            per_round = [
                max(sizes) for sizes in zip(*(v[name][quantity] for v in variants), strict=True)
            ]
            so_far = [max(per_round[: i + 1]) for i in range(len(per_round))]
            out[name][quantity] = [max(MULTIPLE * d, FLOOR[quantity]) for d in so_far]
    return out


def unmeasured(bounds: dict[str, dict[str, list[float]]]) -> dict[str, list[float]]:
    """The bound of a scenario not measured yet: the largest of every scenario's."""
    rounds = max(len(b) for q in bounds.values() for b in q.values())
    return {
        q: [max(b[q][min(i, len(b[q]) - 1)] for b in bounds.values()) for i in range(rounds)]
        for q in QUANTITIES
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="these scenarios only")
    args = parser.parse_args(argv)
    names = args.only or [s.name for s in SCENARIOS]
    measured = measure(names, VARIANTS)
    if args.only and TOLERANCE_PATH.exists():  # the other scenarios keep their measurement
        kept = json.loads(TOLERANCE_PATH.read_text())["measured"]
        measured = {v: {**kept.get(v, {}), **by_name} for v, by_name in measured.items()}
    bounds = tolerance(measured)
    record = {
        "about": __doc__.split("\n\n")[1].replace("\n", " "),
        "machine": {"fingerprint": fingerprint(), **diagnosis()},
        "variants": VARIANTS,
        "multiple": MULTIPLE,
        "floor": FLOOR,
        "scenarios": bounds,
        "unmeasured": unmeasured(bounds),
        "measured": measured,
    }
    TOLERANCE_PATH.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    print(json.dumps(record["unmeasured"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
