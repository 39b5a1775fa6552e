"""One job: the whole run's record, `RunConfig`, and the checks that cross its sections
(an algorithm's options against its own model of them, a method's model requirement, more
clients per round than clients, executor and clock settings that cannot work together).
"""

from __future__ import annotations

from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from hetfl import catalogue
from hetfl.algorithms import ALGORITHMS
from hetfl.config.attack import AttackSection, check_attack, refuse_attacks_in_wrappers
from hetfl.config.errors import problem_lines
from hetfl.config.sections import (
    DataConfig,
    DeployConfig,
    EvalConfig,
    ModelConfig,
    RayConfig,
    StoreConfig,
    TargetConfig,
    TrainConfig,
    _Strict,
)
from hetfl.core.client.wrappers import WrapperChoice
from hetfl.core.plugins import is_loaded, resolve
from hetfl.data.detection_sources import DETECTION_DATASETS
from hetfl.models import ARCHITECTURES, SPLIT, is_composed, is_scalable, is_split
from hetfl.models.flanc import COMPOSED
from hetfl.systems.profiles import SystemConfig

#: The methods asynchronous aggregation (`system.asynchronous`) runs: their aggregation is
#: an elementwise, coverage-weighted mean of sub-model tensors, which a stale update can
#: enter alone (`hetfl.core.server.asynchronous`).
ASYNC_METHODS = ("heterofl", "fjord", "nefl")
#: Why the nearest others are refused.
ASYNC_REFUSED = {
    "fedfa": "its scalable aggregation rescales each layer by norms taken across the "
    "round's clients, and how staleness should compose with that rescaling is not defined",
}


#: The methods that train a detector (`_task_fits`).
DETECTION_METHODS = ("scalablefl",)


def _detectors() -> list[str]:
    return [n for n in ARCHITECTURES.names() if ARCHITECTURES.get(n).detector]


