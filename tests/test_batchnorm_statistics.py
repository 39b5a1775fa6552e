"""BatchNorm running statistics are never averaged into invalid values (issue 50, item 2): the
server's `StatisticsGuard` refuses, whatever the reducer, a client whose running variances are
negative or non-finite (or running means non-finite), recorded as "dropped", by hand; a
refusal follows the client into a later reduction of the round; scaling attacks leave buffers
as the honest pass left them unless `scale_buffers: true`."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import pytest
import torch

from golden.harness import configured
from hetfl.attacks.malicious import draw_malicious
from hetfl.attacks.poisoning import Poison, buffer_names
from hetfl.config import validate
from hetfl.core.client.program import Program, Programs
from hetfl.core.init import initialize
from hetfl.core.kinds import choose
from hetfl.core.rng import SERVER, torch_generator
from hetfl.core.server.defences import (
    STATISTICS_KIND,
    DecisionRecorder,
    KrumReducer,
    invalid_statistics,
)
from hetfl.core.server.reducers import REDUCERS
from hetfl.core.spec import MapEntry
from hetfl.core.state import Accumulator
from hetfl.core.training import LocalTraining
from hetfl.core.types import ClientData, ClientOutput, ClientTask
from hetfl.engine.outputs import read_metrics
from hetfl.models.scalable import ScalableFamily
from hetfl.runner import build_simulation

VAR, MEAN, W = "bn.running_var", "bn.running_mean", "fc.weight"
MAP = [MapEntry(n, n) for n in (VAR, MEAN, W)]
REFERENCE = {VAR: torch.ones(2), MEAN: torch.zeros(2), W: torch.zeros(2)}


def _upload(var: list[float], mean: list[float], w: float) -> dict[str, torch.Tensor]:
    return {VAR: torch.tensor(var), MEAN: torch.tensor(mean), W: torch.full((2,), w)}


def _reduce(factory, uploads):
    recorder = DecisionRecorder(factory)
    reducer = recorder(REFERENCE)
    for upload in uploads:
        reducer.add(upload, MAP, 1.0)
    return reducer.result(REFERENCE), recorder


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        (_upload([-0.5, 2.0], [0.0, 0.0], 30.0), "negative variances"),
        (_upload([float("inf"), 2.0], [0.0, 0.0], 30.0), "non-finite"),
        (_upload([1.0, 2.0], [float("nan"), 0.0], 30.0), "non-finite"),
    ],
)
@pytest.mark.parametrize("kind", ["mean", "median", "trimmed-mean"])
def test_a_client_with_invalid_statistics_is_refused_whatever_the_reducer(bad, why, kind):
    """Honest clients 0 and 2 upload variances [1, 3] and [3, 1], weights 1 and 3; client 1's
    statistics are invalid: every reducer gives the two honest clients' result (the mean of
    two values is their median and their 0.25-trimmed mean: floor(0.25·2) = 0), variances
    [2, 2], weights 2, and the round records client 1 dropped."""
    assert why in (invalid_statistics(bad, MAP) or "")
    factory = choose(
        REDUCERS, {"kind": kind, "trim": 0.25} if kind == "trimmed-mean" else kind
    ).build()
    honest = [_upload([1.0, 3.0], [0.5, 0.5], 1.0), _upload([3.0, 1.0], [0.5, 0.5], 3.0)]
    out, recorder = _reduce(factory, [honest[0], bad, honest[1]])
    assert torch.equal(out[VAR], torch.tensor([2.0, 2.0]))
    assert torch.equal(out[W], torch.tensor([2.0, 2.0]))
    decided = recorder.decided([10, 11, 12], [10, 11, 12])
    assert decided is not None and decided.kind == STATISTICS_KIND
    assert decided.by_client == {10: "kept", 11: "dropped", 12: "kept"}


def test_valid_statistics_decide_nothing_and_a_masked_out_element_is_not_read():
    """A zero variance is valid; an element the entry's mask does not upload is not read."""
    masked = [MapEntry(VAR, VAR, mask=torch.tensor([1.0, 0.0])), *MAP[1:]]
    assert invalid_statistics(_upload([0.0, -1.0], [0.0, 0.0], 1.0), masked) is None
    assert invalid_statistics(_upload([0.0, -1.0], [0.0, 0.0], 1.0), MAP) is not None
    _, recorder = _reduce(Accumulator, [_upload([0.0, 1.0], [0.0, 0.0], 1.0)])
    assert recorder.decided([0], [0]) is None


