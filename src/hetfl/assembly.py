"""From a validated config to the parts of a run, for either engine (the face's side).

This is where the config is taken apart into explicit pieces (`hetfl.engine.parts.Parts`):
the dataset and partition, the model family, the algorithm's strategy and local recipe
(from its own options only), the client program and the round settings. The engines never
see the config. The simulator (`hetfl.runner.build_simulation`), the Flower server and
each Flower node (`hetfl.flower`) build from the same `build_parts`, so both engines train
the same clients on the same data.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from hetfl.algorithms import ALGORITHMS
from hetfl.algorithms.parts.method_registry import Options, ReducerOptions
from hetfl.attacks.malicious import OnlyMalicious, declared_attrs, draw_malicious
from hetfl.attacks.poisoning import NamesClasses, check_named_classes
from hetfl.attacks.trigger import AttackSuccess, PlantsTrigger, Trigger
from hetfl.config import ConfigError, RunConfig
from hetfl.core.client.detection_scoring import scored_with
from hetfl.core.client.program import Programs, Wrapper
from hetfl.core.kinds import Chosen
from hetfl.core.probe import Probe
from hetfl.core.rng import SERVER, numpy_generator
from hetfl.core.server.assign import LargestClaims
from hetfl.core.types import ClientData
from hetfl.data import DATASETS, PARTITIONERS, Dataset, build_clients, global_test
from hetfl.data.detection import DetectionSet
from hetfl.data.detection_sources import DETECTION_DATASETS, DetectionNeeds
from hetfl.data.detection_views import DetectionGroup, detection_clients
from hetfl.data.download import DOWNLOADERS
from hetfl.data.views import draw_views
from hetfl.engine.device import make_deterministic, resolve_device
from hetfl.engine.outputs import Target
from hetfl.engine.parts import Parts
from hetfl.engine.progress import Progress
from hetfl.engine.round_settings import RoundSettings
from hetfl.models import make_family
from hetfl.provenance import provenance
from hetfl.systems.costs import MacCounter
from hetfl.systems.split_pricing import SplitPricer


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
    if cfg.data.split is not None:  # validated: only datasets that draw a test set take it
        kwargs["split"] = cfg.data.split
    return loader(**kwargs)


@dataclass
class Federation:
    dataset: Dataset | DetectionSet
    clients: list[ClientData]
    test: tuple[torch.Tensor, torch.Tensor]

    @property
    def input_shape(self) -> tuple[int, ...]:
        """The largest client input, which the model family is built for (client views may
        resize a client's images away from the dataset's shape)."""
        return max((tuple(c.x_train.shape[1:]) for c in self.clients), key=math.prod)


def partition(cfg: RunConfig, dataset: Dataset) -> list[np.ndarray]:
    """Each client's training indices, drawn from the run's own partition generator; the
    dataset's owners (`train_groups`) go to every partitioner, for `natural`. With
    `data.train_samples`, the partitioner deals a uniform subset of that size, drawn first
    from its own generator, so a Dirichlet split keeps its unequal client sizes at a reduced
    scale (a per-client `samples` view would cut every client to one size)."""
    partitioner = PARTITIONERS.get(cfg.data.partition.kind)
    labels, groups, pool = dataset.y_train, dataset.train_groups, None
    wanted, available = cfg.data.train_samples, dataset.y_train.shape[0]
    if wanted is not None:
        if wanted > available:
            raise ConfigError(
                f"data.train_samples = {wanted} but {dataset.name} has {available} training "
                "samples; lower it or leave it out"
            )
        draw = numpy_generator(cfg.seed, 0, SERVER, "train-samples")
        pool = np.sort(draw.choice(available, size=wanted, replace=False))
        labels, groups = labels[pool], None if groups is None else groups[pool]
    rng = numpy_generator(cfg.seed, 0, SERVER, "partition")
    parts = partitioner(
        labels, cfg.data.num_clients, rng, groups=groups, **cfg.data.partition.arguments()
    )
    return parts if pool is None else [pool[p] for p in parts]


def detection_federation(cfg: RunConfig, device: torch.device) -> Federation:
    """A detection set's clients in their declared groups (`data.groups`: side, classes,
    clients; `hetfl.data.detection_views`); the global test pair is the set's own test
    images and targets (ScalableFL, the one method that trains a detector here, scores no
    global model)."""
    groups = tuple(
        DetectionGroup(int(g.size or 0), int(g.classes or 0), g.clients)
        for g in cfg.data.groups or []
    )
    needs = DetectionNeeds(
        groups,
        cfg.data.groups[0].samples if cfg.data.groups else None,
        cfg.data.test_per_client,
        cfg.data.path,
        cfg.seed,
    )
    dataset = DETECTION_DATASETS.get(cfg.data.dataset)(needs)
    clients = detection_clients(dataset, groups, cfg.seed, device)
    test = (
        torch.from_numpy(dataset.x_test).to(device),
        torch.from_numpy(dataset.targets_test).to(device),
    )
    return Federation(dataset, clients, test)


def build_federation(cfg: RunConfig, device: torch.device) -> Federation:
    if cfg.data.detection:
        return detection_federation(cfg, device)
    dataset = load_dataset(cfg)
    parts = partition(cfg, dataset)
    groups = cfg.data.view_groups()
    views = None
    if groups is not None:
        held = [np.unique(dataset.y_train[p]).tolist() for p in parts]
        views = draw_views(groups, dataset.num_classes, cfg.seed, held)
    augment = None if cfg.data.augment is None else cfg.data.augment.augmentation()
    if augment is not None and augment.active and len(dataset.input_shape) != 3:
        raise ValueError(
            f"data.augment transforms images, but dataset {dataset.name!r} holds inputs of "
            f"shape {dataset.input_shape}; leave data.augment out"
        )
    clients = build_clients(
        dataset,
        parts,
        cfg.data.test_per_client,
        cfg.seed,
        device,
        views,
        cfg.data.validation,
        augment,
    )
    test = global_test(dataset, device, cfg.eval.test_samples, cfg.seed)
    return Federation(dataset, clients, test)


def chosen_parts(options: Options, wrappers: Sequence[Chosen[Wrapper]]) -> dict[str, Any]:
    """The kinds a run chose, as summary.json and the start banner name them: `reducer`
    (`{kind, ...options}`) for a method that reduces client tensors, and the client-program
    `wrappers` when there are any."""
    chosen: dict[str, Any] = {}
    if isinstance(options, ReducerOptions):
        chosen["reducer"] = options.reducer.describe()
    if wrappers:
        chosen["wrappers"] = [w.describe() for w in wrappers]
    return chosen


def plateau_part(cfg: RunConfig) -> dict[str, Any]:
    """The lr's plateau rule as summary.json names it (`"lr_plateau"`), when it is on."""
    plateau = cfg.train.lr_plateau
    return {} if plateau is None else {"lr_plateau": plateau.model_dump()}


