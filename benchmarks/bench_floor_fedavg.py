"""The FedAvg floor of workloads A and B: FedAvg written directly in PyTorch, as fast and
simple as we could make it (McMahan et al., "Communication-Efficient Learning of Deep
Networks from Decentralized Data", AISTATS 2017, Algorithm 1).

One model re-loaded per client, each client's data preloaded as tensors (uint8 pixels,
standardised per batch as HetFL standardises them), SGD with
`foreach=True` and gradients zeroed in place, a float64 sample-weighted sum cast once, the
global model tested every round, its state checkpointed every round as HetFL does. Data
preparation and the starting point come from HetFL's own functions, so that both sides see
the same client tensors, the same initial weights, the same sampled clients and the same
batch order (generators derived as the engine derives them).

`run_floor` is the one-process, two-thread floor the ratio is taken against;
`run_floor_two_processes` (`floor2`) splits each round's clients and the test batches
between two one-thread worker processes (`bench_worker_pair`) and adds their float64 sums
in the parent: what two cores give when the work is split by hand.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from bench_side import Profile, SideClock, save_atomically
from bench_worker_pair import WORKERS, WorkerPair, deal
from bench_workloads import BATCH, EVAL_BATCH, LR, SEED, THREADS, Workload
from torch import nn

from hetfl.core.init import initialize
from hetfl.core.pixels import PixelNorm
from hetfl.core.rng import SERVER, numpy_generator, torch_generator
from hetfl.data import Dataset, build_clients, global_test, iid, load_fashion_mnist
from hetfl.data.views import ClientView
from hetfl.models.plain import SmallCNN

State = dict[str, torch.Tensor]


@dataclass
class Test:
    """The test images (uint8 pixels), their labels and their standardisation."""

    x: torch.Tensor
    y: torch.Tensor
    pixels: PixelNorm


@dataclass
class Clients:
    """Every client's training tensors (uint8 pixels), by id, and their standardisation."""

    xs: list[torch.Tensor]
    ys: list[torch.Tensor]
    pixels: PixelNorm


def load_clients(w: Workload) -> Clients:
    """Fashion-MNIST split IID over `w.clients` clients (`w.samples` each where set) with
    HetFL's partition generator and client views."""
    ds = load_fashion_mnist()
    parts = iid(ds.y_train, w.clients, numpy_generator(SEED, 0, SERVER, "partition"))
    views = None if w.samples is None else [ClientView(samples=w.samples)] * w.clients
    clients = build_clients(ds, parts, 0, SEED, "cpu", views)
    return Clients([c.x_train for c in clients], [c.y_train for c in clients], pixels_of(ds))


def load_test(w: Workload) -> Test:
    """The Fashion-MNIST test set (A and B test on all 10,000 images), or the workload's
    fixed subsample, as HetFL draws it."""
    ds = load_fashion_mnist()
    x, y = global_test(ds, "cpu", w.test_samples, SEED)
    return Test(x, y, pixels_of(ds))


def pixels_of(ds: Dataset) -> PixelNorm:
    """The dataset's pixel standardisation (every floor standardises as HetFL does)."""
    if ds.pixels is None:
        raise ValueError(f"dataset {ds.name!r} has no pixel statistics: the floor expects pixels")
    return ds.pixels


def initial_model() -> tuple[nn.Module, State]:
    """The small CNN and HetFL's initial global state (the run's "init" generator)."""
    model = SmallCNN((1, 28, 28), 10)
    initialize(model, torch_generator(SEED, 0, SERVER, "init"))
    return model, {k: v.detach().clone() for k, v in model.state_dict().items()}


def sampled(w: Workload, rnd: int) -> list[int]:
    """The round's clients, drawn as HetFL's uniform sampler draws them, sorted."""
    if w.per_round >= w.clients:
        return list(range(w.clients))
    drawn = torch.randperm(w.clients, generator=torch_generator(SEED, rnd, SERVER, "sample"))
    return sorted(drawn[: w.per_round].tolist())


def train_clients(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: State,
    cids: Sequence[int],
    data: Clients,
    rnd: int,
) -> tuple[State, int]:
    """One epoch of each client in `cids` from `state`: the float64 sums of their final
    tensors weighted by their sample counts, and the summed count."""
    sums = {k: torch.zeros(v.shape, dtype=torch.float64) for k, v in state.items()}
    total = 0
    for cid in cids:
        model.load_state_dict(state)
        model.train()
        x, y = data.xs[cid], data.ys[cid]
        n = int(y.shape[0])
        perm = torch.randperm(n, generator=torch_generator(SEED, rnd, cid, "train"))
        for s in range(0, n, BATCH):
            idx = perm[s : s + BATCH]
            loss = F.cross_entropy(model(data.pixels(x[idx])), y[idx])
            optimizer.zero_grad(set_to_none=False)
            loss.backward()
            optimizer.step()
        for k, v in model.state_dict().items():
            sums[k].add_(v.double(), alpha=n)
        total += n
    return sums, total


def test_batch_starts(test: Test) -> list[int]:
    """Where HetFL's evaluation batches start in the test set."""
    return list(range(0, int(test.y.shape[0]), EVAL_BATCH))


