"""One job: the config's sections as typed, frozen records (data, model, training,
evaluation, deployment, store), each validating its own fields and the names it refers to
against the registries.

Every record refuses unknown keys; what crosses sections is checked by `RunConfig`
(`hetfl.config.run`).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from hetfl import catalogue
from hetfl.core.augment import Augmentation, ResizedCrop
from hetfl.core.plateau import PlateauSettings
from hetfl.core.schedule import LrSchedule
from hetfl.core.training import LocalTraining, default_of
from hetfl.data import DATASET_SPLITS, DATASETS, OWNED_DATASETS, PARTITIONERS
from hetfl.data.detection_sources import DETECTION_DATASETS, check_samples
from hetfl.data.download import DOWNLOADERS
from hetfl.data.partition import Deal
from hetfl.data.views import ViewGroup
from hetfl.engine.store import StoreSettings
from hetfl.models.factory import (
    COMPOSED_OPTIONS,
    SHAPE_OPTIONS,
    is_split,
    misplaced_options,
    model_names,
    unknown_model_message,
)
from hetfl.models.flanc import COMPOSED
from hetfl.models.scalable import ARCHITECTURES
from hetfl.sim.ray_executor import RaySettings
from hetfl.sim.ray_session import CONNECT_TIMEOUT_S


class ConfigError(ValueError):
    """A configuration that cannot run; the message is meant for the user, as is."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PartitionConfig(_Strict):
    kind: str = Field(
        "iid",
        description="how the training set is dealt to clients: "
        + ", ".join(catalogue.PARTITIONERS)
        + " (docs/data.md)",
    )
    alpha: float | None = Field(
        None,
        gt=0,
        description="Dirichlet concentration: dirichlet's label skew (required) or quantity's "
        "size skew (default 1); smaller is more skewed",
    )
    min_size: int = Field(
        10, ge=1, description="dirichlet, quantity: redraw until every client has this many samples"
    )
    max_retries: int = Field(
        100, ge=1, description="dirichlet, quantity: draws tried before the partition fails"
    )
    k: int | None = Field(
        None, ge=1, description="classes: the number of classes each client holds (required)"
    )
    deal: Deal = Field(
        "round-robin",
        description="classes: how classes are dealt: round-robin, the shuffled classes in turn "
        "(at most C distinct sets); least-used, each class drawn among those dealt least "
        "often so far (FLANC's code); other kinds ignore it, as they ignore k",
    )
    sizes: Literal["equal", "half-to-full"] = Field(
        "equal",
        description="iid: client sizes: equal (differing by at most one sample), or "
        "half-to-full, each drawn uniformly in [1/2, 1] x the largest (FedFA's IID setting)",
    )

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
        if self.kind != "iid" and self.sizes != "equal":
            raise ValueError(
                f"sizes = {self.sizes!r} applies to kind 'iid' only, got kind {self.kind!r}; "
                "set kind: iid, or leave sizes out (quantity skews sizes by alpha)"
            )
        return self

    def arguments(self) -> dict[str, Any]:
        """Keyword arguments of the chosen partitioner."""
        if self.kind == "dirichlet":
            return {"alpha": self.alpha, "min_size": self.min_size, "max_retries": self.max_retries}
        if self.kind == "classes":
            return {"k": self.k, "deal": self.deal}
        if self.kind == "quantity":
            alpha = 1.0 if self.alpha is None else self.alpha
            return {"alpha": alpha, "min_size": self.min_size, "max_retries": self.max_retries}
        if self.kind == "iid":
            return {"sizes": self.sizes}
        return {}


