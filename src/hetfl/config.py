"""Typed, validated run configuration: YAML in, plain frozen models out.

Everything a run needs is checked here, before anything runs: types and ranges by the
pydantic models, names against the registries, and cross-field rules (more clients per
round than clients). Errors become one `ConfigError` whose message names each field, the
value received and what is allowed; an unknown key suggests the closest known one.
Algorithms receive only their own options (explicit constructor arguments), never this
config.
"""

from __future__ import annotations

import copy
import difflib
import itertools
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from hetfl.algorithms import ALGORITHMS
from hetfl.core.augment import Augmentation, ResizedCrop
from hetfl.core.schedule import LrSchedule
from hetfl.core.store import StoreSettings
from hetfl.core.training import LocalTraining, default_of
from hetfl.core.wrappers import WrapperChoice
from hetfl.data import DATASETS, LEAF_DATASETS, PARTITIONERS
from hetfl.data.download import DOWNLOADERS
from hetfl.data.views import ViewGroup
from hetfl.models import ARCHITECTURES, is_composed, is_scalable
from hetfl.models.factory import (
    COMPOSED_OPTIONS,
    SHAPE_OPTIONS,
    misplaced_options,
    model_names,
    unknown_model_message,
)
from hetfl.models.flanc import COMPOSED
from hetfl.systems.profiles import SystemConfig


class ConfigError(ValueError):
    """A configuration that cannot run; the message is meant for the user, as is."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PartitionConfig(_Strict):
    kind: str = Field("iid", description="partitioner name (hetfl list)")
    alpha: float | None = Field(None, gt=0, description="Dirichlet concentration")
    min_size: int = Field(10, ge=1)
    max_retries: int = Field(100, ge=1)
    k: int | None = Field(None, ge=1, description="classes per client (kind: classes)")

    @field_validator("kind")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in PARTITIONERS:
            raise ValueError(PARTITIONERS.unknown_message(v))
        return v

    @model_validator(mode="after")
    def _needs(self) -> PartitionConfig:
        if self.kind == "dirichlet" and self.alpha is None:
            raise ValueError("kind 'dirichlet' needs alpha (e.g. alpha: 0.5)")
        if self.kind == "classes" and self.k is None:
            raise ValueError("kind 'classes' needs k, the number of classes per client")
        return self

    def arguments(self) -> dict[str, Any]:
        """Keyword arguments of the chosen partitioner."""
        if self.kind == "dirichlet":
            return {"alpha": self.alpha, "min_size": self.min_size, "max_retries": self.max_retries}
        if self.kind == "classes":
            return {"k": self.k}
        if self.kind == "quantity":
            alpha = 1.0 if self.alpha is None else self.alpha
            return {"alpha": alpha, "min_size": self.min_size, "max_retries": self.max_retries}
        return {}


class GroupConfig(_Strict):
    """A group of clients with one client view (`hetfl.data.views`): input size, number
    of classes (a seeded subset per client, labels remapped to 0..K-1), training samples."""

    clients: int = Field(..., ge=1)
    size: int | None = Field(None, ge=1, description="images resized to size x size pixels")
    classes: int | None = Field(None, ge=1, description="classes per client (default: all)")
    samples: int | None = Field(None, ge=1, description="training samples per client")

    def view_group(self) -> ViewGroup:
        return ViewGroup(self.clients, self.size, self.classes, self.samples)


class ResizedCropConfig(_Strict):
    """torchvision's `RandomResizedCrop` box distribution (`hetfl.core.augment`)."""

    scale: tuple[float, float] = Field((0.08, 1.0), description="area fraction range")
    ratio: tuple[float, float] = Field((3 / 4, 4 / 3), description="aspect ratio range")

    @model_validator(mode="after")
    def _ranges(self) -> ResizedCropConfig:
        self.box()  # the record checks its ranges
        return self

    def box(self) -> ResizedCrop:
        return ResizedCrop(self.scale, self.ratio)


