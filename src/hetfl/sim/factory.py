"""One job: the executor a run asks for (`executor:` in its config), built on demand.

Apart from `hetfl.sim.executor` (the protocol and the sequential executor) so that the
executors' modules import the protocol and this module imports them, with no circle.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from hetfl.sim.executor import Executor, SequentialExecutor

if TYPE_CHECKING:
    from hetfl.sim.ray_executor import RaySettings

ExecutorName = Literal["sequential", "processes", "vectorised", "ray", "auto"]


def make_executor(
    name: ExecutorName,
    *,
    workers: int | None,
    threads: int,
    device: str,
    deterministic: bool,
    clients_per_round: int,
    measured_clock: bool,
    plugins: Sequence[str] = (),
    ray: RaySettings | None = None,
) -> tuple[Executor, str]:
    """The executor a run asked for, and why it was chosen (for the start banner).

    `auto` takes processes when there is more than one core and more than one client per
    round, on the CPU, with a simulated clock; else sequential. `workers` defaults to the
    usable cores divided by `threads`. `plugins`: the run's, for worker processes to
    import. `ray` says where executor 'ray' runs (default: a local Ray); its `workers`
    are its units, by default as many as the cluster has room for."""
    cores = len(os.sched_getaffinity(0))
    count = workers or max(1, cores // threads)
    auto = name == "auto"
    if auto:
        reasons = []
        if device != "cpu":
            reasons.append(f"device {device}")
        if cores < 2:
            reasons.append("one core")
        if clients_per_round < 2:
            reasons.append("one client per round")
        if measured_clock:
            reasons.append("clock measured (parallel clients would contend)")
        if reasons or count < 2:
            why = ", ".join(reasons) or f"{count} worker"
            return SequentialExecutor(), f"sequential (auto: {why})"
        name = "processes"
    if name in ("processes", "ray") and measured_clock:
        raise ValueError(
            f"executor {name!r} with system.clock 'measured': clients training at "
            "the same time contend for the cores, so their measured times would not be "
            "theirs; use executor 'sequential' or the simulated clock"
        )
    if name == "ray":
        from hetfl.sim.ray_executor import RayExecutor, RaySettings

        on_ray = RayExecutor(
            ray or RaySettings(),
            units=workers,
            threads=threads,
            device=device,
            deterministic=deterministic,
            plugins=plugins,
        )
        return on_ray, on_ray.describe()
    if name == "processes":
        from hetfl.sim.processes import ProcessExecutor

        chosen = ProcessExecutor(
            count, threads, device=device, deterministic=deterministic, plugins=plugins
        )
        return chosen, chosen.describe() + (" (auto)" if auto else "")
    if name == "vectorised":
        from hetfl.sim.vectorised import VectorisedExecutor

        vectorised = VectorisedExecutor()
        return vectorised, vectorised.describe()
    return SequentialExecutor(), "sequential (in process)"