@torch.no_grad()
def test_batches(model: nn.Module, test: Test, starts: Sequence[int]) -> tuple[int, int]:
    """Correct predictions and images over the evaluation batches starting at `starts`, in
    eval mode, each standardised as it is drawn (loss summed too, as HetFL's evaluation
    computes it)."""
    model.eval()
    correct, seen, loss_sum = 0, 0, 0.0
    for s in starts:
        xb, yb = test.x[s : s + EVAL_BATCH], test.y[s : s + EVAL_BATCH]
        out = model(test.pixels(xb))
        loss_sum += float(F.cross_entropy(out, yb, reduction="sum"))
        correct += int((out.argmax(dim=1) == yb).sum())
        seen += int(yb.shape[0])
    return correct, seen


def test_accuracy(model: nn.Module, test: Test) -> float:
    """Accuracy on the whole test set."""
    correct, seen = test_batches(model, test, test_batch_starts(test))
    return correct / seen


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    # foreach and zeroed (not freed) gradients: the fastest plain settings on CPU here.
    return torch.optim.SGD(model.parameters(), lr=LR, foreach=True)


def _finish_round(state: State, acc: float, rnd: int, workdir: Path, clock: SideClock) -> None:
    """Write the tested global model's metrics row, mark the row, checkpoint."""
    with open(workdir / "metrics.jsonl", "a") as fh:
        fh.write(json.dumps({"round": rnd, "global_acc": acc}) + "\n")
    clock.row()
    save_atomically(state, workdir / "checkpoint.pt")


def _average(sums: State, total: int, like: State) -> State:
    return {k: (s / float(total)).to(like[k].dtype) for k, s in sums.items()}


def run_floor(
    w: Workload, rounds: int, workdir: Path, weights: Path, profile: str | None
) -> dict[str, Any]:
    """The one-process floor, `THREADS` intra-op threads."""
    clock = SideClock()
    torch.set_num_threads(THREADS)
    data, test = load_clients(w), load_test(w)
    model, state = initial_model()
    accs: list[float] = []
    with Profile(profile):
        clock.start_rounds()
        # Created on the clock, as HetFL creates its optimisers in round 1: PyTorch's first
        # optimiser construction imports torch._dynamo (about a second); both sides pay it.
        optimizer = _sgd(model)
        for rnd in range(1, rounds + 1):
            sums, total = train_clients(model, optimizer, state, sampled(w, rnd), data, rnd)
            state = _average(sums, total, state)
            model.load_state_dict(state)
            accs.append(test_accuracy(model, test))
            _finish_round(state, accs[-1], rnd, workdir, clock)
        clock.end()
    torch.save(state, weights)
    return {**clock.report(), "n_params": sum(v.numel() for v in state.values()), "acc": accs}


# -- two one-thread processes -------------------------------------------------------------------
class FedAvgWorker:
    """A floor2 worker: every client's data and the test set loaded, one model and its
    optimiser built; it trains its share of a round's clients and tests its share of the
    evaluation batches (`deal`: the clients hold equal shares in A and B, so equal costs)."""

    def __init__(self, w: Workload) -> None:
        self.w = w
        self.data, self.test = load_clients(w), load_test(w)
        self.model, _ = initial_model()
        self.optimizer = _sgd(self.model)

    def train(self, rnd: int, state: State, part: int) -> tuple[State, int]:
        mine = deal([(cid, 1.0) for cid in sampled(self.w, rnd)])[part]
        return train_clients(self.model, self.optimizer, state, mine, self.data, rnd)

    def evaluate(self, state: State, part: int) -> tuple[int, int]:
        starts = test_batch_starts(self.test)
        sizes = [min(EVAL_BATCH, int(self.test.y.shape[0]) - s) for s in starts]
        mine = deal(list(zip(starts, map(float, sizes), strict=True)))[part]
        self.model.load_state_dict(state)
        return test_batches(self.model, self.test, mine)


def run_floor_two_processes(
    w: Workload, rounds: int, workdir: Path, weights: Path, profile: str | None
) -> dict[str, Any]:
    """floor2: the round's clients and the test batches split between two one-thread worker
    processes; the parent adds their float64 sums (worker order), their correct counts, and
    checkpoints."""
    clock = SideClock()
    torch.set_num_threads(1)
    pair = WorkerPair(partial(FedAvgWorker, w))
    _, state = initial_model()
    pair.ready()
    parts = range(WORKERS)
    accs: list[float] = []
    with Profile(profile):
        clock.start_rounds()
        for rnd in range(1, rounds + 1):
            trained = pair.call("train", [(rnd, state, i) for i in parts])
            sums = {k: torch.stack([s[k] for s, _ in trained]).sum(0) for k in state}
            state = _average(sums, sum(n for _, n in trained), state)
            tested = pair.call("evaluate", [(state, i) for i in parts])
            accs.append(sum(c for c, _ in tested) / sum(n for _, n in tested))
            _finish_round(state, accs[-1], rnd, workdir, clock)
        pair.close()
        clock.end()
    torch.save(state, weights)
    return {**clock.report(), "n_params": sum(v.numel() for v in state.values()), "acc": accs}