class AugmentConfig(_Strict):
    """Training-time augmentation of every client's batches (`hetfl.core.augment`); off
    unless given. The CIFAR recipe is `crop_padding: 4, flip: true`."""

    crop_padding: int = Field(0, ge=0, description="pad, then crop back at a random offset")
    flip: bool = Field(False, description="mirror left-right with probability 1/2")
    resized_crop: ResizedCropConfig | bool = Field(
        False, description="random resized crop (true: torchvision's defaults)"
    )
    cutout: int = Field(0, ge=0, description="side of Cutout's square patch, in pixels")

    def augmentation(self) -> Augmentation:
        box = ResizedCropConfig() if self.resized_crop is True else self.resized_crop
        return Augmentation(
            crop_padding=self.crop_padding,
            flip=self.flip,
            resized_crop=box.box() if isinstance(box, ResizedCropConfig) else None,
            cutout=self.cutout,
        )


class DataConfig(_Strict):
    dataset: str = "fashion-mnist"
    path: str | None = Field(None, description="dataset file or directory")
    num_clients: int = Field(20, ge=1)
    partition: PartitionConfig = PartitionConfig()
    test_per_client: int = Field(100, ge=0)
    validation: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="fraction of each client's training data held out for validation",
    )
    download: bool = Field(False, description="fetch and verify the dataset first if missing")
    mirror: str | None = Field(
        None, description="base URL of the download mirror (default: the dataset's upstream)"
    )
    groups: list[GroupConfig] | None = Field(
        None, description="client groups by input size and class count (sets num_clients)"
    )
    augment: AugmentConfig | None = Field(
        None, description="training-time augmentation of image batches (default: none)"
    )

    @field_validator("dataset")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in DATASETS:
            raise ValueError(DATASETS.unknown_message(v))
        return v

    @model_validator(mode="after")
    def _downloadable(self) -> DataConfig:
        if self.download and self.dataset not in DOWNLOADERS:
            raise ValueError(
                f"download: true is only available for {', '.join(DOWNLOADERS)}, "
                f"not {self.dataset!r}"
            )
        return self

    @model_validator(mode="after")
    def _owners_for_natural(self) -> DataConfig:
        """The natural partition deals owners (writers, speakers): only LEAF data has them."""
        if self.partition.kind == "natural" and self.dataset not in LEAF_DATASETS:
            raise ValueError(
                f"partition kind 'natural' needs a dataset whose samples have owners "
                f"({', '.join(LEAF_DATASETS)}), not {self.dataset!r}"
            )
        return self

    @model_validator(mode="after")
    def _clients_from_groups(self) -> DataConfig:
        """With groups, num_clients is their total: derived when not given, checked when given."""
        if not self.groups:
            return self
        total = sum(g.clients for g in self.groups)
        if "num_clients" in self.model_fields_set and self.num_clients != total:
            raise ValueError(
                f"num_clients = {self.num_clients} but groups hold {total} clients; "
                "leave num_clients out (it is derived from the groups) or make them agree"
            )
        object.__setattr__(self, "num_clients", total)  # a derived value of a frozen model
        return self

    def view_groups(self) -> list[ViewGroup] | None:
        return None if not self.groups else [g.view_group() for g in self.groups]


