"""Write the golden fixtures (`make golden`): python tests/golden/generate.py [--only NAME ...]

Each scenario of `harness.SCENARIOS` is run twice, in two processes with different
PYTHONHASHSEED (one process per pass runs the scenarios one after the other, with one
thread); the fixtures are written only if both passes agree byte for byte, which shows that
nothing in a run depends on hash order. Without --only, every fixture is rewritten and a
fixture of a scenario no longer in the table is removed.

The fixtures are written with the suite's pinned numerics (`hetfl.engine.numerics.PINS`,
set here before torch is imported, as tests/conftest.py sets them), so that the suite
compares them bit for bit on any x86-64 CPU with AVX2 or better. `HETFL_UNPINNED=1`
leaves the machine's own numerics (`measure.py` runs the scenarios so).

A change to a result must be a deliberate fixture update in its own commit.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: golden, test modules

from hetfl.engine.numerics import pins_for_this_machine

if not os.environ.get("HETFL_UNPINNED"):
    os.environ.update(pins_for_this_machine())  # before torch is imported, children inherit

from golden.harness import (
    BY_NAME,
    GOLDEN_DIR,
    SCENARIOS,
    dumps,
    fixture_files,
    fixture_path,
    run_scenario,
)

HASH_SEEDS = ("0", "4242")


def write_pass(names: list[str], out_dir: Path) -> None:
    """One pass, in this process: each scenario's fixture text into `out_dir`."""
    import torch

    torch.set_num_threads(1)
    for name in names:
        with tempfile.TemporaryDirectory() as run_dir:
            fixture = run_scenario(BY_NAME[name], Path(run_dir))
        (out_dir / f"{name}.json").write_text(dumps(fixture) + "\n")
        print(f"  {name}", flush=True)


def run_pass(
    names: list[str], out_dir: Path, hash_seed: str, env: dict[str, str] | None = None
) -> None:
    """One pass in a child process with PYTHONHASHSEED=`hash_seed` (and `env` set)."""
    env = {**os.environ, **(env or {}), "PYTHONHASHSEED": hash_seed, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, __file__, "--pass-into", str(out_dir), "--only", *names]
    print(f"pass with PYTHONHASHSEED={hash_seed}:", flush=True)
    subprocess.run(command, env=env, check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="these scenarios only")
    parser.add_argument("--pass-into", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    names = args.only or [s.name for s in SCENARIOS]
    unknown = sorted(set(names) - set(BY_NAME))
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}; known: {', '.join(BY_NAME)}")
    if args.pass_into is not None:
        write_pass(names, args.pass_into)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        passes = [Path(tmp) / seed for seed in HASH_SEEDS]
        for out_dir, seed in zip(passes, HASH_SEEDS, strict=True):
            out_dir.mkdir()
            run_pass(names, out_dir, seed)
        texts = {name: [(d / f"{name}.json").read_text() for d in passes] for name in names}
        disagree = [name for name, (a, b) in texts.items() if a != b]
        if disagree:
            print(f"the two passes disagree on {disagree}: nothing written", file=sys.stderr)
            return 1
        for name, (text, _) in texts.items():
            fixture_path(name).write_text(text)
    if args.only is None:
        for stale in sorted(set(fixture_files()) - {fixture_path(n) for n in names}):
            stale.unlink()
            print(f"removed {stale.name} (no such scenario)")
    print(f"wrote {len(names)} fixture(s) to {GOLDEN_DIR}; both passes agree byte for byte")
    return 0


if __name__ == "__main__":
    sys.exit(main())
