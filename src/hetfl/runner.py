"""From a validated config to a finished run directory with the simulator.

The config is taken apart by `hetfl.assembly.build_parts`; this module puts the
parts into a `Simulation` and writes the parts of the output contract that belong to the
face of the tool: `config.yaml` and the plots, and where the run's caches are kept.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hetfl.assembly import build_parts
from hetfl.config import RunConfig
from hetfl.data.fetch import default_cache_dir
from hetfl.engine.checkpoint import has_checkpoint
from hetfl.engine.device import resolve_device
from hetfl.engine.tracking import make_sinks
from hetfl.sim import Simulation, make_executor
from hetfl.sim.asynchronous import AsyncSimulation
from hetfl.sim.factory import ExecutorName
from hetfl.sim.vectorised import VectorisedExecutor, run_fallback

#: The folder under the cache root (`$HETFL_CACHE`) that keeps set-up answers across runs
#: (`hetfl.sim.setup_queries`), so that a sweep's runs score FedFA's candidates once.
SETUP_CACHE = "setup-queries"


def build_simulation(
    cfg: RunConfig,
    run_dir: Path,
    *,
    show_progress: bool = True,
    label: str = "",
    executor: ExecutorName = "sequential",
) -> Simulation:
    """The configured run as a `Simulation`. Its executor is the config's `executor`, or
    `executor` when the config does not say (the library's default is sequential; the CLI
    passes auto). A process executor's workers live until `sim.executor.close()`. The
    config's `tracking` sinks come first: a missing extra fails before anything starts."""
    sinks = make_sinks(cfg.tracking, run_dir)
    # The executor first: a process executor's fork server and workers start (import torch
    # and HetFL) while this process loads and partitions the data; stopped if that fails.
    chosen, described = make_executor(
        cfg.executor or executor,
        workers=cfg.workers,
        threads=cfg.threads,
        device=str(resolve_device(cfg.device)),
        deterministic=cfg.deterministic,
        clients_per_round=cfg.train.clients_per_round,
        measured_clock=cfg.measured_clock,
        plugins=cfg.plugins,
        ray=None if cfg.ray is None else cfg.ray.settings(),
    )
    try:
        p = build_parts(cfg, show_progress=show_progress, label=label)
    except BaseException:
        chosen.close()
        raise
    if isinstance(chosen, VectorisedExecutor):
        described = chosen.describe(run_fallback(p.programs, p.strategy.capabilities.train))
    info = {**p.info, "executor": described}
    system = p.settings.system
    engine = Simulation if system is None or system.asynchronous is None else AsyncSimulation
    return engine(
        p.strategy,
        p.programs,
        p.clients,
        p.test,
        p.settings,
        run_dir,
        info,
        p.progress,
        executor=chosen,
        store=p.store,
        sinks=sinks,
        attrs=p.attrs,
        setup_cache=default_cache_dir() / SETUP_CACHE,
    )


def start_banner(cfg: RunConfig, sim: Simulation, run_dir: Path, command: str = "run") -> str:
    """The one-screen summary printed before a run starts (after `sim.setup()`, which puts
    what the strategy decided into `sim.info`); `command` is the one that started it (run,
    resume)."""
    sizes = [c.n_train for c in sim.clients.values()]
    n_params = sum(v.numel() for v in sim.state.values())
    system = sim.settings.system
    devices = [] if system is None else [f"  devices: {system.describe()}"]
    plateau = cfg.train.lr_plateau
    cuts = [] if plateau is None else [f"  lr plateau: {plateau.settings().describe()}"]
    return "\n".join(
        [
            f"hetfl {command} {cfg.name}: {cfg.algorithm} on {cfg.data.dataset}, "
            f"model {cfg.model.name} ({n_params:,} numbers in the global state)",
            f"  clients {len(sizes)} (train samples min {min(sizes)}, max {max(sizes)}), "
            f"partition {cfg.data.partition.kind}, {cfg.train.clients_per_round} per round, "
            f"{cfg.train.rounds} rounds, seed {cfg.seed}, device {sim.programs.device}",
            f"  executor: {sim.info['executor']}, {cfg.threads} thread(s) per unit",
            *devices,
            *cuts,
            *_chosen(sim.info),
            *_described(sim.info.get("strategy", {})),
            f"  output {run_dir}",
        ]
    )


def _chosen(info: dict[str, Any]) -> list[str]:
    """The run's reducer and client-program wrappers (`hetfl.assembly.chosen_parts`) as
    banner lines: `  reducer: trimmed-mean (trim 0.1)`."""
    lines = []
    if "reducer" in info:
        lines.append(f"  reducer: {_kind_text(info['reducer'])}")
    if info.get("wrappers"):
        lines.append("  wrappers: " + ", ".join(_kind_text(w) for w in info["wrappers"]))
    if "attack" in info:
        attack = dict(info["attack"])
        who = attack.pop("malicious")
        fraction = attack.pop("fraction")
        claim = attack.pop("largest", True)
        model = "take the largest model" if claim else "train what the assignment gives them"
        lines.append(
            f"  attack: {_kind_text(attack)} by {len(who)} malicious client(s) "
            f"({fraction:.0%}): {who}; they {model}"
        )
    return lines


def _kind_text(described: dict[str, Any]) -> str:
    """`{"kind": k, **options}` as `k (option value, ...)`, or `k` without options."""
    options = ", ".join(f"{key} {value}" for key, value in described.items() if key != "kind")
    return described["kind"] + (f" ({options})" if options else "")


def _described(described: dict[str, Any]) -> list[str]:
    """`Strategy.describe()` as banner lines: one per top-level entry, and one per member
    of an entry that is a table (a dict of dicts, such as ScalableFL's groups)."""
    lines = []
    for key, value in described.items():
        if isinstance(value, dict) and all(isinstance(v, dict) for v in value.values()):
            lines += [
                f"  {name}: " + ", ".join(f"{k} {v}" for k, v in row.items())
                for name, row in value.items()
            ]
        else:
            lines.append(f"  {key}: {value}")
    return lines


def run_one(
    cfg: RunConfig,
    run_dir: Path,
    *,
    resume: bool = False,
    show_progress: bool = True,
    label: str = "",
    executor: ExecutorName = "sequential",
    resumed: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run (or resume) one configured experiment into `run_dir`; returns its summary.
    `executor` is used when the config does not name one. Resuming a run that stopped
    before its first checkpoint starts it again from round 1, and says so. `resumed`
    (`hetfl.config.resume.resume_record`) goes into `summary.json` as `resumed`."""
    from hetfl.report import plot_run  # matplotlib only when a run is actually written

    command = "resume" if resume else "run"
    if resume and not has_checkpoint(run_dir / "checkpoints"):
        print(
            f"hetfl resume: {run_dir} has no checkpoint (the run stopped before its first): "
            "starting it again from round 1",
            file=sys.stderr,
            flush=True,
        )
        resume = False
    # Built before the run folder is written: a run that cannot start (a Ray cluster that
    # does not answer, data that cannot load) leaves no folder for `hetfl resume` to take up
    sim = build_simulation(
        cfg, run_dir, show_progress=show_progress, label=label, executor=executor
    )
    if resume and resumed is not None:
        sim.info["resumed"] = resumed
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        if not resume:
            (run_dir / "config.yaml").write_text(cfg.to_yaml())
        sim.setup()
        if show_progress:
            print(start_banner(cfg, sim, run_dir, command), file=sys.stderr, flush=True)
        summary = sim.run(resume=resume)
    finally:
        sim.executor.close()
    plot_run(run_dir)
    return summary