class ModelConfig(_Strict):
    """A plain model by name, a scalable family with the shape of its (global) model, or a
    composed family (FLANC's, `hetfl.models.flanc`) with its composition options.

    The shape options apply to the scalable families only, `compose` and `basis` to the
    composed ones; a method that assigns sub-models (HeteroFL, FjORD, ...) derives each
    client's spec from this base.
    """

    name: str = "small-cnn"
    width: float | list[float] | None = Field(
        None, description="width ratio, global or one per stage (scalable models)"
    )
    stages: int | None = Field(None, ge=1, description="stages or sections (scalable models)")
    blocks: int | list[int] | None = Field(None, description="residual blocks per stage")
    bn: Literal["batch", "static", "per-width", "per-capacity", "none"] | None = Field(
        None, description="normalisation kind (scalable models; hetfl.models.norms)"
    )
    stem: Literal["small", "imagenet"] | None = None
    compose: Literal["factorised", "explicit"] | None = Field(
        None, description="composed models: factorised (default) or explicit kernels"
    )
    basis: Literal["paper", "code"] | None = Field(
        None, description="composed models: basis-size preset (paper by default)"
    )

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in model_names():
            raise ValueError(unknown_model_message(v))
        return v

    @model_validator(mode="after")
    def _family_options(self) -> ModelConfig:
        given = [k for k, v in self.family_options().items() if v is not None]
        problem = misplaced_options(self.name, given)
        if problem is not None:
            raise ValueError(problem)
        if self.basis is not None and self.basis not in COMPOSED.get(self.name).presets:
            raise ValueError(
                f"basis {self.basis!r} is not a preset of {self.name!r} (allowed: "
                f"{', '.join(COMPOSED.get(self.name).presets)})"
            )
        return self

    def family_options(self) -> dict[str, Any]:
        """The options `make_family` takes (None = the family's default)."""
        return {k: getattr(self, k) for k in (*SHAPE_OPTIONS, *COMPOSED_OPTIONS)}


class LrScheduleConfig(_Strict):
    """The lr by round (`hetfl.core.schedule.LrSchedule`, which checks it and holds the
    defaults)."""

    kind: Literal["constant", "cosine", "step", "exponential"] = default_of(LrSchedule, "kind")
    milestones: list[float] = Field(
        default_factory=list, description="step: rounds, or fractions of the run in (0, 1)"
    )
    gamma: float = Field(
        default_of(LrSchedule, "gamma"),
        gt=0,
        description="step: factor per milestone; exponential: per round",
    )
    warmup: float = Field(
        default_of(LrSchedule, "warmup"),
        ge=0,
        lt=1,
        description="fraction of the run warmed up linearly",
    )

    @model_validator(mode="after")
    def _schedule(self) -> LrScheduleConfig:
        self.lr_schedule()
        return self

    def lr_schedule(self) -> LrSchedule:
        return LrSchedule(self.kind, tuple(self.milestones), self.gamma, self.warmup)


def _local(name: str) -> Any:
    """The default of a local-training setting, which `LocalTraining` holds."""
    return default_of(LocalTraining, name)


class TrainConfig(_Strict):
    """Rounds and sampling, and the local-training settings, whose defaults are
    `hetfl.core.training.LocalTraining`'s."""

    rounds: int = Field(10, ge=1)
    clients_per_round: int = Field(10, ge=1)
    local_epochs: int = Field(_local("epochs"), ge=1)
    local_steps: int | None = Field(
        _local("steps"), ge=1, description="mini-batches; overrides epochs"
    )
    batch_size: int = Field(_local("batch_size"), ge=1)
    lr: float = Field(_local("lr"), gt=0, allow_inf_nan=False)
    lr_schedule: LrScheduleConfig = LrScheduleConfig()
    optimizer: Literal["sgd", "adam", "amsgrad"] = Field(
        _local("optimizer"), description="the local optimiser (hetfl.core.local.optim)"
    )
    momentum: float = Field(_local("momentum"), ge=0, lt=1, description="SGD's momentum")
    betas: tuple[float, float] = Field(_local("betas"), description="Adam's betas")
    eps: float = Field(_local("eps"), gt=0, allow_inf_nan=False, description="Adam's eps")
    keep_momentum: bool = Field(
        _local("keep_momentum"),
        description="momentum buffers persist across rounds as private client state",
    )
    weight_decay: float = Field(_local("weight_decay"), ge=0)
    clip_grad_norm: float | None = Field(_local("clip_grad_norm"), gt=0)

    @model_validator(mode="after")
    def _settings_fit_the_optimizer(self) -> TrainConfig:
        """The record's own checks (an optimiser's settings set for another, momentum to
        keep), reported at the config edge."""
        self.local_training()
        return self

    def local_training(self) -> LocalTraining:
        """The run's local-training record, which strategies send each client per round."""
        return LocalTraining(
            lr=self.lr,
            lr_schedule=self.lr_schedule.lr_schedule(),
            epochs=self.local_epochs,
            steps=self.local_steps,
            batch_size=self.batch_size,
            optimizer=self.optimizer,
            momentum=self.momentum,
            betas=self.betas,
            eps=self.eps,
            keep_momentum=self.keep_momentum,
            weight_decay=self.weight_decay,
            clip_grad_norm=self.clip_grad_norm,
        )


