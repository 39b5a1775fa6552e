"""Golden outputs: every method's short run, pinned so that a refactor can prove it changes
no result.

A scenario is a short run (at most 3 rounds, digits, threads 1, simulated clock, no progress
display). Its fixture, `tests/golden/<name>.json`, holds the metrics rows (without
`wall_time_s`), the summary's failures, aggregated rounds, strategy description and a
defence's totals (where it has one), and, after every round, a record of every tensor of
the checkpointed state: the global state (`global/...`), the strategy's extra state
(`extra/...`: server optimiser moments, Ada's v), the client store (`store/<cid>/...`:
private tensors and kept momentum) and the server programs' store (`server_store/<cid>/...`)
and the pending downloads of a server phase (`downloads/<cid>/...`). A record is a SHA-256
of the tensor's dtype, shape and bytes, and its float64 sum, L2 norm and max |x|. What else
the checkpoint holds (each client's simulated times under device profiles) is kept as plain
values. Each round's state is read through the engine's `checkpoint_extras` hook, as its
checkpoint is written.

The fixture also records the numerics fingerprint of the machine that wrote it
(`hetfl.engine.numerics.fingerprint()`: torch and numpy, architecture, threads, the ATen and
oneDNN instruction sets in force, the BLAS library and its path) and, for diagnosis only,
the CPU model and the numeric variables set (`diagnosis()`). Where the fingerprints are
equal, which the suite's pins (tests/conftest.py) make true on any x86-64 CPU with AVX2 or
better and the fixtures' BLAS path, the comparison is bit for bit. Elsewhere each quantity
(`QUANTITIES`) is compared, round by round, to the tolerance measured beside the fixtures
(`tolerance.json`, written by `measure.py`).

`python tests/golden/generate.py` (`make golden`) rewrites the fixtures; a scenario is
added to `SCENARIOS` below, and every registered algorithm must have one named after it.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hetfl.config import set_dotted, validate
from hetfl.core.client.program import Programs
from hetfl.engine.numerics import BLAS_ENV, KERNEL_ENV, NUMERIC_ENV, blas, diagnosis, fingerprint
from hetfl.engine.round_settings import RoundSettings
from hetfl.runner import build_simulation
from hetfl.sim import Executor, Simulation

GOLDEN_DIR = Path(__file__).resolve().parent
REGENERATE = (
    "If the change of result is intended, regenerate with `make golden` "
    "(python tests/golden/generate.py [--only NAME]) and commit the fixture update on its own: "
    "a change to a result must be a deliberate fixture update in its own commit."
)

# -- scenarios -----------------------------------------------------------------------------
#: What every configured scenario shares: digits over 6 clients with label skew, a small
#: MLP, 3 rounds of one local epoch (clients of different sizes take different numbers of
#: steps, which FedNova normalises), threads 1 on the CPU, a checkpoint after every round.
BASE: dict[str, Any] = {
    "seed": 0,
    "device": "cpu",
    "threads": 1,
    "checkpoint_every": 1,
    "data": {
        "dataset": "digits",
        "num_clients": 6,
        "partition": {"kind": "dirichlet", "alpha": 0.5},
        "test_per_client": 20,
    },
    "model": {"name": "mlp"},
    "train": {"rounds": 3, "clients_per_round": 4, "local_epochs": 1, "batch_size": 32, "lr": 0.3},
    "eval": {"local_eval": "sampled"},
}
#: ScalableFL's detection run (no digits: a detector needs a detection set), as short as
#: one can be: the synthetic shapes, three clients in two groups (16 px of 2 classes, 32 px
#: of 3), 2 rounds of 4 local steps.
DETECTION: dict[str, Any] = {
    "seed": 0,
    "device": "cpu",
    "threads": 1,
    "checkpoint_every": 1,
    "algorithm": "scalablefl",
    "options": {"scalablefl": {"base_size": 4, "base_classes": 3}},
    "data": {
        "dataset": "synthetic-detection",
        "groups": [
            {"size": 16, "classes": 2, "clients": 2, "samples": 24},
            {"size": 32, "classes": 3, "clients": 1, "samples": 24},
        ],
        "test_per_client": 12,
    },
    "model": {"name": "ssd-stage-cnn", "stages": 3},
    "train": {"rounds": 2, "clients_per_round": 3, "local_steps": 4, "batch_size": 8, "lr": 0.02},
    "eval": {"local_eval": "all"},
}
#: A scalable model small enough for 8x8 digits.
STAGE_CNN = {"model.name": "stage-cnn", "model.stages": 2}
#: The width methods as their report configs train: 4 classes per client, momentum, decay.
WIDTHS = {
    **STAGE_CNN,
    "data.partition": {"kind": "classes", "k": 4},
    "train.momentum": 0.9,
    "train.weight_decay": 5e-4,
}
#: Two ScalableFL groups: 16 px with all 10 classes (3 stages) and 8 px with 3 (2 stages),
#: trained as its report config trains (momentum, weight decay, cosine lr).
GROUPS = {
    **STAGE_CNN,
    "model.stages": None,
    "data.partition": {"kind": "iid"},
    "data.groups": [
        {"size": 16, "classes": 10, "clients": 3, "samples": 60},
        {"size": 8, "classes": 3, "clients": 3, "samples": 60},
    ],
    "train.momentum": 0.9,
    "train.weight_decay": 5e-4,
    "train.lr_schedule": {"kind": "cosine"},
    "eval.local_eval": "all",
}
#: Device profiles: clients 0-4 fast, client 5 so slow that it misses the 1 s deadline.
DEADLINE = {
    "data.partition": {"kind": "iid"},
    "train.clients_per_round": 6,
    "system": {
        "profiles": [
            {"name": "fast", "rate": 1.0e9, "down_mbps": 100.0, "up_mbps": 100.0},
            {"name": "slow", "rate": 1.0e5, "down_mbps": 1.0, "up_mbps": 1.0},
        ],
        "assignment": ["fast", "fast", "fast", "fast", "fast", "slow"],
        "deadline_s": 1.0,
    },
}


#: DTFL as its configs train it (AMSGrad, lr 1e-3, weight decay 5e-4, lr cut on a plateau of
#: val_acc, patience 0 so that it cuts within the run), on the 1-block split ResNet, under
#: the paper's profiles with 30 % of the clients switching every round; two local steps and
#: 120 test images keep the run short.
DTFL = {
    "model.name": "resnet-cifar",
    "model.blocks": 1,
    "data.validation": 0.2,
    "train.optimizer": "amsgrad",
    "train.lr": 1e-3,
    "train.weight_decay": 5e-4,
    "train.local_steps": 2,
    "train.batch_size": 16,
    "train.lr_plateau": {"monitor": "val_acc", "patience": 0},
    "eval.test_samples": 120,
    "system": {"preset": "dtfl", "switch_every": 1, "switch_fraction": 0.3},
}


#: FedFA and its baselines: a Pre-ResNet of 2 sections, 2 local steps of 16 samples (the
#: candidates are each scenario's options).
PRE_RESNET = {
    **WIDTHS,
    "model.name": "preresnet",
    "train.local_steps": 2,
    "train.batch_size": 16,
}


def configured(algorithm: str, dotted: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """`BASE` for `algorithm` with dotted keys (`"train.lr"`) set; a None value removes
    the key."""
    raw = copy.deepcopy(BASE)
    raw["algorithm"] = algorithm
    for key, value in (dotted or {}).items():
        if value is None:
            *path, last = key.split(".")
            node = raw
            for p in path:
                node = node[p]
            node.pop(last, None)
        else:
            set_dotted(raw, key, copy.deepcopy(value))
    return raw


@dataclass(frozen=True)
class Scenario:
    """A short run: a config (built by `hetfl.runner.build_simulation`), or for what no
    config can express, `build(run_dir)`; `adjust` changes the built simulation (a failing
    client) before it runs."""

    name: str
    about: str
    config: Mapping[str, Any] | None = None
    build: Callable[[Path], Simulation] | None = None
    adjust: Callable[[Simulation], None] | None = None

    def simulation(self, run_dir: Path) -> Simulation:
        if self.build is not None:
            sim = self.build(run_dir)
        else:
            assert self.config is not None, f"scenario {self.name!r} has neither config nor build"
            sim = build_simulation(validate(self.config), run_dir, show_progress=False)
        if self.adjust is not None:
            self.adjust(sim)
        return sim


def _nan_inputs(cid: int) -> Callable[[Simulation], None]:
    """Client `cid`'s training inputs become NaN: its loss and update are non-finite, so
    the engine excludes it every round it is sampled."""

    def adjust(sim: Simulation) -> None:
        sim.clients[cid].x_train.fill_(float("nan"))

    return adjust


def _split_learning(run_dir: Path) -> Simulation:
    """The two-module split strategy of tests/test_server_program.py (a server program
    trains each client's copy of the head), 3 rounds on its own small data."""
    from test_server_program import TRAIN, _client_side, _clients, _split_strategy, _SplitFamily

    family = _SplitFamily()
    strategy = _split_strategy(family, clients_per_round=3, train=TRAIN)
    clients, test = _clients()
    settings = RoundSettings(rounds=3, seed=0, checkpoint_every=1, local_eval="all")
    programs = Programs(family, _client_side(), seed=0)
    return Simulation(strategy, programs, clients, test, settings, run_dir)


SCENARIOS: tuple[Scenario, ...] = (
    # every registered algorithm, under its own name
    Scenario(
        "ada-fedalrc",
        "Ada-FedALRC, linear model (SVT)",
        configured("ada-fedalrc", {"model.name": "linear", "options.ada-fedalrc.theta": 3}),
    ),
    Scenario("dtfl", "DTFL, tiers scheduled on the paper's profiles", configured("dtfl", DTFL)),
    Scenario("fedadagrad", "FedAdagrad", configured("fedadagrad")),
    Scenario("fedadam", "FedAdam", configured("fedadam")),
    Scenario(
        "fedalrc",
        "FedALRC shallow: linear model, partial SVT",
        configured("fedalrc", {"model.name": "linear", "options.fedalrc.theta": 3}),
    ),
    Scenario("fedavg", "FedAvg", configured("fedavg")),
    Scenario("fedbn", "FedBN, private BatchNorm", configured("fedbn", STAGE_CNN)),
    Scenario(
        "fedfa",
        "FedFA, Pre-ResNet of 2 sections, depths {2, 3} x widths {1/4, 1/2}, half limited, the "
        "others by ZiCo within drawn budgets, grafting, label split, l2 alpha, 2 local steps",
        configured(
            "fedfa",
            {**PRE_RESNET, "options.fedfa": {"depths": [2, 3], "widths": [0.25, 0.5]}},
        ),
    ),
    # The pydoc-topics corpus is the running interpreter's (`hetfl.data.pydoc_topics`): this
    # fixture holds for the Python minor version it was written with (3.11), which the
    # numerics fingerprint does not record; regenerate it with the suite's Python.
    Scenario(
        "fedfa-transformer",
        "FedFA on the 3-layer transformer-tiny, the pydoc-topics byte corpus dealt by "
        "document (natural), depths {2, 3} x widths {1/2, 1} drawn at random, grafting, 2 "
        "local steps, 200 test samples: perplexities in the rows",
        configured(
            "fedfa",
            {
                "data.dataset": "pydoc-topics",
                "data.partition": {"kind": "natural"},
                "model": {"name": "transformer-tiny", "blocks": 3},
                "options.fedfa": {"depths": [2, 3], "widths": [0.5, 1.0], "choice": "random"},
                "train.local_steps": 2,
                "train.batch_size": 16,
                "train.lr": 0.05,
                "eval.test_samples": 200,
            },
        ),
    ),
    Scenario(
        "fedfa-efficientnet",
        "FedFA on efficientnetv2-tiny's first four stages (three of Fused-MBConv, one of "
        "MBConv with SE) on 8x8 digits, depths {2, 3} x widths {1/4, 1/2} drawn at random, "
        "grafting into every stage, label split, l2 alpha, 2 local steps",
        configured(
            "fedfa",
            {
                **PRE_RESNET,
                "model.name": "efficientnetv2-tiny",
                "model.stages": 4,
                "options.fedfa": {"depths": [2, 3], "widths": [0.25, 0.5], "choice": "random"},
            },
        ),
    ),
    Scenario(
        "fedgkt",
        "FedGKT, edge models around md1 of the 1-block resnet-cifar, server md2..md8, two "
        "local epochs (logits aligned by sample index), two server epochs with distillation "
        "on the server, 3 rounds of 3 clients under the dtfl device profiles",
        configured(
            "fedgkt",
            {
                "model": {"name": "resnet-cifar", "blocks": 1},
                "data.validation": 0.2,
                "train.optimizer": "amsgrad",
                "train.lr": 1e-3,
                "train.weight_decay": 1e-4,
                "train.local_epochs": 2,
                "train.clients_per_round": 3,
                "options.fedgkt": {"server_epochs": 2, "distill_on_server": True},
                "system": {"preset": "dtfl"},
            },
        ),
    ),
    Scenario("fednova", "FedNova, plain SGD", configured("fednova")),
    Scenario("fedper", "FedPer, private head", configured("fedper")),
    Scenario("fedprox", "FedProx mu 0.1", configured("fedprox", {"options.fedprox.mu": 0.1})),
    Scenario("fedyogi", "FedYogi", configured("fedyogi")),
    Scenario(
        "fjord",
        "FjORD, ordered dropout without distillation",
        configured("fjord", {**WIDTHS, "options.fjord.levels": [0.25, 0.5, 1.0]}),
    ),
    Scenario(
        "flanc",
        "FLANC, composed CNN, capacities redrawn each round until all four appear, lr 0.01 "
        "(its report's; at 0.3 every client diverges after round 1)",
        configured(
            "flanc",
            {
                **WIDTHS,
                "model.name": "composed-cnn",
                "model.stages": None,
                "options.flanc.lambda_orth": 0.1,
                "train.lr": 0.01,
            },
        ),
    ),
    Scenario(
        "flexifed",
        "FlexiFed Max-Common on FedFA's choice (ZiCo) of depths {2, 3, 4} at width 1/4, "
        "Pre-ResNet of 2 sections, 2 local steps",
        configured(
            "flexifed",
            {**PRE_RESNET, "options.flexifed": {"depths": [2, 3, 4], "widths": [0.25]}},
        ),
    ),
    Scenario(
        "flexlora",
        "FlexLoRA on the MLP's linear layers, ranks {2, 4, 8} in proportion, the seed-0 base: "
        "each layer's SVD of the weighted products, truncated per rank",
        configured("flexlora", {"options.flexlora": {"ranks": [2, 4, 8]}}),
    ),
    Scenario(
        "flora",
        "FLoRA on the MLP's linear layers, ranks {2, 4, 8}, every client every round: the "
        "stack downloaded and merged into each client's own base",
        configured("flora", {"options.flora": {"ranks": [2, 4, 8]}, "train.clients_per_round": 6}),
    ),
    Scenario(
        "heterofl",
        "HeteroFL fixed levels, label-split masks, clipping at 0.5, stats pass on all data",
        configured(
            "heterofl",
            {
                **WIDTHS,
                "options.heterofl": {"levels": [1.0, 0.5, 0.25], "assignment": "fixed"},
                "train.clip_grad_norm": 0.5,
            },
        ),
    ),
    Scenario(
        "hetlora",
        "HetLoRA on the MLP's linear layers, ranks {2, 4, 8} in proportion, the seed-0 base: "
        "zero-padded, sparsity-weighted",
        configured("hetlora", {"options.hetlora": {"ranks": [2, 4, 8]}}),
    ),
    Scenario("local-only", "each client alone", configured("local-only")),
    Scenario(
        "nefl",
        "NeFL on the fedfa scenario's candidates and choice: step sizes, BN per sub-model",
        configured(
            "nefl", {**PRE_RESNET, "options.nefl": {"depths": [2, 3], "widths": [0.25, 0.5]}}
        ),
    ),
    Scenario(
        "scalablefl",
        "ScalableFL, two groups of input size and classes",
        configured("scalablefl", {**GROUPS, "options.scalablefl": {"base_size": 2}}),
    ),
    Scenario(
        "splitfed",
        "SplitFed SFLV1, resnet-cifar of 1 block per group cut after md2, AMSGrad on both "
        "sides (DTFL's settings), 2 rounds of 3 clients under the dtfl device profiles",
        configured(
            "splitfed",
            {
                "model": {"name": "resnet-cifar", "blocks": 1},
                "train.optimizer": "amsgrad",
                "train.lr": 1e-3,
                "train.weight_decay": 5e-4,
                "train.rounds": 2,
                "train.clients_per_round": 3,
                "system": {"preset": "dtfl"},
            },
        ),
    ),
    # extra scenarios
    Scenario(
        "fednova-momentum",
        "FedNova with local momentum 0.9",
        configured("fednova", {"train.momentum": 0.9}),
    ),
    Scenario(
        "fednova-prox",
        "FedNova-Prox, mu 0.01",
        configured("fednova", {"options.fednova.mu": 0.01}),
    ),
    Scenario(
        "fedalrc-deep",
        "FedALRC deep: MLP, Rademacher term with Q = 2",
        configured("fedalrc", {"options.fedalrc": {"Q": 2, "alpha": 0.01}}),
    ),
    Scenario(
        "heterofl-dynamic",
        "HeteroFL dynamic levels, label split, default clipping, stats pass on 200 samples",
        configured(
            "heterofl",
            {
                **WIDTHS,
                "options.heterofl": {"levels": [1.0, 0.5, 0.25], "assignment": "dynamic"},
                "eval.stats_samples": 200,
            },
        ),
    ),
    Scenario(
        "heterofl-fedbuff",
        "HeteroFL fixed levels under FedBuff (4 in flight, buffer 2, server lr 0.8) on the "
        "shipped trace fixture with its behaviour traces",
        configured(
            "heterofl",
            {
                **WIDTHS,
                "options.heterofl": {"levels": [1.0, 0.5, 0.25], "assignment": "fixed"},
                "system": {
                    "trace": {"capacity": "fixture", "behaviour": "fixture"},
                    "asynchronous": {
                        "mode": "fedbuff",
                        "concurrency": 4,
                        "buffer_size": 2,
                        "server_lr": 0.8,
                    },
                },
            },
        ),
    ),
    Scenario(
        "fjord-distill",
        "FjORD with self-distillation",
        configured(
            "fjord", {**WIDTHS, "options.fjord": {"levels": [0.25, 0.5, 1.0], "distill": True}}
        ),
    ),
    Scenario(
        "scalablefl-heterofl-max",
        "ScalableFL's HeteroFL variant at the deepest depth",
        configured(
            "scalablefl",
            {**GROUPS, "options.scalablefl": {"base_size": 2, "variant": "heterofl-max"}},
        ),
    ),
    Scenario(
        "scalablefl-heterofl-max-1",
        "ScalableFL's HeteroFL variant one stage shallower",
        configured(
            "scalablefl",
            {**GROUPS, "options.scalablefl": {"base_size": 2, "variant": "heterofl-max-1"}},
        ),
    ),
    Scenario(
        "scalablefl-individual",
        "ScalableFL's individual-training variant: nothing shared",
        configured(
            "scalablefl",
            {**GROUPS, "options.scalablefl": {"base_size": 2, "variant": "individual"}},
        ),
    ),
    Scenario(
        "scalablefl-detection",
        "ScalableFL's SSD detector on the synthetic shapes: two 16 px 2-class clients and a "
        "32 px 3-class one, 2 rounds, local mAP per group",
        DETECTION,
    ),
    Scenario(
        "heterofl-own-level",
        "HeteroFL without label split, local accuracy of each client's own level",
        configured(
            "heterofl",
            {
                **WIDTHS,
                "options.heterofl": {
                    "levels": [1.0, 0.5],
                    "label_split": False,
                    "local_eval_model": "own-level",
                },
            },
        ),
    ),
    Scenario(
        "fedalrc-global",
        "FedALRC's global variant (no gate, theta 0) on the linear model",
        configured("fedalrc", {"model.name": "linear", "options.fedalrc.variant": "g"}),
    ),
    Scenario(
        "fedavg-availability",
        "FedAvg, each client reachable with probability 0.6 per round",
        configured("fedavg", {"availability": 0.6}),
    ),
    Scenario(
        "fedavg-kept-momentum",
        "FedAvg, momentum 0.9 kept across rounds in the client store",
        configured("fedavg", {"train.momentum": 0.9, "train.keep_momentum": True}),
    ),
    Scenario(
        "fedavg-lr-schedule",
        "FedAvg, step lr schedule with warm-up",
        configured(
            "fedavg",
            {"train.lr_schedule": {"kind": "step", "milestones": [2], "gamma": 0.5, "warmup": 0.3}},
        ),
    ),
    Scenario(
        "hetlora-pruning",
        "HetLoRA as the hetlora scenario with §3's local rank self-pruning, gamma 0.5, "
        "lambda 1: trailing-part regulariser, ranks pruned to floor(gamma r)",
        configured(
            "hetlora",
            {
                "options.hetlora": {
                    "ranks": [2, 4, 8],
                    "self_pruning": {"enabled": True, "gamma": 0.5, "lam": 1.0},
                }
            },
        ),
    ),
    Scenario(
        "fedavg-uniform",
        "FedAvg, uniform weighting",
        configured("fedavg", {"options.fedavg.weighting": "uniform"}),
    ),
    Scenario(
        "fedavg-failing-client",
        "FedAvg, client 2's update is NaN and excluded",
        configured("fedavg", {"data.partition": {"kind": "iid"}, "train.clients_per_round": 6}),
        adjust=_nan_inputs(2),
    ),
    Scenario(
        "fedavg-deadline",
        "FedAvg under device profiles, the slow client misses the deadline",
        configured("fedavg", DEADLINE),
    ),
    Scenario(
        "split-server-program",
        "the split-learning test strategy of tests/test_server_program.py",
        build=_split_learning,
    ),
    Scenario(
        "fedper-local-eval-all",
        "FedPer, every client that ever trained evaluated locally each round",
        configured("fedper", {"eval.local_eval": "all"}),
    ),
    Scenario(
        "fedavg-validation",
        "FedAvg with data.validation 0.2: val_acc on the pooled hold-out",
        configured("fedavg", {"data.validation": 0.2}),
    ),
    Scenario(
        "heterofl-attacked",
        "HeteroFL as in its scenario, every client each round, 1 of 6 malicious (FedFA's "
        "poisoning, lambda 20, at the widest level) under Multi-Krum with f = 1",
        configured(
            "heterofl",
            {
                **WIDTHS,
                "options.heterofl": {
                    "levels": [1.0, 0.5, 0.25],
                    "assignment": "fixed",
                    "reducer": {"kind": "multi-krum", "f": 1},
                },
                "train.clip_grad_norm": 0.5,
                "train.clients_per_round": 6,
                "attack": {"kind": "fedfa-poison", "fraction": 0.2, "lambda": 20},
            },
        ),
    ),
)
BY_NAME = {s.name: s for s in SCENARIOS}


def fixture_path(name: str) -> Path:
    return GOLDEN_DIR / f"{name}.json"


def fixture_files() -> list[Path]:
    """Every fixture file in the folder (the measured tolerance beside them is not one)."""
    return sorted(p for p in GOLDEN_DIR.glob("*.json") if p.name != "tolerance.json")


# -- recording -----------------------------------------------------------------------------
def tensor_record(t: torch.Tensor) -> dict[str, Any]:
    """A tensor's SHA-256 (of its dtype, shape and bytes) and its float64 sum, L2 norm and
    max |x|."""
    t = t.detach().cpu().contiguous()
    digest = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    x = t.double()
    return {
        "sha256": digest.hexdigest(),
        "dtype": str(t.dtype).removeprefix("torch."),
        "shape": list(t.shape),
        "sum": float(x.sum()),
        "norm": float(x.norm()),
        "max_abs": float(x.abs().max()) if x.numel() else 0.0,
    }


def _flatten(prefix: str, value: Any) -> Iterator[tuple[str, Any]]:
    """(path, leaf) for every leaf of nested mappings and sequences."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            yield from _flatten(f"{prefix}/{k}", v)
    elif isinstance(value, list | tuple) and any(isinstance(v, torch.Tensor) for v in value):
        for i, v in enumerate(value):
            yield from _flatten(f"{prefix}/{i}", v)
    else:
        yield prefix, value


def _plain(value: Any) -> Any:
    """A JSON value for a non-tensor leaf."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain(dataclasses.asdict(value))
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return repr(value)


def state_record(sim: Simulation, extras: Mapping[str, Any]) -> dict[str, Any]:
    """One round's checkpointed state: each tensor's record, and other values as they are."""
    parts = {
        "global": sim.state,
        "extra": sim.strategy.extra_state(),
        "store": extras.get("store", {}),
        "server_store": extras.get("server_store", {}),
        "downloads": extras.get("downloads", {}),
        "sim_times": extras.get("sim_times", {}),
    }
    tensors: dict[str, Any] = {}
    values: dict[str, Any] = {}
    for part, content in parts.items():
        for path, leaf in _flatten(part, content):
            if isinstance(leaf, torch.Tensor):
                tensors[path] = tensor_record(leaf)
            else:
                values[path] = _plain(leaf)
    return {"tensors": dict(sorted(tensors.items())), "values": dict(sorted(values.items()))}


def run_scenario(
    scenario: Scenario, run_dir: Path, executor: Executor | None = None
) -> dict[str, Any]:
    """Run `scenario` into `run_dir` (with `executor` instead of the sequential one when
    given) and return its fixture."""
    sim = scenario.simulation(run_dir)
    if executor is not None:
        sim.executor = executor
    if sim.settings.checkpoint_every != 1:
        raise ValueError(f"scenario {scenario.name!r} must checkpoint every round")
    rounds: list[dict[str, Any]] = []
    engine_extras = sim.checkpoint_extras

    def recording_extras() -> dict[str, Any]:
        """The engine's checkpoint entries, read as each round's checkpoint is written."""
        extras = engine_extras()
        rounds.append({"round": len(rounds) + 1, **state_record(sim, extras)})
        return extras

    sim.checkpoint_extras = recording_extras  # type: ignore[method-assign]
    summary = sim.run()
    if len(rounds) != sim.settings.rounds:
        raise RuntimeError(f"{len(rounds)} checkpoints for {sim.settings.rounds} rounds")
    metrics = [{k: v for k, v in row.items() if k != "wall_time_s"} for row in sim.metrics.read()]
    kept = ("strategy", "failures", "rounds_aggregated")
    # a defence's totals where a scenario has one (null elsewhere, left out of older fixtures)
    kept += ("defence",) if summary.get("defence") is not None else ()
    return {
        "scenario": scenario.name,
        "about": scenario.about,
        "config": None if scenario.config is None else dict(scenario.config),
        "fingerprint": fingerprint(),
        "diagnosis": diagnosis(),
        "accuracy_atol": accuracy_atol(sim),
        "summary": {k: _plain(summary[k]) for k in kept if k in summary},
        "metrics": metrics,
        "rounds": rounds,
    }


def accuracy_atol(sim: Simulation) -> float:
    """One test sample of the smallest evaluated set: how far an accuracy may move on a
    machine with other numerics."""
    sizes = [int(sim.y_test.numel())]
    for c in sim.clients.values():
        sizes += [n for n in (int(c.y_test.numel()), c.split("validation")[1].numel()) if n]
    return 1.0 / min(sizes)


# -- the file format -----------------------------------------------------------------------
def dumps(value: Any, indent: int = 0) -> str:
    """JSON with each innermost object (a tensor record) on one line: readable in a diff,
    and small."""
    if not isinstance(value, dict | list) or all(_is_flat(v) for v in _items(value)):
        return json.dumps(value, sort_keys=True)
    pad = " " * (indent + 1)
    if isinstance(value, dict):
        inner = [f"{pad}{json.dumps(k)}: {dumps(v, indent + 1)}" for k, v in sorted(value.items())]
        return "{\n" + ",\n".join(inner) + "\n" + " " * indent + "}"
    inner = [f"{pad}{dumps(v, indent + 1)}" for v in value]
    return "[\n" + ",\n".join(inner) + "\n" + " " * indent + "]"


def _is_flat(value: Any) -> bool:
    """A scalar, or a list of scalars (a shape)."""
    if isinstance(value, list):
        return not any(isinstance(v, dict | list) for v in value)
    return not isinstance(value, dict)


def _items(value: Any) -> list[Any]:
    return list(value.values()) if isinstance(value, dict) else list(value)


def read_fixture(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


# -- comparison ----------------------------------------------------------------------------
#: The quantities whose differences are measured and bounded apart, round by round:
#: every tensor record's sum, norm and max |x| (`weights`); the training, test and
#: validation losses (`loss`); accuracies, in test samples of the smallest evaluated set
#: (`acc`); every other number of the metrics rows and the checkpointed values (`other`:
#: bytes, MACs, simulated times).
QUANTITIES = ("weights", "loss", "acc", "other")
TOLERANCE_PATH = GOLDEN_DIR / "tolerance.json"  # not a fixture: `fixture_files` skips it


@dataclass(frozen=True)
class Tolerance:
    """How far a run with other numerics may be from a fixture: per quantity, a bound per
    round (the last one for later rounds); relative, or in test samples for `acc`."""

    bounds: Mapping[str, Sequence[float]]

    def bound(self, quantity: str, rnd: int) -> float:
        per_round = self.bounds[quantity]
        return float(per_round[min(rnd, len(per_round)) - 1])


def read_tolerance(scenario: str, path: Path = TOLERANCE_PATH) -> Tolerance:
    """The tolerance `measure.py` wrote for `scenario`; a scenario it has not measured yet
    gets the largest bound of every measured one."""
    record = json.loads(path.read_text())
    return Tolerance(record["scenarios"].get(scenario, record["unmeasured"]))


def exact_comparison(expected: Mapping[str, Any], got: Mapping[str, Any]) -> bool:
    """Bit for bit where every field of the numerics fingerprint is equal."""
    return bool(expected["fingerprint"] == got["fingerprint"])


def assert_same_as_sequential(
    sequential: Mapping[str, Any], got: Mapping[str, Any], where: str
) -> None:
    """`got`, a scenario run `where` (another executor, on this machine), equals the
    sequential executor's run of it bit for bit."""
    assert sequential["fingerprint"] == got["fingerprint"]
    problems = compare(sequential, got)
    assert not problems, f"{where}:\n" + "\n".join(problems[:20])


def compare(
    expected: Mapping[str, Any], got: Mapping[str, Any], tolerance: Tolerance | None = None
) -> list[str]:
    """Every difference between a fixture and a fresh run: bit for bit when the
    fingerprints match, else each quantity within `tolerance` (the scenario's measured one
    when not given)."""
    exact = exact_comparison(expected, got)
    if not exact and tolerance is None:
        tolerance = read_tolerance(str(expected["scenario"]))
    problems: list[str] = []
    if expected.get("config") != got.get("config"):
        problems.append("the scenario's config differs from the fixture's")
    if expected["summary"] != got["summary"]:
        problems.append(f"summary: {expected['summary']!r} in the fixture, {got['summary']!r}")
    if len(expected["rounds"]) != len(got["rounds"]):
        problems.append(f"rounds: {len(expected['rounds'])} in the fixture, {len(got['rounds'])}")
    if len(expected["metrics"]) != len(got["metrics"]):
        problems.append(
            f"metrics: {len(expected['metrics'])} rows in the fixture, {len(got['metrics'])} now"
        )
    if problems:
        return problems
    for diff in _differences(expected, got):
        if tolerance is None:
            if diff.exact_differs:
                problems.append(diff.describe())
        elif diff.size > tolerance.bound(diff.quantity, diff.round):
            problems.append(
                f"{diff.describe()}: {diff.size:.3g} beyond the tolerance "
                f"{tolerance.bound(diff.quantity, diff.round):.3g} of `{diff.quantity}` in round "
                f"{diff.round}"
            )
    return problems


@dataclass(frozen=True)
class Difference:
    """One compared number: where it is, its quantity and round, both values, its size
    (relative, or in test samples for `acc`), and whether its bits differ."""

    where: str
    quantity: str
    round: int
    want: Any
    have: Any
    size: float
    exact_differs: bool

    def describe(self) -> str:
        return f"{self.where}: {self.want!r} in the fixture, {self.have!r} now"


def largest_differences(expected: Mapping[str, Any], got: Mapping[str, Any]) -> dict[str, list]:
    """Per quantity, the largest difference in each round (what `measure.py` records)."""
    rounds = len(expected["rounds"])
    out: dict[str, list] = {q: [0.0] * rounds for q in QUANTITIES}
    for diff in _differences(expected, got):
        out[diff.quantity][diff.round - 1] = max(out[diff.quantity][diff.round - 1], diff.size)
    return out


def _differences(expected: Mapping[str, Any], got: Mapping[str, Any]) -> Iterator[Difference]:
    """Every compared number of two runs of one scenario (same rounds, same rows)."""
    samples = float(expected["accuracy_atol"])
    for want, have in zip(expected["metrics"], got["metrics"], strict=True):
        rnd = int(want["round"])
        yield from _leaves(f"metrics round {rnd}", want, have, rnd, samples)
    for want, have in zip(expected["rounds"], got["rounds"], strict=True):
        rnd = int(want["round"])
        yield from _tensor_differences(f"round {rnd}", want["tensors"], have["tensors"], rnd)
        yield from _leaves(f"round {rnd} values", want["values"], have["values"], rnd, samples)


def _tensor_differences(
    where: str, want: Mapping[str, Any], have: Mapping[str, Any], rnd: int
) -> Iterator[Difference]:
    for name in sorted(set(want) | set(have)):
        w, h = want.get(name), have.get(name)
        if w is None or h is None:
            state = "missing now" if h is None else "is new"
            yield Difference(f"{where}: {name} {state}", "weights", rnd, w, h, math.inf, True)
            continue
        if (w["dtype"], w["shape"]) != (h["dtype"], h["shape"]):
            yield Difference(
                f"{where}: {name} dtype/shape",
                "weights",
                rnd,
                f"{w['dtype']}{w['shape']}",
                f"{h['dtype']}{h['shape']}",
                math.inf,
                True,
            )
            continue
        bits = w["sha256"] != h["sha256"]
        if bits:
            stats = ", ".join(f"{k} {w[k]!r} -> {h[k]!r}" for k in ("sum", "norm", "max_abs"))
            desc = f"{where}: {name} differs in its bits ({stats})"
        # a sum may be near 0 where its terms are not: measured against the norm as well
        sizes = [
            _relative(w["sum"], h["sum"], scale=max(abs(w["norm"]), abs(h["norm"]))),
            _relative(w["norm"], h["norm"]),
            _relative(w["max_abs"], h["max_abs"]),
        ]
        yield Difference(
            desc if bits else f"{where}: {name}",
            "weights",
            rnd,
            w["sha256"],
            h["sha256"],
            max(sizes),
            bits,
        )


def _leaves(
    where: str, want: Any, have: Any, rnd: int, samples: float, key: str = ""
) -> Iterator[Difference]:
    """The numbers of two nested metrics or values records, paired by key."""
    if isinstance(want, dict) and isinstance(have, dict):
        for k in sorted(set(want) | set(have)):
            yield from _leaves(f"{where}/{k}", want.get(k), have.get(k), rnd, samples, str(k))
        return
    if isinstance(want, list) and isinstance(have, list) and len(want) == len(have):
        for i, (w, h) in enumerate(zip(want, have, strict=True)):
            yield from _leaves(f"{where}[{i}]", w, h, rnd, samples, key)
        return
    if key in ("round", "wall_time_s"):
        return
    numbers = (float, int)
    both = all(isinstance(v, numbers) and not isinstance(v, bool) for v in (want, have))
    if not both:
        differs = want != have
        yield Difference(where, "other", rnd, want, have, math.inf if differs else 0.0, differs)
        return
    differs = not (want == have or (math.isnan(want) and math.isnan(have)))
    if key.endswith("acc"):
        quantity, size = "acc", abs(want - have) / samples
    else:
        quantity = "loss" if key.endswith("loss") else "other"
        size = _relative(want, have)
    if math.isnan(want) != math.isnan(have):
        size = math.inf
    yield Difference(where, quantity, rnd, want, have, size if differs else 0.0, differs)


def _relative(want: float, have: float, scale: float = 0.0) -> float:
    if want == have:
        return 0.0
    if math.isnan(want) or math.isnan(have) or math.isinf(want) or math.isinf(have):
        return math.inf
    return abs(want - have) / max(abs(want), abs(have), scale, 1e-300)


def mismatch_message(name: str, problems: list[str], exact: bool) -> str:
    how = (
        "bit for bit (the fixture's numerics fingerprint is this machine's)"
        if exact
        else "to the measured tolerance of tests/golden/tolerance.json (the fixture was "
        "written with other numerics)"
    )
    shown = "\n  ".join(problems[:20])
    more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
    return (
        f"golden scenario {name!r} ({fixture_path(name).name}) differs {how}:\n  "
        f"{shown}{more}\n{REGENERATE}"
    )


BIT_FOR_BIT = "bit for bit"


def comparison_mode(expected: Mapping[str, Any], got: Mapping[str, Any]) -> str:
    """`BIT_FOR_BIT`, or the fingerprint fields that differ (why the tolerance applies)."""
    if exact_comparison(expected, got):
        return BIT_FOR_BIT
    want, have = expected["fingerprint"], got["fingerprint"]
    return "; ".join(
        f"{k}: {want.get(k)!r} in the fixtures, {have.get(k)!r} here"
        for k in sorted(set(want) | set(have))
        if want.get(k) != have.get(k)
    )


def describe_modes(modes: Mapping[str, str], pins: Mapping[str, str]) -> str:
    """The end-of-run line(s): how many fixtures compared bit for bit, under which pins,
    and why the others compared to the measured tolerance."""
    unpinned = "none (HETFL_UNPINNED is set)" if os.environ.get("HETFL_UNPINNED") else None
    pinned = ", ".join(f"{k}={v}" for k, v in pins.items()) or unpinned or "none apply here"
    exact = sum(m == BIT_FOR_BIT for m in modes.values())
    lines = [f"{exact} of {len(modes)} golden runs compared bit for bit (numerics pins: {pinned})"]
    others = {k: os.environ[k] for k in NUMERIC_ENV if k in os.environ and k not in pins}
    if others:
        library = blas()[0]
        blind = [k for k in others if k not in KERNEL_ENV and k not in BLAS_ENV.get(library, ())]
        shown = ", ".join(f"{k}={v}" for k, v in others.items())
        note = f"; torch's BLAS is {library}: {', '.join(blind)} gate nothing" if blind else ""
        lines.append(f"numeric variables also set: {shown}{note}")
    for reason in sorted({m for m in modes.values() if m != BIT_FOR_BIT}):
        n = sum(m == reason for m in modes.values())
        lines.append(
            f"{n} compared to the measured tolerance ({TOLERANCE_PATH.name}), because {reason}"
        )
    return "\n".join(lines)
