"""FedNova and the server optimisers against hand computations; local-only training."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from torch import nn

from hetfl.algorithms import ALGORITHMS
from hetfl.core.client.program import Programs
from hetfl.core.client.recipe import LocalRecipe
from hetfl.core.client.terms import ProximalTerm, StepNormaliser
from hetfl.core.rng import torch_generator
from hetfl.core.server.optimisers import ServerOptimizer, ServerOptSettings
from hetfl.core.spec import Spec, full_map
from hetfl.core.training import LocalTraining
from hetfl.core.types import ClientData, ClientInfo, ClientResult, ClientTask
from hetfl.engine.round_settings import RoundSettings
from hetfl.sim import Simulation
from strategies import trained

TRAIN = LocalTraining(lr=0.1, epochs=1, batch_size=16)


class _LinearBN(nn.Module):
    """Two parameters and BatchNorm buffers: the optimiser must move only the parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.bn = nn.BatchNorm1d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.fc(x))


class _Family:
    names = ("fc.weight", "fc.bias", "bn.weight", "bn.bias", "bn.running_mean",
             "bn.running_var", "bn.num_batches_tracked")  # fmt: skip

    def build(self, spec: Spec) -> nn.Module:
        return _LinearBN()

    def index_map(self, spec: Spec):
        return full_map(self.names)

    def global_spec(self, specs):
        return Spec(model="linear-bn")


def _strategy(name: str, **opts):
    strategy, _ = ALGORITHMS.get(name).build(_Family(), opts, clients_per_round=2, train=TRAIN)
    infos = [ClientInfo(cid, 10, (2,), (0, 1)) for cid in range(2)]
    state = strategy.setup(infos, torch_generator(0, 0, -1, "init"))
    tasks = strategy.plan(1, state, infos, torch_generator(0, 1, -1, "sample"))
    return strategy, tasks, state


def _result(cid: int, tensors, n: int, **extras) -> ClientResult:
    return ClientResult(cid, tensors, num_examples=n, num_steps=1, loss=0.0, extras=extras)


def _moved(state, updates):
    """Client weights w - g for parameter updates g; buffers set explicitly by the caller."""
    return {k: state[k] - updates[k] if k in updates else state[k].clone() for k in state}


# -- FedNova ------------------------------------------------------------------------------------
def test_fednova_unequal_steps_follows_the_unnormalised_rule():
    strategy, tasks, w = _strategy("fednova")
    w["fc.bias"] = torch.tensor([1.0, 2.0])
    # client A: 30 samples, 2 steps, update g_A; client B: 10 samples, 6 steps, update g_B
    g_a = {"fc.bias": torch.tensor([0.2, 0.4])}
    g_b = {"fc.bias": torch.tensor([0.6, -0.3])}
    a = _moved(w, g_a)
    b = _moved(w, g_b)
    a["bn.running_mean"] = torch.tensor([1.0, 1.0])
    b["bn.running_mean"] = torch.tensor([5.0, 9.0])
    results = [_result(0, a, 30, a_norm=2.0, steps=2), _result(1, b, 10, a_norm=6.0, steps=6)]
    new = strategy.aggregate(1, w, trained(tasks, results)).state
    # p = (0.75, 0.25); tau_eff = 0.75*2 + 0.25*6 = 3
    # sum p g / a = 0.75*(0.1, 0.2) + 0.25*(0.1, -0.05) = (0.1, 0.1375)
    # w - 3 * (0.1, 0.1375) = (0.7, 1.5875); FedAvg would give (0.7, 1.775)
    torch.testing.assert_close(new["fc.bias"], torch.tensor([0.7, 1.5875]))
    assert not torch.allclose(new["fc.bias"], torch.tensor([0.7, 1.775]))
    # untouched parameters stay (zero update), buffers take the sample-weighted average
    assert torch.equal(new["fc.weight"], w["fc.weight"])
    torch.testing.assert_close(new["bn.running_mean"], torch.tensor([2.0, 3.0]))


def test_fednova_prox_uses_step_counts_for_tau_eff():
    strategy, tasks, w = _strategy("fednova", mu=0.5)
    w["fc.bias"] = torch.tensor([0.0, 0.0])
    a = _moved(w, {"fc.bias": torch.tensor([0.4, 0.0])})
    b = _moved(w, {"fc.bias": torch.tensor([0.0, 0.9])})
    results = [_result(0, a, 10, a_norm=1.6, steps=2), _result(1, b, 10, a_norm=3.0, steps=4)]
    new = strategy.aggregate(1, w, trained(tasks, results)).state
    # tau_eff = 0.5*2 + 0.5*4 = 3; sum p g/a = (0.5*0.4/1.6, 0.5*0.9/3) = (0.125, 0.15)
    torch.testing.assert_close(new["fc.bias"], torch.tensor([-0.375, -0.45]))