class RunConfig(_Strict):
    """The whole run: every section, and the keys that belong to no section."""

    name: str = Field(
        "run",
        pattern=r"^[A-Za-z0-9_.\-]+$",
        description="the run's name: its outputs go to `<output_dir>/<name>/`",
    )
    seed: int = Field(
        0,
        ge=0,
        description="every random draw (partition, sampling, initialisation, batch order, "
        "...) comes from a generator derived from (seed, round, client, purpose)",
    )
    plugins: list[str] = Field(
        default_factory=list,
        description="modules imported before validation, whose registered names the config "
        "may use: module names (my_package.my_module) or .py files (./my_file.py, relative "
        "to the config file's folder); see docs/plugins.md",
    )
    algorithm: str = Field("fedavg", description="the method: " + ", ".join(catalogue.ALGORITHMS))
    options: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="each method's options, keyed by its name: `options.<algorithm>.<key>`",
    )
    data: DataConfig = Field(
        DataConfig(), description="the dataset, its partition and each client's splits"
    )
    model: ModelConfig = Field(ModelConfig(), description="the model and its shape options")
    train: TrainConfig = Field(TrainConfig(), description="rounds, sampling and local training")
    eval: EvalConfig = Field(EvalConfig(), description="when and whom to evaluate")
    checkpoint_every: int = Field(
        1,
        ge=1,
        description="write a checkpoint every this many rounds (and after the last); "
        "hetfl resume restarts from the latest",
    )
    availability: float = Field(
        1.0,
        gt=0,
        le=1,
        description="the probability that a client is reachable in a round (one seeded draw "
        "per client and round, times its device profile's availability); simulator only",
    )
    system: SystemConfig = Field(
        SystemConfig(),
        description="device profiles, the simulated clock and deadlines (docs/system.md)",
    )
    store: StoreConfig = Field(
        StoreConfig(), description="the simulator's store of client private state"
    )
    targets: list[TargetConfig] = Field(
        default_factory=list,
        description="levels of a metric whose first reaching summary.json records",
    )
    device: str = Field(
        "auto",
        pattern=r"^(auto|cpu|cuda(:\d+)?|mps)$",
        description="where tensors live: auto takes a GPU where one is present, else the CPU",
    )
    deterministic: bool = Field(
        True,
        description="on CUDA, deterministic PyTorch, cuDNN and cuBLAS kernels, set at run start "
        "(false is faster and not bit-reproducible)",
    )
    threads: int = Field(
        1,
        ge=1,
        description="intra-op threads of every unit of work (a client's training, an "
        "evaluation batch) in every executor; results depend on it, the executor does not",
    )
    executor: Literal["sequential", "processes", "vectorised", "ray", "auto"] | None = Field(
        None,
        description="where clients train and evaluation batches run: sequential (in "
        "process), processes (worker processes on the CPU), vectorised (same-spec clients "
        "trained together with vmap, for a GPU; agrees to about 1e-5, not bit for bit), "
        "ray (Ray actors on one machine or a cluster, see ray:), auto (processes with more "
        "than one core and one client per round); unset: auto from the CLI, sequential "
        "from the library",
    )
    workers: int | None = Field(
        None,
        ge=1,
        description="worker processes of executor processes (default: cores / threads), or "
        "the units of executor ray (default: as many as its cluster has room for)",
    )
    ray: RayConfig | None = Field(
        None,
        description="where executor ray runs: `{address: null | auto | host:port, "
        "cpus_per_unit: 1, gpus_per_unit: 0, connect_timeout_s: 10}` (docs/ray.md); only "
        "with executor: ray",
    )
    output_dir: str = Field("runs", description="the folder that holds the run folders")
    tracking: Literal["none", "tensorboard"] = Field(
        "none",
        description="where the metrics rows go besides metrics.jsonl: tensorboard writes "
        "event files to `<run>/tensorboard` (needs `pip install 'hetfl[tensorboard]'`)",
    )
    wrappers: list[WrapperChoice] = Field(
        default_factory=list,
        description="client-program wrappers (a plugin's faults, say; none is built in), "
        "applied in this order to every client's program: `[{kind: <name>, ...its options}]` "
        "(`hetfl list`); an attack goes under attack:, not here",
    )
    attack: AttackSection | None = Field(
        None,
        description="malicious clients: `{kind: <attack>, fraction: <share of clients>, "
        "...its options}` (`hetfl list`, docs/robustness.md); a seeded share of the clients, "
        "fixed for the run, runs the attack and takes the largest model (`largest: false` "
        "turns that off); simulator only",
    )
    deploy: DeployConfig = Field(
        DeployConfig(), description="Flower settings (docs/deploy.md); the simulator ignores them"
    )
    sweep: dict[str, list[Any]] | None = Field(
        None,
        description="a grid: each dotted key (algorithm, seed, train.lr, ...) with its values; "
        "every combination runs into its own folder, with comparison.md at the top; a key "
        "naming several dotted keys, comma-separated, sets them all to each value",
    )

    @field_validator("plugins")
    @classmethod
    def _loaded(cls, v: list[str]) -> list[str]:
        """Each plugin resolved (a file's path absolute), once, and already imported:
        `hetfl.config.validate` imports them; a config received in a message imports
        nothing."""
        resolved = list(dict.fromkeys(resolve(p) for p in v))
        missing = [p for p in resolved if not is_loaded(p)]
        if missing:
            raise ValueError(
                f"plugin(s) {', '.join(map(repr, missing))} not imported in this process: "
                "hetfl.config.validate imports the plugins a config names, but never those of "
                "a config received from a Flower server; on a Flower node, name them in the "
                "node's own config (hetfl client --config FILE, plugins: [...])"
            )
        return resolved

    @field_validator("wrappers", mode="before")
    @classmethod
    def _no_attack(cls, v: object) -> object:
        return refuse_attacks_in_wrappers(v)

    @field_validator("algorithm")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in ALGORITHMS:
            raise ValueError(ALGORITHMS.unknown_message(v))
        return v

    @model_validator(mode="after")
    def _cross_checks(self) -> RunConfig:
        for algo, opts in self.options.items():
            if algo not in ALGORITHMS:
                raise ValueError(f"options: {ALGORITHMS.unknown_message(algo)}")
            try:
                validated = ALGORITHMS.get(algo).options(**opts)
            except ValidationError as exc:
                model = ALGORITHMS.get(algo).options
                lines = problem_lines(exc, opts, model, ["options", algo])
                raise ValueError("; ".join(lines)) from None
            if algo == self.algorithm:
                self._reducer_fits(algo, validated)
        if self.attack is not None:
            check_attack(self.attack, self.algorithm, self.data.num_clients)
        if ALGORITHMS.get(self.algorithm).needs == "scalable" and not is_scalable(self.model.name):
            raise ValueError(
                f"algorithm {self.algorithm!r} needs a scalable model (model.name one of "
                f"{', '.join(ARCHITECTURES.names())}); {self.model.name!r} is not one"
            )
        if ALGORITHMS.get(self.algorithm).needs == "composed" and not is_composed(self.model.name):
            raise ValueError(
                f"algorithm {self.algorithm!r} composes kernels from shared bases: it needs a "
                f"composed model (model.name one of {', '.join(COMPOSED.names())}); "
                f"{self.model.name!r} is not one"
            )
        if ALGORITHMS.get(self.algorithm).needs == "split" and not is_split(self.model.name):
            raise ValueError(
                f"algorithm {self.algorithm!r} trains a model cut into a client and a server "
                f"side: it needs a split model (model.name one of {', '.join(SPLIT.names())}); "
                f"{self.model.name!r} is not one"
            )
        if ALGORITHMS.get(self.algorithm).needs_costs and self.system.settings() is None:
            raise ValueError(
                f"algorithm {self.algorithm!r} assigns work from the clients' simulated times "
                "and the cost model, so it needs device profiles: add a system: section, "
                "e.g. system: {preset: dtfl} (docs/system.md)"
            )
        if self.eval.local_trained and is_split(self.model.name):
            raise ValueError(
                f"eval.local_trained scores each client's trained model, but {self.model.name!r} "
                "is a split model: a client trains only the first modules, which end before "
                "the classifier; set eval.local_trained to false"
            )
        sizes = {g.size for g in self.data.groups or []}
        if len(sizes) > 1 and not is_scalable(self.model.name):
            raise ValueError(
                f"data.groups give clients different input sizes ({sorted(sizes, key=str)}); "
                f"{self.model.name!r} takes one input size: use a scalable model "
                f"({', '.join(ARCHITECTURES.names())})"
            )
        self._task_fits()
        if self.train.clients_per_round > self.data.num_clients:
            raise ValueError(
                f"train.clients_per_round = {self.train.clients_per_round} is more than "
                f"data.num_clients = {self.data.num_clients}"
            )
        self._plateau_is_observed()
        if self.eval.every_sim_s is not None and not self.system.has_devices:
            raise ValueError(
                f"eval.every_sim_s = {self.eval.every_sim_s} evaluates on the simulated "
                "clock, and this run has none: give it devices (system.profiles, a preset or "
                "system.trace; docs/system.md), or evaluate by rounds (eval.every)"
            )
        self._asynchronous_fits()
        if self.workers is not None and self.executor == "sequential":
            raise ValueError(
                f"workers = {self.workers} is for executor 'processes', 'ray' (or 'auto'), "
                "but executor is 'sequential'"
            )
        if self.ray is not None and self.executor != "ray":
            raise ValueError(
                f"a ray: section is for executor 'ray', but executor is {self.executor!r}: "
                "set executor: ray, or remove the ray: section"
            )
        if self.executor in ("processes", "ray") and self.measured_clock:
            raise ValueError(
                f"executor {self.executor!r} with system.clock 'measured': clients training "
                "at the same time contend for the cores, so their measured times would not "
                "be theirs; use executor 'sequential' or the simulated clock"
            )
        if self.deploy.min_clients is not None and self.deploy.min_clients > self.data.num_clients:
            raise ValueError(
                f"deploy.min_clients = {self.deploy.min_clients} is more than "
                f"data.num_clients = {self.data.num_clients}"
            )
        return self

    def _task_fits(self) -> None:
        """A detector trains on a detection set and only there, by a method that trains
        and scores it (ScalableFL and its variants: plain local training with SSD's loss,
        clients judged by mAP on their local splits)."""
        detector, detection = self.model.detector, self.data.detection
        if detector and not detection:
            raise ValueError(
                f"{self.model.name!r} is an object detector, but {self.data.dataset!r} is a "
                f"classification set: use a detection set ({', '.join(DETECTION_DATASETS.names())})"
            )
        if detection and not detector:
            raise ValueError(
                f"{self.data.dataset!r} is a detection set, but {self.model.name!r} is not a "
                f"detector: use one ({', '.join(_detectors())})"
            )
        if detector and self.algorithm not in DETECTION_METHODS:
            raise ValueError(
                f"algorithm {self.algorithm!r} does not train a detector; "
                f"{', '.join(DETECTION_METHODS)} does (options.scalablefl.variant: "
                "heterofl-max, heterofl-max-1 or individual for its comparisons)"
            )
        if detector and (
            self.attack is not None or self.eval.local_trained or self.eval.stats_pass
        ):
            raise ValueError(
                "a detection run scores mAP on the clients' local test splits only: leave "
                "attack, eval.local_trained and eval.stats_pass out"
            )

    def _reducer_fits(self, algo: str, options: Any) -> None:
        """A reducer kind that bounds the clients it needs (Krum's n > 2f + 2) checked
        against the clients per round."""
        chosen = getattr(options, "reducer", None)
        check = getattr(getattr(chosen, "options", None), "check_clients_per_round", None)
        if check is not None:
            try:
                check(self.train.clients_per_round)
            except ValueError as exc:
                raise ValueError(
                    f"options.{algo}.reducer: {exc} (train.clients_per_round)"
                ) from None

    def _asynchronous_fits(self) -> None:
        """Asynchronous aggregation moves the global model by one method's elementwise
        aggregate of stale updates; only methods for which that is defined may use it."""
        rule = self.system.asynchronous
        if rule is None:
            return
        if self.algorithm not in ASYNC_METHODS:
            why = ASYNC_REFUSED.get(
                self.algorithm,
                "its aggregation is not an elementwise mean of sub-model updates (or needs "
                "every client of a round at once)",
            )
            raise ValueError(
                f"system.asynchronous is not defined for algorithm {self.algorithm!r}: {why}; "
                f"it runs {', '.join(ASYNC_METHODS)}"
            )
        if rule.concurrency > self.data.num_clients:
            raise ValueError(
                f"system.asynchronous.concurrency = {rule.concurrency} is more than "
                f"data.num_clients = {self.data.num_clients}"
            )

    def _plateau_is_observed(self) -> None:
        """The lr's plateau rule counts evaluated rounds as rounds, and watches a metric
        the run computes."""
        plateau = self.train.lr_plateau
        if plateau is None:
            return
        if self.eval.every != 1 or self.eval.every_sim_s is not None:
            cadence = (
                f"eval.every_sim_s = {self.eval.every_sim_s}"
                if self.eval.every_sim_s is not None
                else f"eval.every = {self.eval.every}"
            )
            raise ValueError(
                f"train.lr_plateau counts rounds without improvement, so it needs an "
                f"evaluation every round: set eval.every to 1 (got {cadence}), or "
                "leave train.lr_plateau out"
            )
        if plateau.monitor == "val_acc" and self.data.validation is None:
            raise ValueError(
                "train.lr_plateau monitors val_acc, but there is no validation split: set "
                "data.validation (e.g. 0.1, held out of each client's training data), or "
                "set train.lr_plateau.monitor to global_acc to cut on the test accuracy as "
                "the DTFL paper does (the test set then steers training)"
            )

    @property
    def measured_clock(self) -> bool:
        """Whether clients are clocked by their measured wall time (device profiles on,
        `system.clock: measured`)."""
        system = self.system.settings()
        return system is not None and system.clock == "measured"

    def algorithm_options(self) -> dict[str, Any]:
        return dict(self.options.get(self.algorithm, {}))

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)
