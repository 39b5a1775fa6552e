"""The HeteroFL floor of workload H, written directly in PyTorch (Diao, Ding and Tarokh,
"HeteroFL: Computation and Communication Efficient Federated Learning for Heterogeneous
Clients", ICLR 2021, §3), on FLANC's Fashion-MNIST CNN (Mei et al., NeurIPS 2022,
supplementary §1.2), as HetFL's `heterofl` runs it:

- one plain module per width r (a 64-channel stem no width changes, two 3x3 convs of
  ceil(128 r) channels with ReLU and 2x2 max-pool, a linear head), named as HetFL's
  `flanc-cnn`, so that a width's tensors are the leading slices `W[:out, :in]` of the
  global ones of the same name;
- static BatchNorm (sBN): training normalises with batch statistics and keeps no running
  statistics; HeteroFL's scaler divides the sliced layers' activations by r in training;
- each client trains its fixed width (clients in id order take the widths narrowest first,
  in equal shares), clipping the gradient norm at 1 as the authors' code does;
- aggregation: per global element, the plain mean over the clients whose slice covers it
  (weight 1 each), accumulated in float64; elements no client covers keep their value;
- evaluation of every width, widest first: an evaluation module with running statistics,
  reset and re-estimated in train mode over the fixed statistics subsample (PyTorch's
  cumulative average, momentum None, as the authors' `stats` does), then tested.

Data, the subsample, the width assignment and the initial weights come from HetFL's own
functions, so that both sides see the same tensors; the round's work is plain PyTorch.

`run_floor_heterofl` is the one-process, two-thread floor the ratio is taken against;
`run_floor_heterofl_two_processes` (`floor2`) deals the clients and the widths' evaluations
between two one-thread worker processes (`bench_worker_pair`), balanced by their
multiply-accumulates, each returning its clients' float64 sums and coverage counts, which
the parent combines in worker order as the one-process floor combines one client after
another.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from bench_floor_fedavg import pixels_of
from bench_side import Profile, SideClock, save_atomically
from bench_worker_pair import WORKERS, WorkerPair, deal
from bench_workloads import BATCH, EVAL_BATCH, LR, SEED, THREADS, Workload
from torch import nn

from hetfl.algorithms.parts.width_assignment import assign_in_proportion
from hetfl.core.init import build_model, initialize
from hetfl.core.pixels import PixelNorm
from hetfl.core.rng import SERVER, numpy_generator, torch_generator
from hetfl.data import build_clients, global_test, iid, load_fashion_mnist
from hetfl.data.views import ClientView
from hetfl.engine.statistics import STATS_BATCH, client_stats_input, stats_shares
from hetfl.models import make_family

State = dict[str, torch.Tensor]
#: HeteroFL's gradient-norm clipping (the authors' code), HetFL's default for `heterofl`.
CLIP = 1.0
#: Fashion-MNIST's classes: floor2's parent builds the initial state without the data.
NUM_CLASSES = 10


class Unit(nn.Module):
    """conv 3x3 (no bias) -> (scaler) -> BatchNorm -> (ReLU, 2x2 max-pool). `static`: no
    running statistics (sBN); `scale`: HeteroFL's scaler, 1/scale in training."""

    def __init__(self, cin: int, cout: int, *, static: bool, scale: float, pool: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(cout, track_running_stats=not static)
        self.scale, self.pool = scale, pool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        if self.training and self.scale != 1.0:  # x / 1 is x: skipped at full width
            x = x / self.scale
        x = self.norm(x)
        return F.max_pool2d(torch.relu(x), 2) if self.pool else x


def channels(ratio: float) -> int:
    """The sliced convolutions' channels at width `ratio` (HetFL's `channels(ratio, 128)`)."""
    return max(1, math.ceil(round(ratio * 128, 9)))


def width_macs(ratio: float) -> int:
    """Multiply-accumulates of one 28x28 image's forward pass at width `ratio` (the stem
    and the first sliced conv at 28x28, the second at 14x14, the head): what `deal`
    balances the workers by."""
    c = channels(ratio)
    return 28 * 28 * 9 * (64 + 64 * c) + 14 * 14 * 9 * c * c + c * 7 * 7 * 10


class FlancNet(nn.Module):
    """FLANC's CNN at width `ratio`: for training (`static`, with the scaler) or for
    evaluation (running statistics, no scaler)."""

    def __init__(self, ratio: float, *, static: bool) -> None:
        super().__init__()
        c = channels(ratio)
        scale = ratio if static else 1.0
        self.stem = Unit(1, 64, static=static, scale=1.0, pool=False)
        self.conv2 = Unit(64, c, static=static, scale=scale, pool=True)
        self.conv3 = Unit(c, c, static=static, scale=scale, pool=True)
        self.head = nn.Linear(c * 7 * 7, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv3(self.conv2(self.stem(x))).flatten(1))


def prefix(shape: torch.Size) -> tuple[slice, ...]:
    return tuple(slice(0, s) for s in shape)


@torch.no_grad()
def load_slices(model: nn.Module, state: State) -> None:
    """The model's parameters set to the leading slices of the global tensors."""
    for name, p in model.named_parameters():
        p.copy_(state[name][prefix(p.shape)])


class Setup:
    """What the floor prepares before round 1 (HetFL's data and starting point)."""

    def __init__(self, w: Workload) -> None:
        ds = load_fashion_mnist()
        parts = iid(ds.y_train, w.clients, numpy_generator(SEED, 0, SERVER, "partition"))
        views = [ClientView(samples=w.samples)] * w.clients
        clients = build_clients(ds, parts, 0, SEED, "cpu", views)
        for c in clients:
            if len(c.labels) != ds.num_classes:
                raise ValueError(
                    f"client {c.cid} holds classes {c.labels}: this floor has no label-split "
                    "masks, so every client must hold every class (IID data)"
                )
        #: Inputs are uint8 pixels, standardised per batch as HetFL standardises them.
        self.pixels = pixels_of(ds)
        self.xs = [c.x_train for c in clients]
        self.ys = [c.y_train for c in clients]
        self.test = global_test(ds, "cpu", w.test_samples, SEED)
        self.level = assign_in_proportion(range(w.clients), sorted(w.levels), None)
        shares = stats_shares({c.cid: c.n_train for c in clients}, w.stats_samples)
        self.stats_batches = [
            part[s : s + STATS_BATCH]
            for cid, share in shares.items()
            if share
            for part in [client_stats_input(self.xs[cid], share, SEED, cid)]
            for s in range(0, share, STATS_BATCH)
        ]
        self.state = initial_state(w, ds.num_classes)


def initial_state(w: Workload, num_classes: int) -> State:
    """HetFL's initial global state of the workload's model (the run's "init" generator)."""
    family = make_family(w.model, (1, 28, 28), num_classes)
    spec = family.global_spec([]).replace(bn="static", scaler=True)
    init = initialize(build_model(family, spec), torch_generator(SEED, 0, SERVER, "init"))
    return {k: v.detach().clone() for k, v in init.state_dict().items()}


def train_client(
    model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
    pixels: PixelNorm, rnd: int, cid: int,
) -> None:  # fmt: skip
    """One epoch of client `cid` in round `rnd`, HetFL's batch order."""
    model.train()
    n = int(y.shape[0])
    perm = torch.randperm(n, generator=torch_generator(SEED, rnd, cid, "train"))
    params = list(model.parameters())
    for s in range(0, n, BATCH):
        idx = perm[s : s + BATCH]
        loss = F.cross_entropy(model(pixels(x[idx])), y[idx])
        optimizer.zero_grad(set_to_none=False)
        loss.backward()
        nn.utils.clip_grad_norm_(params, CLIP)
        optimizer.step()


class Average:
    """Per global element, the mean over the clients whose slice covers it (weight 1 each),
    summed in float64 in client-id order; elements no client covers keep their value."""

    def __init__(self, state: State) -> None:
        self.sums = {k: torch.zeros(v.shape, dtype=torch.float64) for k, v in state.items()}
        self.counts = {k: torch.zeros(v.shape, dtype=torch.float64) for k, v in state.items()}

    def add(self, trained: Mapping[str, torch.Tensor]) -> None:
        """One client's trained tensors (leading slices of the global ones)."""
        for name, v in trained.items():
            region = prefix(v.shape)
            self.sums[name][region] += v.detach().double()
            self.counts[name][region] += 1.0

    def result(self, state: State) -> State:
        return combine([(self.sums, self.counts)], state)


def combine(parts: Sequence[tuple[State, State]], state: State) -> State:
    """The new global state from `Average`s' (sums, counts), added in the given order (the
    workers'): where any client covered an element, its summed values over its count;
    elsewhere `state`'s value. One part gives `Average.result` exactly; two parts differ
    from one client after another by float64 rounding of the sums only."""
    out = {}
    for k, prev in state.items():
        sums = sum((s[k] for s, _ in parts), start=torch.zeros(prev.shape, dtype=torch.float64))
        counts = sum((c[k] for _, c in parts), start=torch.zeros(prev.shape, dtype=torch.float64))
        hit = counts > 0
        mean = sums / torch.where(hit, counts, 1.0)
        out[k] = torch.where(hit, mean, prev.double()).to(prev.dtype)
    return out


@torch.no_grad()
def test_width(model: nn.Module, state: State, setup: Setup) -> float:
    """Width accuracy after the sBN statistics pass over the fixed subsample."""
    load_slices(model, state)
    model.train()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.reset_running_stats()
    for xb in setup.stats_batches:
        model(setup.pixels(xb))
    model.eval()
    x, y = setup.test
    correct, loss_sum = 0, 0.0  # the loss too, as HetFL's evaluation computes it
    for s in range(0, int(y.shape[0]), EVAL_BATCH):
        out, yb = model(setup.pixels(x[s : s + EVAL_BATCH])), y[s : s + EVAL_BATCH]
        loss_sum += float(F.cross_entropy(out, yb, reduction="sum"))
        correct += int((out.argmax(dim=1) == yb).sum())
    return correct / int(y.shape[0])


class Models:
    """One training module per width and one evaluation module per width, whose BatchNorm
    momentum is None (cumulative averages, as the authors' `stats` does)."""

    def __init__(self, widths: Sequence[float]) -> None:
        self.train = {r: FlancNet(r, static=True) for r in widths}
        self.eval = {r: FlancNet(r, static=False) for r in widths}
        for model in self.eval.values():
            for m in model.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.momentum = None

    def optimizers(self) -> dict[float, torch.optim.Optimizer]:
        return {
            r: torch.optim.SGD(m.parameters(), lr=LR, foreach=True) for r, m in self.train.items()
        }


def train_clients(
    models: Models, optimizers: dict[float, torch.optim.Optimizer], setup: Setup, state: State,
    rnd: int, cids: Sequence[int],
) -> Average:  # fmt: skip
    """Each client of `cids` trained from `state` at its width, added to an `Average` in
    the order of `cids`."""
    average = Average(state)
    for cid in cids:
        r = setup.level[cid]
        model = models.train[r]
        load_slices(model, state)
        train_client(model, optimizers[r], setup.xs[cid], setup.ys[cid], setup.pixels, rnd, cid)
        average.add(dict(model.named_parameters()))
    return average


def evaluate_widths(
    models: Models, state: State, setup: Setup, widths: Sequence[float]
) -> dict[str, float]:
    return {f"width={r:g}": test_width(models.eval[r], state, setup) for r in widths}


def _finish_round(
    state: State, by_width: dict[str, float], rnd: int, workdir: Path, clock: SideClock
) -> None:
    """Write the round's metrics row (every width's accuracy), mark the row, checkpoint."""
    with open(workdir / "metrics.jsonl", "a") as fh:
        fh.write(json.dumps({"round": rnd, "groups": by_width}) + "\n")
    clock.row()
    save_atomically(state, workdir / "checkpoint.pt")


def _report(
    clock: SideClock, state: State, accs: list[float], by_width: dict[str, float]
) -> dict[str, Any]:
    return {
        **clock.report(),
        "n_params": sum(v.numel() for v in state.values()),
        "acc": accs,
        "widths": by_width,
    }


def run_floor_heterofl(
    w: Workload, rounds: int, workdir: Path, weights: Path, profile: str | None
) -> dict[str, Any]:
    """The one-process floor, `THREADS` intra-op threads."""
    clock = SideClock()
    torch.set_num_threads(THREADS)
    setup = Setup(w)
    state = setup.state
    widths = sorted(w.levels, reverse=True)
    models = Models(widths)
    accs: list[float] = []
    by_width: dict[str, float] = {}
    with Profile(profile):
        clock.start_rounds()
        # Created on the clock, as HetFL creates its optimisers in round 1.
        optimizers = models.optimizers()
        for rnd in range(1, rounds + 1):
            # all clients every round (w.per_round == w.clients), in id order
            average = train_clients(models, optimizers, setup, state, rnd, range(w.clients))
            state = average.result(state)
            by_width = evaluate_widths(models, state, setup, widths)
            accs.append(by_width[f"width={widths[0]:g}"])
            _finish_round(state, by_width, rnd, workdir, clock)
        clock.end()
    torch.save(state, weights)
    return _report(clock, state, accs, by_width)


# -- two one-thread processes -------------------------------------------------------------------
class HeteroFLWorker:
    """A floor2 worker: the floor's whole setup and every width's modules built; it trains
    its share of the clients and evaluates its share of the widths, dealt by their
    multiply-accumulates (a client's: its width's per image, its samples alike)."""

    def __init__(self, w: Workload) -> None:
        self.w = w
        self.setup = Setup(w)
        self.widths = sorted(w.levels, reverse=True)
        self.models = Models(self.widths)
        self.optimizers = self.models.optimizers()

    def train(self, rnd: int, state: State, part: int) -> tuple[State, State]:
        costs = [(cid, float(width_macs(self.setup.level[cid]))) for cid in range(self.w.clients)]
        mine = deal(costs)[part]
        average = train_clients(self.models, self.optimizers, self.setup, state, rnd, mine)
        return average.sums, average.counts

    def evaluate(self, state: State, part: int) -> dict[str, float]:
        mine = deal([(r, float(width_macs(r))) for r in self.widths])[part]
        return evaluate_widths(self.models, state, self.setup, mine)


def run_floor_heterofl_two_processes(
    w: Workload, rounds: int, workdir: Path, weights: Path, profile: str | None
) -> dict[str, Any]:
    """floor2: the clients and the widths' evaluations split between two one-thread worker
    processes; the parent combines their sums and counts (`combine`) and checkpoints."""
    clock = SideClock()
    torch.set_num_threads(1)
    pair = WorkerPair(partial(HeteroFLWorker, w))
    state = initial_state(w, NUM_CLASSES)
    pair.ready()
    widths = sorted(w.levels, reverse=True)
    parts = range(WORKERS)
    accs: list[float] = []
    by_width: dict[str, float] = {}
    with Profile(profile):
        clock.start_rounds()
        for rnd in range(1, rounds + 1):
            state = combine(pair.call("train", [(rnd, state, i) for i in parts]), state)
            tested: dict[str, float] = {}
            for share in pair.call("evaluate", [(state, i) for i in parts]):
                tested.update(share)
            by_width = {f"width={r:g}": tested[f"width={r:g}"] for r in widths}  # widest first
            accs.append(by_width[f"width={widths[0]:g}"])
            _finish_round(state, by_width, rnd, workdir, clock)
        pair.close()
        clock.end()
    torch.save(state, weights)
    return _report(clock, state, accs, by_width)