def test_the_refusal_joins_a_defences_own_decisions():
    """Krum (f = 0, m = 1) over the four valid clients keeps the one nearest the others; the
    refused client is dropped before Krum sees it, and its position stays in the record."""
    uploads = [
        _upload([1.0, 1.0], [0.0, 0.0], 1.0),
        _upload([-1.0, 1.0], [0.0, 0.0], 1.0),  # refused
        _upload([1.0, 1.0], [0.0, 0.0], 1.1),
        _upload([1.0, 1.0], [0.0, 0.0], 1.2),
        _upload([1.0, 1.0], [0.0, 0.0], 9.0),
    ]
    out, recorder = _reduce(partial(KrumReducer, f=0, m=1, kind="krum"), uploads)
    assert torch.allclose(out[W], torch.full((2,), 1.1, dtype=torch.float32))
    decided = recorder.decided([0, 1, 2, 3, 4], [0, 1, 2, 3, 4])
    assert decided is not None and decided.kind == "krum"
    assert decided.by_client == {0: "dropped", 1: "dropped", 2: "kept", 3: "dropped", 4: "dropped"}


def test_a_refused_client_is_refused_in_the_rounds_later_reduction():
    """FedNova's second reduction (deltas, no statistics) refuses the client the first refused:
    its delta of 100 does not enter the mean of the others' 1 and 3."""
    recorder = DecisionRecorder(Accumulator)
    first = recorder(REFERENCE)
    for upload in (_upload([1.0, 1.0], [0, 0], 1.0), _upload([-1.0, 1.0], [0, 0], 1.0)):
        first.add(upload, MAP, 1.0)
    first.add(_upload([1.0, 1.0], [0, 0], 1.0), MAP, 1.0)
    first.result(REFERENCE)
    later = recorder({W: torch.zeros(2)})
    for delta in (1.0, 100.0, 3.0):
        later.add({W: torch.full((2,), delta)}, [MapEntry(W, W)], 1.0)
    assert torch.equal(later.result({W: torch.zeros(2)}, "zero")[W], torch.full((2,), 2.0))
    decided = recorder.decided([5, 6, 7], [5, 6, 7])
    assert decided is not None and decided.by_client == {5: "kept", 6: "dropped", 7: "kept"}