class EvalConfig(_Strict):
    every: int = Field(1, ge=1)
    local_eval: Literal["sampled", "all", "none"] = "sampled"
    test_samples: int | None = Field(
        None, ge=1, description="a fixed seeded subsample of the global test set (default: all)"
    )
    stats_samples: int | None = Field(
        None,
        ge=1,
        description="static-BN statistics pass (HeteroFL) over a seeded subsample of this many "
        "training samples, drawn per client in proportion to its size: a speed option "
        "(default: every client's whole training set)",
    )


class TargetConfig(_Strict):
    metric: Literal["global_acc", "local_acc", "loss", "test_loss"]
    value: float


class DeployConfig(_Strict):
    """A run through Flower (`hetfl serve`, `hetfl client`); the simulator ignores it."""

    superlink: str = Field(
        "127.0.0.1:9092",
        description="host:port of the SuperLink, where `hetfl serve` listens and clients connect",
    )
    round_timeout_s: float = Field(
        600.0, gt=0, le=86400, description="a round aggregates the clients that answered by then"
    )
    min_clients: int | None = Field(
        None, ge=1, description="clients that must register before round 1 (default: all)"
    )
    registration_timeout_s: float = Field(
        300.0, gt=0, description="how long round 1 waits for min_clients to register"
    )
    state_dir: str | None = Field(
        None, description="node-local directory where clients keep private state across restarts"
    )

    @field_validator("superlink")
    @classmethod
    def _address(cls, v: str) -> str:
        host, _, port = v.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError("must be host:port with a port in 1..65535, e.g. 127.0.0.1:9092")
        return v


_SIZE_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB)\s*")


