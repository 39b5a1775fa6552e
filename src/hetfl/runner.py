"""From a validated config to a finished run directory.

This is where the config is taken apart into explicit pieces: the dataset and partition,
the model family, the algorithm's strategy and client hooks (from its own options only),
the client program and the simulator settings. It also writes the parts of the output
contract that belong to the face of the tool: `config.yaml` and the plots.
"""

from __future__ import annotations

import inspect
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hetfl.algorithms import ALGORITHMS
from hetfl.config import RunConfig
from hetfl.core.client import ClientProgram
from hetfl.core.rng import SERVER, numpy_generator
from hetfl.core.types import ClientData
from hetfl.data import DATASETS, PARTITIONERS, Dataset, build_clients, global_test
from hetfl.data.download import DOWNLOADERS
from hetfl.data.views import draw_views
from hetfl.models import make_family
from hetfl.sim import Simulation, SimulationSettings
from hetfl.sim.outputs import Target
from hetfl.sim.progress import Progress


def resolve_device(name: str) -> torch.device:
    """`auto` takes a GPU where one is present, else the CPU."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but no CUDA device is available")
    return torch.device(name)


def load_dataset(cfg: RunConfig) -> Dataset:
    if cfg.data.download:
        dest = DOWNLOADERS[cfg.data.dataset](cfg.data.path, cfg.data.mirror)
        if cfg.data.path is None:
            cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"path": str(dest)})})
    loader = DATASETS.get(cfg.data.dataset)
    params = inspect.signature(loader).parameters
    kwargs: dict[str, Any] = {}
    if "path" in params:
        kwargs["path"] = cfg.data.path
    elif cfg.data.path is not None:
        raise ValueError(f"data.path is set but dataset {cfg.data.dataset!r} takes no path")
    if "seed" in params:
        kwargs["seed"] = cfg.seed
    return loader(**kwargs)


@dataclass
class Federation:
    dataset: Dataset
    clients: list[ClientData]
    test: tuple[torch.Tensor, torch.Tensor]

    @property
    def input_shape(self) -> tuple[int, ...]:
        """The largest client input, which the model family is built for (client views may
        resize a client's images away from the dataset's shape)."""
        return max((tuple(c.x_train.shape[1:]) for c in self.clients), key=math.prod)


def partition(cfg: RunConfig, dataset: Dataset) -> list[np.ndarray]:
    """Each client's training indices, drawn from the run's own partition generator."""
    partitioner = PARTITIONERS.get(cfg.data.partition.kind)
    rng = numpy_generator(cfg.seed, 0, SERVER, "partition")
    return partitioner(dataset.y_train, cfg.data.num_clients, rng, **cfg.data.partition.arguments())


def build_federation(cfg: RunConfig, device: torch.device) -> Federation:
    dataset = load_dataset(cfg)
    parts = partition(cfg, dataset)
    groups = cfg.data.view_groups()
    views = None if groups is None else draw_views(groups, dataset.num_classes, cfg.seed)
    clients = build_clients(dataset, parts, cfg.data.test_per_client, cfg.seed, device, views)
    test = global_test(dataset, device, cfg.eval.test_samples, cfg.seed)
    return Federation(dataset, clients, test)


def build_simulation(
    cfg: RunConfig, run_dir: Path, *, show_progress: bool = True, label: str = ""
) -> Simulation:
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    device = resolve_device(cfg.device)
    fed = build_federation(cfg, device)
    family = make_family(
        cfg.model.name,
        fed.input_shape,
        fed.dataset.num_classes,
        **cfg.model.shape_options(),
    )
    strategy, hooks = ALGORITHMS.get(cfg.algorithm).build(
        family,
        cfg.algorithm_options(),
        clients_per_round=cfg.train.clients_per_round,
        train=cfg.train.local_training(),
    )
    program = ClientProgram(family, hooks, seed=cfg.seed, device=device)
    settings = SimulationSettings(
        rounds=cfg.train.rounds,
        seed=cfg.seed,
        eval_every=cfg.eval.every,
        checkpoint_every=cfg.checkpoint_every,
        local_eval=cfg.eval.local_eval,
        availability=cfg.availability,
        targets=tuple(Target(t.metric, t.value) for t in cfg.targets),
        system=cfg.system.settings(),
    )
    info = {"name": cfg.name, "algorithm": cfg.algorithm, "seed": cfg.seed}
    progress = Progress(cfg.train.rounds, label=label, enabled=show_progress)
    return Simulation(strategy, program, fed.clients, fed.test, settings, run_dir, info, progress)


def start_banner(cfg: RunConfig, sim: Simulation, run_dir: Path) -> str:
    """The one-screen summary printed before a run starts."""
    sizes = [c.n_train for c in sim.clients.values()]
    n_params = sum(v.numel() for v in sim.strategy.global_state.values())
    system = sim.settings.system
    devices = [] if system is None else [f"  devices: {system.describe()}"]
    return "\n".join(
        [
            f"hetfl run {cfg.name}: {cfg.algorithm} on {cfg.data.dataset}, model {cfg.model.name}"
            f" ({n_params:,} numbers in the global state)",
            f"  clients {len(sizes)} (train samples min {min(sizes)}, max {max(sizes)}), "
            f"partition {cfg.data.partition.kind}, {cfg.train.clients_per_round} per round, "
            f"{cfg.train.rounds} rounds, seed {cfg.seed}, device {sim.program.device}",
            *devices,
            f"  output {run_dir}",
        ]
    )


def run_one(
    cfg: RunConfig,
    run_dir: Path,
    *,
    resume: bool = False,
    show_progress: bool = True,
    label: str = "",
) -> dict[str, Any]:
    """Run (or resume) one configured experiment into `run_dir`; returns its summary."""
    from hetfl.report import plot_run  # matplotlib only when a run is actually written

    run_dir.mkdir(parents=True, exist_ok=True)
    if not resume:
        (run_dir / "config.yaml").write_text(cfg.to_yaml())
    sim = build_simulation(cfg, run_dir, show_progress=show_progress, label=label)
    sim.setup()
    if show_progress:
        print(start_banner(cfg, sim, run_dir), file=sys.stderr, flush=True)
    summary = sim.run(resume=resume)
    plot_run(run_dir)
    return summary