def _bn_task():
    family = ScalableFamily(
        {"family": "stage-cnn", "input_shape": (1, 8, 8), "num_classes": 3, "stages": 1}
    )
    spec = family.global_spec([])
    imap = family.index_map(spec)
    model = initialize(family.build(spec), torch_generator(0, 0, SERVER, "init"))
    payload = {e.local: t.clone() for e, t in zip(imap, model.state_dict().values(), strict=True)}
    task = ClientTask(0, spec, payload, imap, LocalTraining(lr=0.1, steps=2, batch_size=3))
    x = torch.rand(6, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    data = ClientData(0, x, torch.tensor([0, 1, 2, 0, 1, 2]), x[:0], torch.tensor([]), 3)
    return family, task, data


@pytest.mark.parametrize("scale_buffers", [False, True])
def test_a_scaling_attack_leaves_buffers_as_trained_unless_told(scale_buffers: bool):
    """Eq. 1 with λ = 20 on a model with BatchNorm: the buffers (running statistics, the
    counter) are the honest pass's by default, r + (h − r) + λ(p − r) with scale_buffers;
    the parameters are poisoned either way."""
    family, task, data = _bn_task()
    clean = Programs(family, seed=0).program_for(0)
    assert buffer_names(clean, task.spec) == {
        "stages.0.norm.running_mean",
        "stages.0.norm.running_var",
        "stages.0.norm.num_batches_tracked",
    }
    honest = clean.fit(task, data, {}, torch_generator(0, 1, 0, "train"), info=data.info())
    attacked = Poison(20.0, True, scale_buffers)(Programs(family, seed=0).program_for(0))
    out = attacked.fit(task, data, {}, torch_generator(0, 1, 0, "train"), info=data.info())
    var = "stages.0.norm.running_var"
    h, got, r = honest.result.tensors[var], out.result.tensors[var], task.payload[var]
    assert torch.equal(got, h) != scale_buffers
    if scale_buffers:
        assert bool((got - r).abs().max() > (h - r).abs().max())
    w = "head.weight"
    assert not torch.equal(out.result.tensors[w], honest.result.tensors[w])


@dataclass
class NegativeVariance:
    """A program uploading what it trained with every running variance set to −1."""

    honest: Program

    def __post_init__(self) -> None:
        self.cid, self.device = self.honest.cid, self.honest.device

    def fit(self, task, data, private, generator, *, info, channel=None) -> ClientOutput:
        out = self.honest.fit(task, data, private, generator, info=info, channel=channel)
        tensors = {
            k: torch.full_like(v, -1.0) if k.endswith("running_var") else v
            for k, v in out.result.tensors.items()
        }
        return replace(out, result=replace(out.result, tensors=tensors))

    def evaluate(self, task, data, private, models):
        return self.honest.evaluate(task, data, private, models)

    def trace_fields(self):
        return self.honest.trace_fields()


@dataclass(frozen=True)
class NegativeFor:
    """`NegativeVariance` around client `cid`'s (flagged) program."""

    cid: int

    def __call__(self, program: Program) -> Program:
        return NegativeVariance(program) if program.cid == self.cid else program


def test_a_run_records_the_refusal_in_its_rows_and_trace(tmp_path: Path) -> None:
    """FedAvg's plain mean, 4 clients of a CNN with BatchNorm, the malicious one uploading
    running variances of −1: it is dropped (kind batchnorm-statistics) in the metrics row,
    the trace and the summary, and every global running variance stays positive."""
    raw = configured(
        "fedavg",
        {
            "data.num_clients": 4,
            "data.partition": {"kind": "iid"},
            "model.name": "stage-cnn",
            "model.stages": 1,
            "train.rounds": 1,
            "train.clients_per_round": 4,
            "attack": {"kind": "scaled-poison", "fraction": 0.25, "lambda": 1},
        },
    )
    sim = build_simulation(validate(raw), tmp_path, show_progress=False)
    (attacker,) = draw_malicious(range(4), 0.25, seed=0)
    sim.programs.wrappers = (*sim.programs.wrappers, NegativeFor(attacker))
    summary = sim.run()
    (row,) = read_metrics(tmp_path / "metrics.jsonl")
    assert row["defence"] == {
        "kind": STATISTICS_KIND,
        "kept": 3,
        "clipped": 0,
        "dropped": 1,
        "fallback": False,
        "malicious_kept": 0,
        "malicious_clipped": 0,
        "malicious_dropped": 1,
    }
    trace = {r["cid"]: r["defence"] for r in read_metrics(tmp_path / "clients.jsonl")}
    assert trace == {c: "dropped" if c == attacker else "kept" for c in range(4)}
    assert summary["defence"]["dropped"] == 1 and summary["defence"]["honest_dropped"] == 0
    variances = [v for k, v in sim.state.items() if k.endswith("running_var")]
    assert variances and all(bool((v > 0).all()) for v in variances)