def parse_size(value: Any) -> int:
    """Bytes from an int of bytes or a string such as "64MiB" (units B, KiB, MiB, GiB;
    binary, so 1 MiB = 1,048,576 bytes)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = _SIZE.fullmatch(value) if isinstance(value, str) else None
    if match is None:
        raise ValueError(
            "must be a number of bytes (an integer) or a size with a unit such as '64MiB' "
            f"(units: {', '.join(_SIZE_UNITS)})"
        )
    return int(float(match[1]) * _SIZE_UNITS[match[2]])


class StoreConfig(_Strict):
    """The simulator's client store (`hetfl.core.store`): private state over
    `memory_budget` spills to disk in the run directory (the Flower nodes keep theirs in
    `deploy.state_dir` instead)."""

    memory_budget: int | None = Field(
        None,
        ge=0,
        description="bytes of client private state held in memory, e.g. 64MiB; the rest "
        "spills to disk (default: no limit)",
    )

    @field_validator("memory_budget", mode="before")
    @classmethod
    def _size(cls, v: Any) -> Any:
        return None if v is None else parse_size(v)

    def settings(self) -> StoreSettings:
        return StoreSettings(self.memory_budget)


class RunConfig(_Strict):
    name: str = Field("run", pattern=r"^[A-Za-z0-9_.\-]+$")
    seed: int = Field(0, ge=0)
    algorithm: str = "fedavg"
    options: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="per-algorithm options, keyed by algorithm name"
    )
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    checkpoint_every: int = Field(1, ge=1)
    availability: float = Field(1.0, gt=0, le=1)
    system: SystemConfig = Field(
        SystemConfig(), description="device profiles, simulated clock, deadline"
    )
    store: StoreConfig = StoreConfig()
    targets: list[TargetConfig] = Field(default_factory=list)
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?|mps)$")
    deterministic: bool = Field(
        True,
        description="on CUDA, deterministic kernels (false is faster and not bit-reproducible)",
    )
    threads: int = Field(
        1,
        ge=1,
        description="intra-op threads of every unit of work (a client's training, an "
        "evaluation batch) in every executor; results depend on it, the executor does not",
    )
    executor: Literal["sequential", "processes", "vectorised", "auto"] | None = Field(
        None,
        description="where clients train and evaluation batches run: sequential (in "
        "process), processes (worker processes on the CPU), vectorised (same-spec clients "
        "trained together with vmap, for a GPU; agrees to about 1e-5, not bit for bit), "
        "auto (processes with more than one core and one client per round); unset: auto "
        "from the CLI, sequential from the library",
    )
    workers: int | None = Field(
        None, ge=1, description="worker processes of executor processes (default: cores / threads)"
    )
    output_dir: str = "runs"
    tracking: Literal["none", "tensorboard"] = Field(
        "none",
        description="where the metrics rows go besides metrics.jsonl: tensorboard writes "
        "event files to <run>/tensorboard (needs pip install 'hetfl[tensorboard]')",
    )
    wrappers: list[WrapperChoice] = Field(
        default_factory=list,
        description="client-program wrappers (attacks, faults), applied in this order to "
        "every client's program: [{kind: <name>, ...its options}] (`hetfl list`)",
    )
    deploy: DeployConfig = DeployConfig()
    sweep: dict[str, list[Any]] | None = None

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
                ALGORITHMS.get(algo).options(**opts)
            except ValidationError as exc:
                problems = "; ".join(
                    f"{'.'.join(['options', algo, *map(str, e['loc'])])}: "
                    f"{e['msg'].removeprefix('Value error, ')} (got {e.get('input')!r})"
                    for e in exc.errors()
                )
                raise ValueError(problems) from None
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
        sizes = {g.size for g in self.data.groups or []}
        if len(sizes) > 1 and not is_scalable(self.model.name):
            raise ValueError(
                f"data.groups give clients different input sizes ({sorted(sizes, key=str)}); "
                f"{self.model.name!r} takes one input size: use a scalable model "
                f"({', '.join(ARCHITECTURES.names())})"
            )
        if self.train.clients_per_round > self.data.num_clients:
            raise ValueError(
                f"train.clients_per_round = {self.train.clients_per_round} is more than "
                f"data.num_clients = {self.data.num_clients}"
            )
        if self.workers is not None and self.executor == "sequential":
            raise ValueError(
                f"workers = {self.workers} is for executor 'processes' (or 'auto'), "
                "but executor is 'sequential'"
            )
        if self.executor == "processes" and self.measured_clock:
            raise ValueError(
                "executor 'processes' with system.clock 'measured': clients training at the "
                "same time contend for the cores, so their measured times would not be "
                "theirs; use executor 'sequential' or the simulated clock"
            )
        if self.deploy.min_clients is not None and self.deploy.min_clients > self.data.num_clients:
            raise ValueError(
                f"deploy.min_clients = {self.deploy.min_clients} is more than "
                f"data.num_clients = {self.data.num_clients}"
            )
        return self

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


# -- loading, overrides, errors ------------------------------------------------------------
def parse_overrides(pairs: Sequence[str]) -> dict[str, Any]:
    """`["train.lr=0.1", "sweep.seed=[0,1]"]` -> `{"train.lr": 0.1, ...}` (values as YAML)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"override {pair!r} is not of the form key=value (e.g. train.lr=0.1)")
        key, _, raw = pair.partition("=")
        if not key:
            raise ConfigError(f"override {pair!r} has an empty key")
        out[key.strip()] = yaml.safe_load(raw) if raw.strip() else None
    return out


def set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for p in parts[:-1]:
        child = node.get(p)
        if not isinstance(child, dict):
            child = {}
            node[p] = child
        node = child
    node[parts[-1]] = value


