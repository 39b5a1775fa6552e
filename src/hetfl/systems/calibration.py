"""One job: the compute scale of a run's device profiles at which one method's simulated
time to a target is a given multiple of another's, priced from the cost model alone.

DTFL's Table 3 ("Speed up Federated Learning in Heterogeneous Environment: A Dynamic Tiering
Approach", §4.2: CIFAR-10 IID, ResNet-56) has SplitFed reach the target in 35,877 s and
FedAvg in 13,157 s: 2.73x. SplitFed learns as FedAvg does (the same rounds to the target),
so the ratio of their times is a ratio of round times, and under the simulated clock
(`hetfl.systems.clock`) a round's time is MACs over compute rates plus bytes over links: it
is set by the ratio of compute rate to link speed, which a reduced-scale setting fixes
arbitrarily. Pricing one round of each client (`priced_round`: its training passes and its
server side's by `MacCounter`, its payload, upload and per-batch channel by their bytes)
needs no training, and the round times at any scale follow from the same formula the clock
uses.

A scale c multiplies every compute rate, the clients' and the server's; the links stay. (c
on the rates is 1/c on the links up to a factor common to every time, so a ratio of times
depends on c alone.) `solve_scale` finds the c at which the ratio meets the target: a grid
of log-spaced scales brackets the first crossing, bisection narrows it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from hetfl.core.init import build_model
from hetfl.core.spec import Spec, local_names
from hetfl.core.state import state_bytes
from hetfl.core.types import ClientTask, PassRecord
from hetfl.systems.clock import transfer_s
from hetfl.systems.costs import MacCounter
from hetfl.systems.profiles import DeviceProfile


@dataclass(frozen=True)
class RoundCost:
    """One client's round as the engine charges it: its training MACs, its server side's
    MACs, the bytes it receives and sends, and whether its two sides run in parallel."""

    macs: int
    server_macs: int = 0
    bytes_down: int = 0
    bytes_up: int = 0
    parallel: bool = False


def batch_sizes(task: ClientTask, n_train: int) -> dict[int, int]:
    """Batch size -> batches of that size in one round of `task` (each epoch's last
    batch short, as the local loop deals them)."""
    config = task.config
    b = config.batch_size
    if config.steps is not None:
        return {b: config.steps}
    out = {b: config.epochs * (n_train // b)}
    if n_train % b:
        out[n_train % b] = out.get(n_train % b, 0) + config.epochs
    return {size: n for size, n in out.items() if n}


def priced_round(
    counter: MacCounter,
    task: ClientTask,
    n_train: int,
    input_shape: tuple[int, ...],
    server: Spec | None = None,
    *,
    answers: bool = False,
    parallel: bool = False,
) -> RoundCost:
    """The cost of `task` for a client of `n_train` samples: the payload down, the
    tensors its index map names up, its training passes; with a `server` spec (split
    learning), each batch's activation and int64 labels up, the activation's gradient
    down when the server `answers`, and the server side's passes over the activation."""
    batches = batch_sizes(task, n_train)
    passes = [PassRecord(task.spec, "train", b, n) for b, n in batches.items()]
    sent = local_names(task.index_map)
    down = state_bytes(task.payload)
    up = state_bytes({k: task.payload[k] for k in sent})
    if server is None:
        return RoundCost(counter.price(passes, input_shape), 0, down, up, parallel)
    model = build_model(counter.family, task.spec).eval()
    with torch.no_grad():
        z = model(torch.zeros((1, *input_shape)))
    if isinstance(z, tuple):  # a client with a head returns (logits, activation)
        z = z[-1]
    cut = tuple(z.shape[1:])
    per_sample = z[0].numel() * z.element_size()
    label = torch.empty((), dtype=torch.int64).element_size()
    samples = sum(b * n for b, n in batches.items())
    up += samples * (per_sample + label)
    if answers:
        down += samples * per_sample
    kind = "train+input" if answers else "train"
    served = [PassRecord(server, kind, b, n) for b, n in batches.items()]
    return RoundCost(
        counter.price(passes, input_shape), counter.price(served, cut), down, up, parallel
    )


def client_seconds(
    cost: RoundCost, profile: DeviceProfile, server_rate: float, scale: float = 1.0
) -> float:
    """The clock's total for one client (`hetfl.systems.clock.Clock.client_times`), with
    every compute rate multiplied by `scale`."""
    compute = cost.macs / (profile.rate * scale)
    served = cost.server_macs / (server_rate * scale)
    sides = max(compute, served) if cost.parallel else compute + served
    comm = transfer_s(cost.bytes_down, profile.down_mbps) + transfer_s(
        cost.bytes_up, profile.up_mbps
    )
    return comm + sides


def time_to(
    costs: Mapping[int, RoundCost],
    profiles: Sequence[Mapping[int, DeviceProfile]],
    server_rate: float,
    scale: float = 1.0,
) -> float:
    """Simulated seconds of the rounds whose profiles are `profiles` (one mapping of
    client -> profile per round), every client of `costs` taking part: each round lasts as
    long as its slowest client."""
    return sum(
        max(client_seconds(cost, at[cid], server_rate, scale) for cid, cost in costs.items())
        for at in profiles
    )


def solve_scale(
    ratio: Callable[[float], float],
    target: float,
    low: float = 1e-4,
    high: float = 1e4,
    steps: int = 161,
    rel: float = 1e-6,
) -> float:
    """The smallest scale in [low, high] at which `ratio(scale)` equals `target`, or a
    ValueError naming the range the ratio spans there."""
    if not (0 < low < high and target > 0):
        raise ValueError(f"need 0 < low < high and target > 0, got {low}, {high}, {target}")
    grid = [low * (high / low) ** (i / (steps - 1)) for i in range(steps)]
    values = [ratio(c) for c in grid]
    for i in range(steps - 1):
        a, fa, b, fb = grid[i], values[i], grid[i + 1], values[i + 1]
        if (fa - target) * (fb - target) <= 0:
            while b / a > 1 + rel:
                mid = math.sqrt(a * b)
                if (ratio(mid) - target) * (fa - target) <= 0:
                    b = mid
                else:
                    a, fa = mid, ratio(mid)
            return math.sqrt(a * b)
    raise ValueError(
        f"the ratio never reaches {target:g} for scales {low:g}..{high:g}: it spans "
        f"{min(values):.4g}..{max(values):.4g}"
    )
