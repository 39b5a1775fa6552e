"""Score a finished run's final model on the whole global test set.

Runs often evaluate each round on `eval.test_samples`, a seeded subsample of the test set,
to keep rounds cheap; a report quotes the final model on all of it. This rebuilds the run
from its `config.yaml` with `test_samples` unset, loads its last checkpoint (a finished run
always checkpoints its last round; one that does not match the summary is refused),
restores the strategy's and the clients' state as `hetfl resume` does, and scores the
models the strategy evaluates exactly as the engine does each round (`tested_models`,
statistics passes included, under the run's `eval.global_stats_pass`, then the scorings
of `plan_global` through `score_round`).
It writes `full_test.json` beside `summary.json`: the round, the number of test samples,
`global_acc`, `test_loss` and any per-group accuracies.

Usage: python tools/full_test.py RUN_DIR [RUN_DIR ...]   (a sweep folder: every finished point)
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from hetfl.config import load_raw, validate
from hetfl.engine.checkpoint import load_checkpoint
from hetfl.engine.global_eval import plan_global
from hetfl.report import find_runs
from hetfl.runner import build_simulation


def full_test(run_dir: Path) -> dict[str, Any]:
    """The final model of the run in `run_dir` on the whole test set."""
    raw = load_raw(run_dir / "config.yaml")
    raw.setdefault("eval", {})["test_samples"] = None
    cfg = validate(raw)
    summary = json.loads((run_dir / "summary.json").read_text())
    ckpt = load_checkpoint(run_dir / "checkpoints")
    if ckpt["round"] != summary["rounds_completed"]:
        raise SystemExit(
            f"{run_dir}: the last checkpoint is of round {ckpt['round']}, the run completed "
            f"{summary['rounds_completed']}: the checkpoint is not this run's final state"
        )
    with tempfile.TemporaryDirectory() as scratch:
        sim = build_simulation(cfg, Path(scratch), show_progress=False)
        try:
            sim.setup()
            sim.state = dict(ckpt["global"])
            sim.strategy.load_extra_state(ckpt["strategy"])
            sim.restore_extras(ckpt)
            tested = sim.tested_models(ckpt["round"], sim.settings.global_stats_pass)
            plan = plan_global(tested, (sim.x_test, sim.y_test), [], {})
            answers, _ = sim.score_round(ckpt["round"], plan.scorings, [])
            scores = plan.scores(answers)
        finally:
            sim.executor.close()
    return {
        "round": ckpt["round"],
        "test_samples": len(sim.y_test),
        "global_acc": scores.global_acc,
        "test_loss": scores.test_loss,
        "groups": scores.groups,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories or sweep folders")
    args = parser.parse_args(argv)
    for run_dir in [run.path for run in find_runs(args.runs)]:
        result = full_test(run_dir)
        (run_dir / "full_test.json").write_text(json.dumps(result, indent=2) + "\n")
        print(
            f"{run_dir}: round {result['round']}, {result['test_samples']} test samples, "
            f"global_acc {result['global_acc']:.4f}"
        )


if __name__ == "__main__":
    main()