def load_raw(path: str | Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping, got {type(raw).__name__}")
    return raw


def validate(raw: Mapping[str, Any]) -> RunConfig:
    try:
        return RunConfig.model_validate(dict(raw))
    except ValidationError as exc:
        raise ConfigError(format_errors(exc, raw)) from None


def format_errors(exc: ValidationError, raw: Mapping[str, Any]) -> str:
    lines = [f"invalid configuration ({exc.error_count()} problem(s)):"]
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        field = ".".join(loc) or "(top level)"
        if err["type"] == "extra_forbidden":
            lines.append(f"  - {field}: unknown key{_suggestion(loc)}")
            continue
        msg = err["msg"].removeprefix("Value error, ")
        got = _lookup(raw, loc)
        shown = "" if got is _MISSING else f" (got {got!r})"
        lines.append(f"  - {field}: {msg}{shown}")
    return "\n".join(lines)


_MISSING = object()


def _lookup(raw: Any, loc: Sequence[str]) -> Any:
    node = raw
    for p in loc:
        if isinstance(node, Mapping) and p in node:
            node = node[p]
        elif isinstance(node, list) and p.isdigit() and int(p) < len(node):
            node = node[int(p)]
        else:
            return _MISSING
    return node


def _suggestion(loc: Sequence[str]) -> str:
    """'; did you mean X?' from the fields of the model that holds the unknown key."""
    model: type[BaseModel] = RunConfig
    for p in loc[:-1]:
        field = model.model_fields.get(p)
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return ""
        model = annotation
    allowed = list(model.model_fields)
    close = difflib.get_close_matches(loc[-1], allowed, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{hint} (allowed: {', '.join(allowed)})"


# -- sweeps --------------------------------------------------------------------------------
def expand_sweep(raw: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """One (point name, raw config) per combination of the `sweep:` values.

    Keys are `algorithm`, `seed` or any dotted key; names read `<algorithm>-s<seed>` plus
    `-<key>=<value>` for every other swept key. A key that lists several dotted keys
    separated by commas sets each value into all of them (one sweep dimension): a server
    step tuned for two methods whose options live under their own names.
    """
    sweep = raw.get("sweep") or {}
    if not isinstance(sweep, Mapping):
        raise ConfigError("sweep: must map keys to lists of values, e.g. {algorithm: [fedavg]}")
    base = copy.deepcopy(dict(raw))
    base.pop("sweep", None)
    if not sweep:
        return [(_point_name(base, {}), base)]
    keys = list(sweep)
    for k in keys:
        values = sweep[k]
        if not isinstance(values, list) or not values:
            raise ConfigError(f"sweep.{k}: needs a non-empty list of values (got {values!r})")
    points = []
    for combo in itertools.product(*(sweep[k] for k in keys)):
        point = copy.deepcopy(base)
        for k, v in zip(keys, combo, strict=True):
            for target in _tied_keys(k):
                set_dotted(point, target, v)
        extra = {k: v for k, v in zip(keys, combo, strict=True) if k not in ("algorithm", "seed")}
        points.append((_point_name(point, extra), point))
    names = [n for n, _ in points]
    if len(set(names)) != len(names):
        raise ConfigError("sweep: two points get the same name; sweep distinct values")
    return points


def _tied_keys(key: str) -> list[str]:
    """The dotted keys a sweep key sets: itself, or each of a comma-separated list."""
    keys = [k.strip() for k in key.split(",")]
    if not all(keys):
        raise ConfigError(
            f"sweep.{key}: an empty key in a comma-separated list; write the dotted keys that "
            "take the same value, e.g. 'options.fedadagrad.server_lr, options.fedyogi.server_lr'"
        )
    return keys


def _point_name(point: Mapping[str, Any], extra: Mapping[str, Any]) -> str:
    name = f"{point.get('algorithm', 'fedavg')}-s{point.get('seed', 0)}"
    for k, v in extra.items():
        name += f"-{_tied_keys(k)[0].split('.')[-1]}={v}"
    return name.replace("/", "_")


def default_config_path() -> Path:
    return Path(__file__).parent / "configs" / "default.yaml"
