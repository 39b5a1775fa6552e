"""The composed strategy's seams: every reduction goes through the reducer part, the parts'
extra state round-trips and cannot collide, and the engine holds the global state."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from hetfl.core.client.program import Programs
from hetfl.core.rng import torch_generator
from hetfl.core.server.assign import PerGroup
from hetfl.core.server.optimisers import ServerOptimizer, ServerOptSettings
from hetfl.core.server.update import NormalisedStep, Optimised, pseudo_gradient
from hetfl.core.spec import Spec
from hetfl.core.state import Accumulator
from hetfl.core.training import LocalTraining
from hetfl.core.types import (
    ClientData,
    ClientInfo,
    ClientResult,
    ServerResult,
    Trained,
    TrainedRound,
)
from hetfl.engine.checkpoint import load_checkpoint
from hetfl.engine.round_settings import RoundSettings
from hetfl.models import PlainFamily
from hetfl.sim import Simulation
from strategies import fedavg, trained

FAMILY = PlainFamily("linear", (2,), 2)  # head.weight (2 x 2), head.bias (2)
INFOS = [ClientInfo(cid, 10, (2,), (0, 1)) for cid in range(2)]


class _Recording:
    """A reducer factory that records every reduction (its fill and how many entries were
    added) and reduces with the `Accumulator`."""

    def __init__(self) -> None:
        self.reductions: list[tuple[str, int]] = []

    def __call__(self, reference):
        return _RecordingReducer(self, reference)


class _RecordingReducer:
    def __init__(self, log: _Recording, reference) -> None:
        self.log, self.acc, self.added = log, Accumulator(reference), 0

    def add(self, local, index_map, weight, scale):
        self.added += 1
        self.acc.add(local, index_map, weight, scale)

    def result(self, previous, fill):
        self.log.reductions.append((fill, self.added))
        return self.acc.result(previous, fill)


def _results(state, steps=(2, 6)) -> list[ClientResult]:
    """Client k moves the bias by -(k + 1) * 0.1 after `steps[k]` plain SGD steps."""
    out = []
    for cid, s in enumerate(steps):
        tensors = {k: v.clone() for k, v in state.items()}
        tensors["head.bias"] -= 0.1 * (cid + 1)
        out.append(
            ClientResult(cid, tensors, 10 * (cid + 1), s, 0.0, extras={"a_norm": s, "steps": s})
        )
    return out


def _nova(**parts):
    step = Optimised(NormalisedStep(prox=False), ServerOptimizer(ServerOptSettings()))
    return fedavg(FAMILY, clients_per_round=2, train=LocalTraining(), server_update=step, **parts)


def _round(strategy):
    state = strategy.setup(INFOS, torch_generator(0, 0, -1, "init"))
    tasks = strategy.plan(1, state, INFOS, torch_generator(0, 1, -1, "sample"))
    return state, strategy.aggregate(1, state, trained(tasks, _results(state))).state


def test_every_reduction_of_a_round_goes_through_the_reducer() -> None:
    """FedNova reduces twice: the weights (fill keep, for the buffers) and the normalised
    deltas (fill zero); both must reach the reducer part, with both clients."""
    recording = _Recording()
    state, new = _round(_nova(reducer=recording))
    assert recording.reductions == [("keep", 2), ("zero", 2)]
    _, default = _round(_nova())
    for name in new:
        assert torch.equal(new[name], default[name]), name
    # by hand: p = (1/3, 2/3), tau_eff = 2/3 + 12/3 = 14/3,
    # sum p g / a = (1/3 * 0.1 / 2 + 2/3 * 0.2 / 6) = 0.0388..., bias -= tau_eff * that
    moved = state["head.bias"] - 14 / 3 * (0.1 / 6 + 0.4 / 18)
    torch.testing.assert_close(new["head.bias"], moved)


def _adam():
    settings = ServerOptSettings(kind="adam", lr=0.1, beta1=0.9, beta2=0.99)
    step = Optimised(pseudo_gradient, ServerOptimizer(settings))
    return fedavg(FAMILY, clients_per_round=2, train=LocalTraining(), server_update=step)


def test_server_moments_round_trip_through_extra_state() -> None:
    """A strategy restored from another's extra state takes the same next step, bit for bit;
    a fresh one (no moments) does not."""
    first = _adam()
    _, state1 = _round(first)
    saved = first.extra_state()
    assert set(saved["server_opt"]["m"]) == {"head.weight", "head.bias"}
    restored, fresh = _adam(), _adam()
    for s in (restored, fresh):
        s.setup(INFOS, torch_generator(0, 0, -1, "init"))
    restored.load_extra_state(saved)
    steps = []
    for s in (first, restored, fresh):
        tasks = s.plan(2, state1, INFOS, torch_generator(0, 2, -1, "sample"))
        steps.append(s.aggregate(2, state1, trained(tasks, _results(state1))).state)
    assert torch.equal(steps[0]["head.bias"], steps[1]["head.bias"])
    assert not torch.equal(steps[0]["head.bias"], steps[2]["head.bias"])


class _KeepsMoments:
    """A sampler that (wrongly) keeps its state under the server update's key."""

    def setup(self, clients):
        return None

    def sample(self, round, available, rng):
        return list(available)

    def extra_state(self):
        return {"server_opt": {}}

    def load_extra_state(self, state):
        return None