def attack_part(cfg: RunConfig, malicious: frozenset[int]) -> dict[str, Any]:
    """The attack as summary.json names it (`"attack"`: the section and the malicious
    clients), when there is one."""
    if cfg.attack is None:
        return {}
    return {"attack": {**cfg.attack.describe(), "malicious": sorted(malicious)}}


def checked_trigger(trigger: Trigger, fed: Federation) -> Trigger:
    """`trigger` once it is checked against the data (`Trigger.check`: the target is a
    class, every client's images and the test images fit the patch, the inputs are stored
    pixels), so that a bad setting is refused before the run, not by every malicious
    client's training."""
    shapes = sorted({tuple(c.x_train.shape[1:]) for c in fed.clients} | {fed.dataset.input_shape})
    dataset = fed.dataset
    trigger.check(dataset.num_classes, shapes, dataset.pixels, dataset=dataset.name)
    return trigger


def _check_scored_targets(cfg: RunConfig, pooled: bool) -> None:
    """A target on the global test set for a method that never scores it (no global model:
    its clients are scored on their own splits, `pooled_acc`, unless `eval.pooled_global`
    scores them on the global test set too) would silently never be met."""
    scored = cfg.eval.pooled_global or cfg.eval.require_global_test
    never = [
        t.metric
        for t in cfg.targets
        if pooled and not scored and t.metric in ("global_acc", "test_loss")
    ]
    if never:
        raise ConfigError(
            f"targets: {', '.join(never)} is never reported by {cfg.algorithm}, which has no "
            "global model to score on the global test set; watch pooled_acc (its clients' "
            "own test splits, pooled) instead, or set eval.pooled_global: true (each "
            "client's joined model on the global test set)"
        )