def test_fednova_equal_plain_sgd_steps_is_fedavg():
    nova, nova_tasks, w = _strategy("fednova")
    avg, avg_tasks, avg_w = _strategy("fedavg")
    gen = torch.Generator().manual_seed(3)
    results = []
    for cid, n in ((0, 13), (1, 29)):
        upd = {k: torch.randn(v.shape, generator=gen) for k, v in w.items()
               if v.is_floating_point() and "running" not in k}  # fmt: skip
        results.append(_result(cid, _moved(w, upd), n, a_norm=4.0, steps=4))
    a = nova.aggregate(1, w, trained(nova_tasks, results)).state
    b = avg.aggregate(1, avg_w, trained(avg_tasks, results)).state
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("momentum", "mu", "lr", "steps"),
    [(0.0, 0.0, 0.1, 5), (0.9, 0.0, 0.1, 5), (0.0, 0.5, 0.2, 4), (0.5, 0.5, 0.2, 3)],
)
def test_client_normaliser_follows_the_recursion(momentum, mu, lr, steps):
    x = torch.randn(40, 2, generator=torch.Generator().manual_seed(0))
    y = (x[:, 0] > 0).long()
    data = ClientData(0, x, y, x[:0], y[:0], 2)
    config = LocalTraining(lr=lr, steps=steps, batch_size=8, momentum=momentum)
    task = ClientTask(0, Spec(model="linear-bn"), {}, full_map(_Family.names), config)
    recipe = LocalRecipe(grad_transforms=(ProximalTerm(mu),), trackers=(StepNormaliser(mu),))
    program = Programs(_Family(), recipe).program_for(0)
    generator = torch_generator(0, 1, 0, "train")
    extras = program.fit(task, data, {}, generator, info=data.info()).result.extras
    rho, q = momentum, 1 - lr * mu
    if momentum == 0 and mu == 0:
        expected = steps
    elif mu == 0:  # sum over steps t of (1 - rho^t) / (1 - rho)
        expected = sum((1 - rho**t) / (1 - rho) for t in range(1, steps + 1))
    elif momentum == 0:  # geometric series of (1 - lr mu)
        expected = (1 - q**steps) / (lr * mu)
    else:  # both: a <- (a + c_t) q + 1 with c_t = (1 - rho^t) / (1 - rho)
        expected = 0.0
        for t in range(1, steps + 1):
            expected = (expected + (1 - rho**t) / (1 - rho)) * q + 1
    assert extras["steps"] == steps
    assert math.isclose(extras["a_norm"], expected, rel_tol=1e-12)


def test_fednova_result_without_normaliser_is_a_clear_error():
    strategy, tasks, w = _strategy("fednova")
    with pytest.raises(KeyError, match="StepNormaliser tracker"):
        strategy.aggregate(1, w, trained(tasks, [_result(0, dict(w), 10)]))


@pytest.mark.parametrize("name", ["fednova", "fedalrc"])
def test_normalised_methods_refuse_kept_momentum(name):
    train = replace(TRAIN, momentum=0.9, keep_momentum=True)
    with pytest.raises(ValueError, match="keep_momentum cannot be used"):
        ALGORITHMS.get(name).build(_Family(), {}, clients_per_round=2, train=train)


# -- server optimisers ----------------------------------------------------------------------------
def _two_rounds(kind: str, **settings):
    """Two server steps on one scalar parameter with pseudo-gradients 0.5 and -0.2."""
    opt = ServerOptimizer(ServerOptSettings(kind=kind, **settings))
    w0 = {"p": torch.tensor([1.0], dtype=torch.float64)}
    w1 = opt.step(w0, {"p": torch.tensor([0.5], dtype=torch.float64)})
    w2 = opt.step(w1, {"p": torch.tensor([-0.2], dtype=torch.float64)})
    return float(w1["p"]), float(w2["p"]), opt


