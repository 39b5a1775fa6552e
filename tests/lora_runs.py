"""The short LoRA runs the LoRA tests share: a method built on the conftest's synthetic
federation with its options, run in a folder, its metrics rows (and trace) read back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hetfl.algorithms import ALGORITHMS
from hetfl.core.client.program import Programs
from hetfl.core.training import LocalTraining
from hetfl.engine.round_settings import RoundSettings
from hetfl.sim import Simulation

TRAIN = LocalTraining(lr=0.1, epochs=1, batch_size=16)


def lora_run(
    name: str,
    options: dict[str, Any],
    synthetic: tuple,
    run_dir: Path,
    *,
    rounds: int,
    cpr: int = 4,
    resume: bool = False,
) -> tuple[Simulation, list[dict], list[dict]]:
    """Method `name` with `options` for `rounds` rounds of `cpr` clients (resumed from
    `run_dir` with `resume`): the simulation, its metrics rows and its per-client trace."""
    family, clients, test = synthetic
    strategy, recipe = ALGORITHMS.get(name).build(
        family, options, clients_per_round=cpr, train=TRAIN
    )
    sim = Simulation(
        strategy,
        Programs(strategy.family, recipe, seed=0),
        clients,
        test,
        RoundSettings(rounds=rounds, seed=0),
        run_dir,
    )
    sim.run(resume=resume)

    def read(file: str) -> list[dict]:
        return [json.loads(line) for line in (run_dir / file).read_text().splitlines()]

    return sim, read("metrics.jsonl"), read("clients.jsonl")