def build_parts(cfg: RunConfig, *, show_progress: bool = True, label: str = "") -> Parts:
    """Build a run's parts from `cfg` (the data is loaded and partitioned; nothing is
    written: the engine that runs them owns the run directory)."""
    torch.set_num_threads(cfg.threads)
    device = resolve_device(cfg.device)
    make_deterministic(device, cfg.deterministic)
    progress = Progress(cfg.train.rounds, label=label, enabled=show_progress)
    with progress.phase("data", about=f"loading and partitioning {cfg.data.dataset}"):
        fed = build_federation(cfg, device)
    family = make_family(
        cfg.model.name,
        fed.input_shape,
        fed.dataset.num_classes,
        **cfg.model.family_options(),
    )
    algorithm = ALGORITHMS.get(cfg.algorithm)
    options = algorithm.options(**cfg.algorithm_options())
    system = cfg.system.settings()
    sampled = cfg.train.clients_per_round
    if system is not None and system.overcommit is not None:  # keep the first K to finish
        sampled = system.committed(sampled, len(fed.clients))
        system = replace(system, keep_first=cfg.train.clients_per_round)
    costs = None
    if algorithm.needs_costs and system is not None:  # DTFL's tier profiles
        costs = SplitPricer(family, fed.input_shape, system.server_rate)
    strategy, recipe = algorithm.build(
        family,
        options,
        clients_per_round=sampled,
        train=cfg.train.local_training(),
        costs=costs,
        macs=MacCounter(family) if algorithm.needs_macs else None,  # FedFA's architecture choice
    )
    _check_scored_targets(cfg, strategy.capabilities.scores_pooled)
    wrappers = [chosen.build() for chosen in cfg.wrappers]
    malicious: frozenset[int] = frozenset()
    probes: tuple[Probe, ...] = ()
    if cfg.attack is not None:
        malicious = draw_malicious([c.cid for c in fed.clients], cfg.attack.fraction, cfg.seed)
        # The malicious clients declare the largest model (`declared_attrs`), which this
        # one wrapper gives them, whatever the method's assignment; unless the claim is off.
        if cfg.attack.largest:
            strategy.assignment = LargestClaims(strategy.assignment, family)
        attack = cfg.attack.chosen.build()
        if isinstance(attack, PlantsTrigger):
            probes = (AttackSuccess(checked_trigger(attack.trigger, fed)),)
        if isinstance(attack, NamesClasses):
            classes = [fed.dataset.num_classes, *(c.num_classes for c in fed.clients)]
            check_named_classes(attack, classes, dataset=fed.dataset.name)
        wrappers.append(OnlyMalicious(attack, malicious))
    recipe = scored_with(recipe, cfg.eval.map_interpolation)
    # The strategy's family: a method may wrap the configured one (LoRA's adapters).
    programs = Programs(strategy.family, recipe, seed=cfg.seed, device=device, wrappers=wrappers)
    settings = RoundSettings(
        rounds=cfg.train.rounds,
        seed=cfg.seed,
        eval_every=cfg.eval.every,
        checkpoint_every=cfg.checkpoint_every,
        local_eval=cfg.eval.local_eval,
        availability=cfg.availability,
        targets=tuple(Target(t.metric, t.value) for t in cfg.targets),
        stats_samples=cfg.eval.stats_samples,
        system=system,
        local_stats_pass=cfg.eval.stats_pass,
        local_trained=cfg.eval.local_trained,
        malicious=malicious,
        probes=probes,
        global_stats_pass=cfg.eval.global_stats_pass,
        require_global_test=cfg.eval.require_global_test,
        pooled_global=cfg.eval.pooled_global,
        eval_every_sim_s=cfg.eval.every_sim_s,
        config=cfg.to_yaml(),
    )
    info = {
        "name": cfg.name,
        "algorithm": cfg.algorithm,
        "seed": cfg.seed,
        **chosen_parts(options, cfg.wrappers),
        **plateau_part(cfg),
        **attack_part(cfg, malicious),
        "provenance": provenance(cfg),
    }
    return Parts(
        strategy,
        programs,
        fed.clients,
        fed.test,
        settings,
        info,
        progress,
        cfg.store.settings(),
        declared_attrs(malicious if cfg.attack is not None and cfg.attack.largest else ()),
    )