def test_adagrad_two_rounds_by_hand():
    w1, w2, opt = _two_rounds("adagrad", lr=0.1, tau=1e-3, v0=1e-6)
    v1 = 1e-6 + 0.25
    v2 = v1 + 0.04
    assert math.isclose(w1, 1.0 + 0.1 * 0.5 / (math.sqrt(v1) + 1e-3), rel_tol=1e-12)
    assert math.isclose(w2, w1 + 0.1 * -0.2 / (math.sqrt(v2) + 1e-3), rel_tol=1e-12)
    assert math.isclose(float(opt.v["p"]), v2, rel_tol=1e-12)
    assert opt.m == {}  # beta1 = 0: no momentum kept


def test_adam_two_rounds_by_hand():
    w1, w2, opt = _two_rounds("adam", lr=0.1, beta1=0.9, beta2=0.99, tau=1e-3, v0=0.0)
    m1, v1 = 0.1 * 0.5, 0.01 * 0.25
    m2, v2 = 0.9 * m1 + 0.1 * -0.2, 0.99 * v1 + 0.01 * 0.04
    assert math.isclose(w1, 1.0 + 0.1 * m1 / (math.sqrt(v1) + 1e-3), rel_tol=1e-12)
    assert math.isclose(w2, w1 + 0.1 * m2 / (math.sqrt(v2) + 1e-3), rel_tol=1e-12)
    assert math.isclose(float(opt.m["p"]), m2, rel_tol=1e-12)


def test_yogi_two_rounds_by_hand():
    w1, w2, opt = _two_rounds("yogi", lr=0.01, beta1=0.9, beta2=0.99, tau=1e-3)
    v0 = 1e-6  # tau^2 by default
    m1 = 0.1 * 0.5
    v1 = v0 - 0.01 * 0.25 * math.copysign(1, v0 - 0.25)  # v grows: v0 < delta^2
    m2 = 0.9 * m1 + 0.1 * -0.2
    v2 = v1 - 0.01 * 0.04 * math.copysign(1, v1 - 0.04)
    assert math.isclose(w1, 1.0 + 0.01 * m1 / (math.sqrt(v1) + 1e-3), rel_tol=1e-12)
    assert math.isclose(w2, w1 + 0.01 * m2 / (math.sqrt(v2) + 1e-3), rel_tol=1e-12)
    assert math.isclose(float(opt.v["p"]), v2, rel_tol=1e-12)


def test_fedadam_moves_parameters_and_averages_buffers():
    strategy, tasks, w = _strategy("fedadam", server_lr=0.1, v0=0.0)
    up = {"fc.bias": torch.tensor([0.3, -0.1])}
    a = _moved(w, up)
    a["bn.running_var"] = torch.tensor([3.0, 5.0])
    new = strategy.aggregate(
        1, w, trained(tasks, [_result(0, a, 10), _result(1, dict(a), 10)])
    ).state
    delta = -up["fc.bias"]  # pseudo-gradient: average minus current
    m, v = 0.1 * delta, 0.01 * delta**2
    torch.testing.assert_close(new["fc.bias"], w["fc.bias"] + 0.1 * m / (v.sqrt() + 1e-3))
    assert torch.equal(new["bn.running_var"], torch.tensor([3.0, 5.0]))
    assert torch.equal(new["fc.weight"], w["fc.weight"])  # zero pseudo-gradient, no move
    assert set(strategy.extra_state()["server_opt"]["m"]) == set(strategy._parameter_names())


@pytest.mark.parametrize(
    "settings",
    [{"kind": "lamb"}, {"lr": 0.0}, {"beta1": 1.0}, {"kind": "adam", "tau": 0.0}, {"v0": -1.0}],
)
def test_bad_server_settings_are_refused(settings):
    with pytest.raises(ValueError):
        ServerOptSettings(**settings)


# -- local-only -----------------------------------------------------------------------------------
def test_local_only_shares_nothing_and_learns_locally(synthetic_federation, tmp_path):
    family, clients, test = synthetic_federation
    strategy, recipe = ALGORITHMS.get("local-only").build(
        family, None, clients_per_round=len(clients), train=TRAIN
    )
    sim = Simulation(
        strategy,
        Programs(family, recipe),
        clients,
        test,
        RoundSettings(rounds=3, seed=0, local_eval="all"),
        tmp_path,
    )
    summary = sim.run()
    final = summary["final"]
    assert final["bytes_down"] == 0 and final["bytes_up"] == 0
    assert final["global_acc"] is None
    assert final["local_acc"] > 0.3  # 10 classes: chance is 0.1
    assert len(sim.store) == len(clients)
    w0, w1 = sim.store.get(0), sim.store.get(1)
    assert not torch.equal(w0[next(iter(w0))], w1[next(iter(w1))])  # each its own model