def test_two_parts_keeping_state_under_one_key_are_refused() -> None:
    strategy = _nova(sampler=_KeepsMoments())
    with pytest.raises(
        ValueError, match=r"two strategy parts keep extra state under \['server_opt'\]"
    ):
        strategy.extra_state()


def test_the_engine_holds_the_global_state_and_writes_no_strategy_attribute(tmp_path) -> None:
    g = torch.Generator().manual_seed(0)
    clients = [
        ClientData(
            c,
            torch.randn(8, 2, generator=g),
            torch.arange(8) % 2,
            torch.randn(2, 2, generator=g),
            torch.arange(2) % 2,
            2,
        )
        for c in range(2)
    ]
    test = (torch.randn(6, 2, generator=g), torch.arange(6) % 2)
    strategy = _adam()
    settings = RoundSettings(rounds=2, seed=0)
    program = Programs(FAMILY, seed=0)
    sim = Simulation(strategy, program, clients, test, settings, tmp_path)
    sim.setup()
    attributes, initial = dict(vars(strategy)), dict(sim.state)
    sim.run()
    assert set(vars(strategy)) == set(attributes) and not hasattr(strategy, "global_state")
    for name in ("sampler", "assignment", "aggregation", "evaluation", "extras", "capabilities"):
        assert vars(strategy)[name] is attributes[name], name
    ckpt = load_checkpoint(tmp_path / "checkpoints")
    assert set(ckpt["global"]) == set(sim.state) == set(initial)
    assert all(torch.equal(ckpt["global"][k], v) for k, v in sim.state.items())
    assert not torch.equal(sim.state["head.bias"], initial["head.bias"])
    assert set(ckpt["strategy"]) == {"server_opt"}


# -- assignment by group -------------------------------------------------------------------------
@dataclass(frozen=True)
class _SidePlan:
    spec: Spec
    members: tuple[int, ...]


def test_per_group_plans_every_group_once_from_its_members_in_key_order() -> None:
    sides = {0: 16, 1: 8, 2: 16, 3: 8, 4: 32}
    infos = [ClientInfo(cid, 10, (1, side, side), (0, 1)) for cid, side in sides.items()]
    calls = []

    def plan(members):
        calls.append(list(members))
        return {g: _SidePlan(Spec(side=g[0]), tuple(c.cid for c in m)) for g, m in members.items()}

    groups = PerGroup(lambda info: (info.input_shape[1],), plan)
    groups.setup(infos)
    assert calls == [[(8,), (16,), (32,)]]  # one call, keys sorted
    assert {g: p.members for g, p in groups.plans.items()} == {
        (8,): (1, 3),
        (16,): (0, 2),
        (32,): (4,),
    }
    assert [groups.spec_of(c)["side"] for c in infos] == [16, 8, 16, 8, 32]
    rng = torch_generator(0, 1, -1, "sample")
    assert groups.spec_in_round(1, infos[4], rng) == Spec(side=32)
    assert [s["side"] for s in groups.possible_specs()] == [16, 8, 16, 8, 32]  # per client
    with pytest.raises(KeyError, match=r"client 9 is in group \(64,\), which no client had"):
        groups.spec_of(ClientInfo(9, 10, (1, 64, 64), (0, 1)))


def test_a_trained_round_refuses_results_out_of_order_or_paired_with_another_task() -> None:
    """`TrainedRound` is what an engine hands `aggregate`; an engine that orders or pairs
    results wrongly would write them through the wrong map, so the record refuses it."""
    strategy = fedavg(FAMILY, clients_per_round=2, train=LocalTraining())
    state = strategy.setup(INFOS, torch_generator(0, 0, -1, "init"))
    tasks = strategy.plan(1, state, INFOS, torch_generator(0, 1, -1, "sample"))
    results = _results(state)
    pairs = [Trained(t, r) for t, r in zip(tasks, results, strict=True)]
    with pytest.raises(ValueError, match=r"distinct and in id order, got \[1, 0\]"):
        TrainedRound(tuple(reversed(pairs)))
    with pytest.raises(ValueError, match=r"another client's task: \[\(0, 1\)\]"):
        TrainedRound((Trained(tasks[0], results[1]),))
    served = (ServerResult(0, {}),)
    with pytest.raises(ValueError, match=r"server results for clients \[0\], trained clients"):
        TrainedRound(tuple(pairs), server_results=served)
    assert strategy.aggregate(1, state, TrainedRound(tuple(pairs))).state.keys() == state.keys()