class GroupConfig(_Strict):
    """A group of clients with one client view (`hetfl.data.views`): input size, number
    of classes (a seeded subset per client, labels remapped to 0..K-1), training samples."""

    clients: int = Field(..., ge=1, description="the number of clients in the group")
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
    dataset: str = Field(
        "fashion-mnist",
        description=f"the data source: {', '.join(catalogue.DATASETS)}, or for a detector "
        f"{', '.join(catalogue.DETECTION_DATASETS)} (docs/data.md)",
    )
    path: str | None = Field(
        None,
        description="where the data is: the file (npz, libsvm) or directory to read; default: "
        "$HETFL_DATA, then the dataset's usual places (docs/data.md)",
    )
    num_clients: int = Field(20, ge=1, description="clients the training set is dealt to")
    partition: PartitionConfig = Field(
        PartitionConfig(), description="how the training set is dealt to the clients"
    )
    train_samples: int | None = Field(
        None,
        ge=1,
        description="deal only this many training samples, a seeded uniform subset drawn "
        "before partitioning, so the partition's own client sizes survive the reduced scale "
        "(default: the whole training set)",
    )
    test_per_client: int = Field(
        100,
        ge=0,
        description="size of each client's local test split, drawn from the global test set "
        "in the client's class proportions (0: none)",
    )
    validation: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="fraction of each client's training data held out for validation",
    )
    split: str | None = Field(
        None,
        description="how the dataset draws its test set, for those that draw one "
        "(ham10000: random, the default, or lesion; docs/data.md)",
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
        if v not in DATASETS and v not in DETECTION_DATASETS:
            raise ValueError(
                f"{DATASETS.unknown_message(v)}; detection sets: "
                f"{', '.join(DETECTION_DATASETS.names())}"
            )
        return v

    @property
    def detection(self) -> bool:
        """Whether the dataset is a detection set (`hetfl.data.detection_sources`)."""
        return self.dataset in DETECTION_DATASETS

    @model_validator(mode="after")
    def _detection_groups(self) -> DataConfig:
        """A detection set is dealt IID to groups that each name their side and class
        count (`hetfl.data.detection_views`): what it cannot do is refused here."""
        if not self.detection:
            return self
        where = f"dataset {self.dataset!r} is a detection set"
        if not self.groups or any(g.size is None or g.classes is None for g in self.groups):
            raise ValueError(
                f"{where}: declare its client groups with their image side and class count, "
                "data.groups: [{clients: 2, size: 16, classes: 2}, ...]"
            )
        unsupported = {
            "partition": self.partition != PartitionConfig(kind="iid"),
            "validation": self.validation is not None,
            "augment": self.augment is not None,
            "split": self.split is not None,
            "train_samples": self.train_samples is not None,
        }
        given = [k for k, v in unsupported.items() if v]
        if given:
            raise ValueError(
                f"{where}: its clients get IID shares, without validation splits or "
                f"augmentation; leave {', '.join(given)} out"
            )
        if len({g.samples for g in self.groups}) > 1:
            raise ValueError(f"{where}: give every group the same samples (or none)")
        check_samples(self.dataset, self.groups[0].samples)
        return self

    @model_validator(mode="after")
    def _known_split(self) -> DataConfig:
        """A split names one of the dataset's own ways of drawing its test set."""
        if self.split is None:
            return self
        choices = DATASET_SPLITS.get(self.dataset)
        if choices is None:
            raise ValueError(
                f"split is only for datasets that draw their own test set "
                f"({', '.join(DATASET_SPLITS)}), not {self.dataset!r}; leave it out"
            )
        if self.split not in choices:
            raise ValueError(
                f"unknown split {self.split!r} for {self.dataset}; choose one of "
                f"{', '.join(choices)}"
            )
        return self

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
        """The natural partition deals owners (writers, speakers, documents): only the
        datasets of `OWNED_DATASETS` have them."""
        if self.partition.kind == "natural" and self.dataset not in OWNED_DATASETS:
            raise ValueError(
                f"partition kind 'natural' needs a dataset whose samples have owners "
                f"({', '.join(OWNED_DATASETS)}), not {self.dataset!r}"
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
    """A plain model by name, a scalable family with the shape of its (global) model, a
    composed family (FLANC's, `hetfl.models.flanc`) with its composition options, or a
    split model (DTFL's ResNet in modules, `hetfl.models.resnet_cifar`) with its blocks.

    The shape options apply to the scalable families only, `compose` and `basis` to the
    composed ones, `blocks` (one integer, per group) to the scalable and the split ones; a
    method that assigns sub-models (HeteroFL, FjORD, ...) or cuts the model (SplitFed,
    DTFL) derives each client's spec from this base.
    """

    name: str = Field(
        "small-cnn",
        description="the model: a plain one ("
        + ", ".join(catalogue.MODELS)
        + "), a scalable family ("
        + ", ".join(catalogue.ARCHITECTURES)
        + ") or a composed one ("
        + ", ".join(catalogue.COMPOSED)
        + ")",
    )
    width: float | list[float] | None = Field(
        None,
        description="scalable models: the global model's width ratio relative to the family's "
        "base widths, one for every stage or one per stage (default 1)",
    )
    stages: int | None = Field(
        None, ge=1, description="scalable models: stages or sections (default: all the family has)"
    )
    blocks: int | list[int] | None = Field(
        None,
        description="resnet18, preresnet: residual blocks per stage, one for all or one per "
        "stage (default 2); mobilenetv2: blocks (repeats) per stage, one per stage (default "
        "Table 2's 1, 2, 3, 4, 3, 3, 1; stages 1 and 7 keep one); efficientnetv2-s, -tiny: "
        "blocks (repeats) per stage, one per stage (default Table 4's 2, 4, 4, 6, 9, 15; "
        "tiny 2, 3, 3, 3, 3, 3)",
    )
    bn: Literal["batch", "static", "per-width", "per-capacity", "none"] | None = Field(
        None,
        description="scalable models: the normalisation after each convolution "
        "(hetfl.models.norms; default batch; HeteroFL and FjORD set their own)",
    )
    stem: Literal["small", "imagenet"] | None = Field(
        None,
        description="resnet18, preresnet: small, a 3x3 stride-1 convolution (CIFAR-size "
        "inputs; the default), or imagenet, a 7x7 stride-2 convolution and a max-pool; "
        "mobilenetv2: small, the stem and stage 2 at stride 1 (CIFAR-size inputs; the "
        "default), or imagenet, Table 2's strides; efficientnetv2-s, -tiny: small, the stem "
        "and stage 2 at stride 1 (the default), or imagenet, Table 4's strides",
    )
    compose: Literal["factorised", "explicit"] | None = Field(
        None, description="composed models: factorised (default) or explicit kernels"
    )
    basis: Literal["code", "table2", "supplement"] | None = Field(
        None,
        description="composed models: basis sizes, code (the authors' code), table2 (the "
        "sizes that give the supplement's Table 2 MACs) or supplement (the RNN's stated "
        "sizes); default composed-cnn table2, composed-resnet18 code, composed-rnn supplement",
    )

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in model_names():
            raise ValueError(unknown_model_message(v))
        return v

    @property
    def detector(self) -> bool:
        """Whether the model is an object detector (a scalable family's SSD)."""
        return self.name in ARCHITECTURES and ARCHITECTURES.get(self.name).detector

    @model_validator(mode="after")
    def _family_options(self) -> ModelConfig:
        given = [k for k, v in self.family_options().items() if v is not None]
        problem = misplaced_options(self.name, given)
        if problem is not None:
            raise ValueError(problem)
        if (
            is_split(self.name)
            and self.blocks is not None
            and (not isinstance(self.blocks, int) or self.blocks < 1)
        ):
            raise ValueError(
                f"model.blocks of {self.name!r} is one integer >= 1, the blocks of every "
                f"group (3: ResNet-56, 6: ResNet-110), got {self.blocks!r}"
            )
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

    kind: Literal["constant", "cosine", "step", "exponential"] = Field(
        default_of(LrSchedule, "kind"),
        description="the factor on train.lr in round r of R: constant 1; cosine "
        "(1 + cos(pi (r - 1) / R)) / 2; step gamma per milestone passed; exponential "
        "gamma ** (r - 1)",
    )
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


class LrPlateauConfig(_Strict):
    """The lr cut on a plateau of an evaluated accuracy (`hetfl.core.plateau`, which checks
    it and holds the defaults, DTFL's): `monitor` val_acc (needs data.validation) or
    global_acc (the test accuracy, as the DTFL paper does); the run must evaluate every
    round."""

    monitor: Literal["val_acc", "global_acc"] = Field(
        default_of(PlateauSettings, "monitor"),
        description="the accuracy watched: val_acc (needs data.validation) or global_acc "
        "(the test accuracy, as the DTFL paper does; the banner says the test set steers "
        "training)",
    )
    factor: float = Field(
        default_of(PlateauSettings, "factor"),
        gt=0,
        lt=1,
        description="the lr is multiplied by this at each plateau (on top of lr_schedule)",
    )
    patience: int = Field(
        default_of(PlateauSettings, "patience"),
        ge=0,
        description="a plateau: more than this many evaluated rounds without a gain",
    )
    threshold: float = Field(
        default_of(PlateauSettings, "threshold"),
        ge=0,
        allow_inf_nan=False,
        description="a gain: beating the best accuracy so far by this relative amount",
    )

    def settings(self) -> PlateauSettings:
        return PlateauSettings(self.monitor, self.factor, self.patience, self.threshold)


def _local(name: str) -> Any:
    """The default of a local-training setting, which `LocalTraining` holds."""
    return default_of(LocalTraining, name)


class TrainConfig(_Strict):
    """Rounds and sampling, and the local-training settings, whose defaults are
    `hetfl.core.training.LocalTraining`'s."""

    rounds: int = Field(10, ge=1, description="federated rounds of the run")
    clients_per_round: int = Field(
        10,
        ge=1,
        description="clients a round asks to train, drawn by the method's sampler "
        "(ScalableFL: per group, options.scalablefl.participation)",
    )
    local_epochs: int = Field(
        _local("epochs"), ge=1, description="passes over its training data a client makes per round"
    )
    local_steps: int | None = Field(
        _local("steps"),
        ge=1,
        description="mini-batches a client trains per round; when set, overrides local_epochs",
    )
    batch_size: int = Field(_local("batch_size"), ge=1, description="local mini-batch size")
    lr: float = Field(
        _local("lr"),
        gt=0,
        allow_inf_nan=False,
        description="the local optimiser's learning rate (scaled by round by lr_schedule)",
    )
    lr_schedule: LrScheduleConfig = Field(
        LrScheduleConfig(), description="the lr by round (default constant)"
    )
    optimizer: Literal["sgd", "adam", "amsgrad"] = Field(
        _local("optimizer"), description="the local optimiser (hetfl.core.client.optim)"
    )
    momentum: float = Field(
        _local("momentum"), ge=0, lt=1, description="sgd: momentum (PyTorch's semantics)"
    )
    betas: tuple[float, float] = Field(
        _local("betas"), description="adam, amsgrad: the moment decay rates"
    )
    eps: float = Field(
        _local("eps"), gt=0, allow_inf_nan=False, description="adam, amsgrad: the denominator's eps"
    )
    keep_momentum: bool = Field(
        _local("keep_momentum"),
        description="the optimiser is fresh each round; true keeps each client's optimiser "
        "state (SGD's momentum buffers, Adam's moments) as its private state between its "
        "rounds (sgd: needs momentum > 0)",
    )
    weight_decay: float = Field(
        _local("weight_decay"), ge=0, description="L2 weight decay of the local optimiser"
    )
    clip_grad_norm: float | None = Field(
        _local("clip_grad_norm"),
        gt=0,
        description="clip each step's gradient to this total norm (default: no clipping; "
        "HeteroFL clips at 1 unless set)",
    )
    lr_plateau: LrPlateauConfig | None = Field(
        None,
        description="cut the lr on a plateau of val_acc (or global_acc): "
        "{monitor, factor, patience, threshold} (default: off)",
    )

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
            lr_plateau=None if self.lr_plateau is None else self.lr_plateau.settings(),
        )


class EvalConfig(_Strict):
    """When models are tested and which clients are judged locally (metrics.jsonl)."""

    every: int = Field(
        1, ge=1, description="evaluate every this many rounds (and always after the last)"
    )
    every_sim_s: float | None = Field(
        None,
        gt=0,
        description="evaluate on the simulated clock instead: after each server step during "
        "which the clock passed a multiple of this many simulated seconds (and after the "
        "last), one grid for runs whose steps take different simulated times (synchronous "
        "rounds, FedBuff's and FedAsync's steps); needs system:, with every at 1 and "
        "local_trained off",
    )
    local_eval: Literal["sampled", "all", "none"] = Field(
        "sampled",
        description="the clients whose local accuracy (local_acc) is measured: the round's "
        "sampled clients, every client that has trained, or none",
    )
    local_trained: bool = Field(
        False,
        description="also measure local_acc_trained: each of the round's trained clients' "
        "model right after local training, before aggregation, on its local test split (BN "
        "statistics re-estimated on its own training data, its label mask), the same for "
        "every method; not counted in macs",
    )
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
    stats_pass: bool = Field(
        False,
        description="also report local_acc_stats: local_acc after each evaluated client "
        "re-estimates its BatchNorm statistics on its own training data with the current "
        "weights, for that evaluation only (methods with private BN: scalablefl, fedbn)",
    )

    global_stats_pass: Literal["auto", "on", "off"] = Field(
        "auto",
        description="the BatchNorm statistics pass of the models scored as global_acc (and "
        "FedGKT's joined models, pooled_acc and with pooled_global global_acc) before they are "
        "tested: auto, as each method does (HeteroFL, "
        "FedFA and FedGKT pass, the others score averaged running statistics); on or off, "
        "the same for every method (one protocol for a comparison; a method whose models "
        "keep no running statistics is refused with off)",
    )
    require_global_test: bool = Field(
        False,
        description="refuse, at set-up, a method that scores nothing on the global test set "
        "(private layers only); FedGKT is scored there as pooled_global says",
    )
    pooled_global: bool = Field(
        False,
        description="score a method without one global model whose clients share one "
        "(FedGKT: each client's extractor joined to the server model) on the global test "
        "set as global_acc / test_loss, the unweighted mean over the clients that have "
        "trained, each joined model after its client's statistics pass as "
        "global_stats_pass rules; on whenever require_global_test is",
    )
    map_interpolation: Literal["all-point", "11-point"] = Field(
        "all-point",
        description="a detector's AP@0.5 (local_map, global_map): all-point, the area under "
        "the precision envelope (PASCAL VOC 2010 onward), or 11-point, its mean at recall "
        "0, 0.1, ..., 1 (VOC 2007)",
    )

    @model_validator(mode="after")
    def _one_cadence(self) -> EvalConfig:
        if self.every_sim_s is None:
            return self
        if self.every != 1:
            raise ValueError(
                f"every_sim_s = {self.every_sim_s} sets when to evaluate on the simulated "
                f"clock, and every = {self.every} sets it in rounds: keep one (leave every "
                "at 1)"
            )
        if self.local_trained:
            raise ValueError(
                "every_sim_s decides after a step's clock has moved, when the trained models "
                "that local_trained scores before aggregation are gone: set local_trained "
                "to false, or evaluate by rounds (eval.every)"
            )
        return self

    @model_validator(mode="after")
    def _stats_pass_needs_local_evaluation(self) -> EvalConfig:
        if self.stats_pass and self.local_eval == "none":
            raise ValueError(
                "stats_pass reports local_acc_stats, a local evaluation, but local_eval is "
                "'none'; set local_eval to sampled or all, or drop stats_pass"
            )
        return self


class TargetConfig(_Strict):
    """A level to reach: summary.json records the round, simulated time, bytes and MACs at
    which the metric first reached it."""

    metric: Literal[
        "global_acc",
        "pooled_acc",
        "local_acc",
        "local_acc_trained",
        "val_acc",
        "loss",
        "test_loss",
        "val_loss",
        "global_ppl",
        "local_ppl",
        "local_ppl_trained",
        "global_map",
        "local_map",
    ] = Field(description="the metrics.jsonl key watched")
    value: float = Field(
        description="reached when an accuracy or mAP is at least, or a loss or perplexity at "
        "most, this"
    )


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
    max_missed_rounds: int = Field(
        2,
        ge=1,
        description="a client that does not answer in this many sampled rounds in a row is "
        "dropped from sampling until its node connects again, so the server waits for it at "
        "most this many times round_timeout_s",
    )
    state_dir: str | None = Field(
        None, description="node-local directory where clients keep private state across restarts"
    )
    node_poll_s: float = Field(
        0.25,
        gt=0,
        le=60,
        description="how often an idle client node asks the SuperLink for a message (Flower's "
        "own SuperNode: every 3 s); read from the node's own config",
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


class RayConfig(_Strict):
    """Where executor 'ray' runs its units (docs/ray.md)."""

    address: str | None = Field(
        None,
        pattern=r"^(auto|[A-Za-z0-9_.\-]+:\d+)$",
        description="null: start a local Ray for the run (shut down at its end); auto: join "
        "the Ray cluster this machine belongs to (`ray start`); host:port: a cluster's head",
    )
    cpus_per_unit: float = Field(
        1, gt=0, description="CPUs of the cluster each unit (a Ray actor) holds"
    )
    gpus_per_unit: float = Field(
        0, ge=0, description="GPUs each unit holds (with device: cuda; a fraction shares one)"
    )
    connect_timeout_s: float = Field(
        CONNECT_TIMEOUT_S,
        gt=0,
        description="seconds a run waits for address (auto or host:port) to accept a "
        "connection before it stops with an error naming it",
    )

    def settings(self) -> RaySettings:
        return RaySettings(
            self.address, self.cpus_per_unit, self.gpus_per_unit, self.connect_timeout_s
        )


class StoreConfig(_Strict):
    """The simulator's client store (`hetfl.engine.store`): private state over
    `memory_budget` spills to disk in the run directory (the Flower nodes keep theirs in
    `deploy.state_dir` instead)."""

    memory_budget: int | None = Field(
        None,
        ge=0,
        description="bytes of client private state held in memory, e.g. 64MiB; the rest "
        "spills to disk (default: no limit); a method with a server phase (FedGKT) gives half "
        "of it to its pending downloads",
    )

    @field_validator("memory_budget", mode="before")
    @classmethod
    def _size(cls, v: Any) -> Any:
        return None if v is None else parse_size(v)

    def settings(self) -> StoreSettings:
        return StoreSettings(self.memory_budget)
