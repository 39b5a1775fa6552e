"""FedALRC and Ada-FedALRC against hand computations; the LIBSVM reader."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from hetfl.algorithms import ALGORITHMS
from hetfl.algorithms.fednova import StepNormaliser
from hetfl.config import ConfigError, expand_sweep, load_raw, validate
from hetfl.core.client.loop import batch_order
from hetfl.core.client.program import Programs
from hetfl.core.client.recipe import LocalRecipe, TrainContext
from hetfl.core.client.regularisers import (
    PartialSVT,
    RademacherTerm,
    partial_svt,
    rademacher_term,
)
from hetfl.core.rng import torch_generator
from hetfl.core.spec import Spec, full_map
from hetfl.core.training import LocalTraining
from hetfl.core.types import ClientData, ClientInfo, ClientResult, ClientTask, TrainedRound
from hetfl.data import PARTITIONERS, build_clients, global_test, load_libsvm, load_synthetic
from hetfl.engine.round_settings import RoundSettings
from hetfl.models import PlainFamily
from hetfl.sim import Simulation
from strategies import trained

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _signs(cid: int, step: int, q: int, b: int, c: int) -> torch.Tensor:
    """Injected Rademacher signs, a fixed function of (client, step)."""
    g = torch.Generator().manual_seed(1000 * cid + step)
    return torch.randint(0, 2, (q, b, c), generator=g) * 2 - 1


def _injected(q: int, b: int, c: int, ctx: TrainContext) -> torch.Tensor:
    return _signs(ctx.task.cid, ctx.step, q, b, c)


def _ctx(cid: int = 0, step: int = 0) -> TrainContext:
    task = ClientTask(cid, Spec(model="t"), {}, [], LocalTraining(lr=0.1))
    return TrainContext(task, {}, torch.Generator(), LocalTraining(lr=0.1), step=step)


def _deep(term: RademacherTerm) -> LocalRecipe:
    """FedALRC's deep recipe around `term`: the term, FedNova's counter, the term's count."""
    return LocalRecipe(loss_terms=(term,), trackers=(StepNormaliser(), term))


def _two_class_data(cid: int, n: int, d: int = 3, seed: int = 0) -> ClientData:
    g = torch.Generator().manual_seed(seed + cid)
    x = torch.randn(n, d, generator=g)
    y = (x[:, 0] + 0.3 * x[:, 1] > 0).long()
    return ClientData(cid, x, y, x[:0], y[:0], 2)


# -- the Rademacher term ----------------------------------------------------------------------
def test_rademacher_term_and_gradient_by_hand():
    w = torch.tensor([[0.5, -1.0, 2.0], [1.5, 0.25, -0.5]], requires_grad=True)  # (C, D)
    bias = torch.tensor([0.1, -0.2], requires_grad=True)
    x = torch.tensor([[1.0, 2.0, 0.0], [0.0, -1.0, 1.0], [3.0, 0.5, -2.0], [1.0, 1.0, 1.0]])
    signs = _signs(0, 0, 3, 4, 2)  # (Q, B, C)
    out = x @ w.T + bias  # (B, C)
    term = rademacher_term(out, signs)
    term.backward()
    q, b, c = signs.shape
    f = out.detach().tolist()
    e = signs.tolist()
    value = sum(e[k][i][j] * f[i][j] for k in range(q) for i in range(b) for j in range(c))
    assert math.isclose(float(term.detach()), value / (q * b * c), rel_tol=1e-6)
    # d/dW[j, d] = (1/(QBC)) sum_{q,i} eps[q,i,j] x[i,d]; d/db[j] = (1/(QBC)) sum eps[q,i,j]
    for j in range(c):
        for dd in range(3):
            hand = sum(e[k][i][j] * float(x[i, dd]) for k in range(q) for i in range(b))
            assert math.isclose(float(w.grad[j, dd]), hand / (q * b * c), abs_tol=1e-7)
        hand_b = sum(e[k][i][j] for k in range(q) for i in range(b))
        assert math.isclose(float(bias.grad[j]), hand_b / (q * b * c), abs_tol=1e-7)


def test_gate_switches_the_term_on_and_off():
    term = RademacherTerm(alpha=0.5, q=2, radius=1.0, signs=_injected)
    out = torch.tensor([[1.0, -2.0], [0.5, 3.0]], requires_grad=True)
    expected = 0.5 * rademacher_term(out, _signs(0, 0, 2, 2, 2))
    at_radius = torch.tensor([1.0, 1.0])  # mean square 1.0 <= r: on
    one_large = torch.tensor([0.1, 1.4])  # mean square 0.985: the gate is per batch, on
    above = torch.tensor([0.2, 1.6])  # mean 0.9 but mean square 1.3 > r: off
    ctx = _ctx()
    for losses in (at_radius, one_large):
        added = term(out, torch.tensor([0, 1]), losses, ctx)
        assert added is not None and torch.equal(added, expected)
    assert term(out, torch.tensor([0, 1]), above, ctx) is None
    assert term.finish(ctx) == {"regularised_steps": 2}
    ungated = RademacherTerm(alpha=0.5, q=2, gated=False, signs=_injected)  # FedALRC-g
    assert torch.equal(ungated(out, torch.tensor([0, 1]), above * 10, _ctx()), expected)
    assert RademacherTerm(alpha=0.0)(out, torch.tensor([0, 1]), at_radius, _ctx()) is None


def _fit(recipe, data: ClientData, payload, config) -> tuple[dict, dict]:
    family = PlainFamily("linear", (3,), 2)
    task = ClientTask(data.cid, family.global_spec([]), payload, full_map(payload), config)
    generator = torch_generator(0, 1, data.cid, "train")
    out = (
        Programs(family, recipe)
        .program_for(data.cid)
        .fit(task, data, {}, generator, info=data.info())
    )
    return out.result.tensors, out.result.extras


def test_gate_open_changes_training_and_a_closed_gate_does_not():
    data = _two_class_data(0, 24)
    config = LocalTraining(lr=0.1, epochs=1, batch_size=8)
    small = {"head.weight": torch.zeros(2, 3), "head.bias": torch.zeros(2)}  # loss ln 2: open
    on, extras = _fit(_deep(RademacherTerm(0.5, 5, signs=_injected)), data, small, config)
    off, _ = _fit(_deep(RademacherTerm(0.0)), data, small, config)
    assert extras["regularised_steps"] == 3  # every batch: (ln 2)^2 < 1
    assert not torch.allclose(on["head.weight"], off["head.weight"])
    # weights fitted to the opposite labels: every per-sample loss is large, the gate stays shut
    opposite = torch.tensor([[8.0, 2.4, 0.0], [-8.0, -2.4, 0.0]])
    wrong = {"head.weight": opposite, "head.bias": torch.zeros(2)}
    shut, extras = _fit(_deep(RademacherTerm(0.5, 5, signs=_injected)), data, wrong, config)
    plain, _ = _fit(_deep(RademacherTerm(0.0)), data, wrong, config)
    assert extras["regularised_steps"] == 0
    assert torch.equal(shut["head.weight"], plain["head.weight"])


# -- singular-value thresholding ----------------------------------------------------------------
def _orthogonal(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    return q


@pytest.mark.parametrize(
    ("keep", "expected"),
    [
        (1, [3.0, 1.9, 0.4, 0.0]),  # only the tail shrinks, 0.05 stops at zero
        (0, [2.9, 1.9, 0.4, 0.0]),  # theta = 0: every singular value (FedALRC-g)
        (4, [3.0, 2.0, 0.5, 0.05]),  # theta = min(D, C): nothing shrinks
    ],
)
def test_partial_svt_by_hand(keep, expected):
    u, v = _orthogonal(4, 0), _orthogonal(6, 1)[:, :4]
    sigma = torch.tensor([3.0, 2.0, 0.5, 0.05], dtype=torch.float64)
    w = u @ torch.diag(sigma) @ v.T  # (4, 6) with known singular vectors
    out = partial_svt(w, keep, 0.1)
    target = u @ torch.diag(torch.tensor(expected, dtype=torch.float64)) @ v.T
    torch.testing.assert_close(out, target, rtol=0, atol=1e-12)
    assert (torch.linalg.svdvals(out) >= 0).all()


def test_partial_svt_projection_after_one_sgd_step_by_hand():
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(5, 4, generator=g).double(), torch.tensor([0, 2, 1, 2, 0])
    w0, b0 = torch.randn(3, 4, generator=g).double(), torch.randn(3, generator=g).double()
    family = PlainFamily("linear", (4,), 3)
    data = ClientData(0, x.float(), y, x[:0].float(), y[:0], 3)
    payload = {"head.weight": w0.float(), "head.bias": b0.float()}
    lr, alpha = 0.5, 0.4
    config = LocalTraining(lr=lr, steps=1, batch_size=5)
    task = ClientTask(0, family.global_spec([]), payload, full_map(payload), config)
    svt = PartialSVT("head.weight", (3, 4), alpha=alpha, theta=1)
    recipe = LocalRecipe(projections=(svt,), trackers=(StepNormaliser(),))
    generator = torch_generator(0, 1, 0, "train")
    program = Programs(family, recipe).program_for(0)
    res = program.fit(task, data, {}, generator, info=data.info()).result
    # one full-batch step of softmax cross-entropy: grad = (softmax - onehot)^T x / B
    p = torch.softmax(x @ w0.T + b0, dim=1)
    err = (p - torch.nn.functional.one_hot(y, 3).double()) / 5
    w1, b1 = w0 - lr * err.T @ x, b0 - lr * err.sum(0)
    u, s, vh = torch.linalg.svd(w1, full_matrices=False)
    s = torch.cat([s[:1], (s[1:] - alpha * lr).clamp_min(0)])
    torch.testing.assert_close(res.tensors["head.weight"].double(), (u * s) @ vh, atol=1e-5, rtol=0)
    torch.testing.assert_close(res.tensors["head.bias"].double(), b1, atol=1e-6, rtol=0)
    assert res.extras == {"a_norm": 1.0, "steps": 1}


# -- one FedALRC round by hand -------------------------------------------------------------
def _reference_client(w, b, data: ClientData, config, alpha, q, radius):
    """Algorithm 2 on a linear softmax model in float64, gradients in closed form."""
    x, y = data.x_train.double(), data.y_train
    settings = config
    batches = batch_order(data.n_train, settings, torch_generator(0, 1, data.cid, "train"))
    for step, idx in enumerate(batches):
        xb, yb = x[idx], y[idx]
        bsz, c = len(idx), w.shape[0]
        p = torch.softmax(xb @ w.T + b, dim=1)
        ce = -torch.log(p[torch.arange(bsz), yb])
        err = (p - torch.nn.functional.one_hot(yb, c).double()) / bsz
        if (ce**2).mean() <= radius:
            err = err + alpha * _signs(data.cid, step, q, bsz, c).double().mean(0) / (bsz * c)
        w, b = w - settings.lr * err.T @ xb, b - settings.lr * err.sum(0)
    return w, b, len(batches)


def test_one_fedalrc_round_with_gamma_and_alpha_by_hand():
    family = PlainFamily("linear", (3,), 2)
    config = LocalTraining(lr=0.2, epochs=2, batch_size=4)
    alpha, q, gamma = 0.8, 3, 1.5
    strategy, _ = ALGORITHMS.get("fedalrc").build(
        family, {"gamma": gamma, "form": "deep"}, clients_per_round=2, train=config
    )
    recipe = _deep(RademacherTerm(alpha, q, signs=_injected))
    clients = [_two_class_data(0, 6), _two_class_data(1, 3)]  # 4 and 2 local steps
    infos = [c.info() for c in clients]
    state = strategy.setup(infos, torch_generator(0, 0, -1, "init"))
    w0 = {k: v.double() for k, v in state.items()}
    tasks = strategy.plan(1, state, infos, torch_generator(0, 1, -1, "sample"))
    programs = Programs(family, recipe)
    results = [
        programs.program_for(t.cid)
        .fit(t, clients[t.cid], {}, torch_generator(0, 1, t.cid, "train"), info=infos[t.cid])
        .result
        for t in tasks
    ]
    new = strategy.aggregate(1, state, trained(tasks, results)).state
    assert [r.extras["regularised_steps"] for r in results] == [4, 2]  # gate open throughout
    # server: w - gamma * (sum p_k varpi_k) * sum p_k (w - w_k) / varpi_k, p = (6/9, 3/9)
    w, b = w0["head.weight"], w0["head.bias"]
    refs = [_reference_client(w, b, c, config, alpha, q, 1.0) for c in clients]
    p = [6 / 9, 3 / 9]
    eta = gamma * sum(pk * steps for pk, (_, _, steps) in zip(p, refs, strict=True))
    assert eta == gamma * (6 / 9 * 4 + 3 / 9 * 2)
    for i, name in enumerate(("head.weight", "head.bias")):
        delta = sum(pk * (w0[name] - ref[i]) / ref[2] for pk, ref in zip(p, refs, strict=True))
        torch.testing.assert_close(new[name].double(), w0[name] - eta * delta, atol=1e-5, rtol=0)
    # and the regulariser mattered: FedNova's step from the unregularised clients differs
    unregularised = Programs(family, _deep(RademacherTerm(0.0)))
    plain = [
        unregularised.program_for(t.cid)
        .fit(t, clients[t.cid], {}, torch_generator(0, 1, t.cid, "train"), info=infos[t.cid])
        .result
        for t in tasks
    ]
    assert not torch.allclose(
        strategy.aggregate(1, state, trained(tasks, plain)).state["head.weight"], new["head.weight"]
    )


# -- reductions -------------------------------------------------------------------------------
def _skewed_federation(model: str):
    ds = load_synthetic(n_train=300, n_test=100, num_classes=4, shape=(6,), seed=1)
    parts = PARTITIONERS.get("quantity")(ds.y_train, 4, np.random.default_rng(2), alpha=1.0)
    clients = build_clients(ds, parts, test_per_client=0, seed=0)
    assert len({c.n_train for c in clients}) > 1  # unequal local step counts
    return PlainFamily(model, ds.input_shape, ds.num_classes), clients, global_test(ds, "cpu")


def _final_state(name: str, opts: dict, model: str, train: dict, rounds: int, tmp_path: Path):
    family, clients, test = _skewed_federation(model)
    strategy, recipe = ALGORITHMS.get(name).build(
        family, opts, clients_per_round=len(clients), train=train
    )
    settings = RoundSettings(rounds=rounds, seed=0, local_eval="none", checkpoint_every=10)
    sim = Simulation(strategy, Programs(family, recipe), clients, test, settings, tmp_path)
    sim.run()
    return sim.state


def _hand_made_round(state, clients: list[tuple[int, int, int]]) -> tuple[dict, list, list]:
    """The global state in float64 and one result per (n_k, steps ϖ_k, seed): the client's
    weights w_k = w - g_k with a seeded g_k, its normaliser ‖a_k‖₁ = ϖ_k (plain SGD)."""
    w = {k: v.double() for k, v in state.items()}
    results, updates = [], []
    for cid, (n, steps, seed) in enumerate(clients):
        g = {
            k: torch.randn(v.shape, generator=torch_generator(seed, 0, cid, "g"))
            for k, v in w.items()
        }
        sent = {k: (w[k] - g[k].double()).float() for k in w}
        results.append(
            ClientResult(cid, sent, n, steps, 0.0, extras={"a_norm": steps, "steps": steps})
        )
        updates.append((n, steps, {k: w[k] - sent[k].double() for k in w}))
    return w, results, updates


@pytest.mark.parametrize(
    ("name", "opts", "gamma"),
    [("fednova", {}, 1.0), ("fedalrc", {"gamma": 1.0}, 1.0), ("fedalrc", {"gamma": 1.5}, 1.5)],
)
def test_server_step_is_fednovas_formula_times_gamma(name, opts, gamma):
    """FedNova's step written out (Wang et al. 2020, §4; FedALRC, Algorithm 1 and Table IV):
    w ← w − γ (Σ_k p_k ϖ_k) Σ_k p_k (w − w_k) / ϖ_k with p_k = n_k / Σ n, on hand-made
    results with unequal sizes and step counts."""
    family = PlainFamily("linear", (8,), 6)  # a 6 x 8 weight: FedALRC's theta = 5 fits
    strategy, _ = ALGORITHMS.get(name).build(
        family, opts, clients_per_round=3, train=LocalTraining()
    )
    infos = [ClientInfo(cid, 10, (8,), tuple(range(6))) for cid in range(3)]
    state = strategy.setup(infos, torch_generator(0, 0, -1, "init"))
    tasks = strategy.plan(1, state, infos, torch_generator(0, 1, -1, "sample"))  # all three
    w, results, updates = _hand_made_round(state, [(30, 2, 1), (10, 6, 2), (20, 3, 3)])
    new = strategy.aggregate(1, state, trained(tasks, results)).state
    n_total = sum(n for n, _, _ in updates)
    p = [n / n_total for n, _, _ in updates]
    tau_eff = sum(pk * steps for pk, (_, steps, _) in zip(p, updates, strict=True))
    for k in w:
        normalised = sum(pk * g[k] / steps for pk, (_, steps, g) in zip(p, updates, strict=True))
        expected = w[k] - gamma * tau_eff * normalised
        torch.testing.assert_close(new[k].double(), expected, rtol=0, atol=1e-6)


def test_ada_fedalrc_with_equal_steps_is_fedadagrad_with_v0_eps(tmp_path):
    """With γ = 1, α = 0 and equal step counts, τ_eff Σ p_k (w − w_k)/ϖ = Σ p_k (w − w_k):
    Ada-FedALRC's direction is FedAdagrad's pseudo-gradient, and with v⁰ = eps (Algorithm 3,
    line 1) both take the same Adagrad steps (Reddi et al. 2021, Algorithm 2, β1 = 0)."""
    train = LocalTraining(lr=0.05, steps=3, batch_size=16)
    ada = {"gamma": 1.0, "alpha": 0.0, "server_lr": 0.05}
    alrc = _final_state("ada-fedalrc", ada, "mlp", train, 3, tmp_path / "alrc")
    adagrad = {"server_lr": 0.05, "v0": 1e-3}
    reference = _final_state("fedadagrad", adagrad, "mlp", train, 3, tmp_path / "adagrad")
    for k in reference:
        torch.testing.assert_close(alrc[k], reference[k], rtol=0, atol=1e-6)
    # and the comparison can tell: FedAdagrad's own v0 = eps² steps elsewhere
    default_v0 = _final_state("fedadagrad", {"server_lr": 0.05}, "mlp", train, 3, tmp_path / "d")
    assert any(not torch.allclose(default_v0[k], reference[k], atol=1e-4) for k in reference)


# -- Ada-FedALRC server step ----------------------------------------------------------------
def test_ada_fedalrc_two_rounds_by_hand():
    family = PlainFamily("linear", (2,), 2)
    strategy, _ = ALGORITHMS.get("ada-fedalrc").build(
        family,
        {"gamma": 1.5, "theta": 1, "server_lr": 0.1},
        clients_per_round=2,
        train=LocalTraining(),
    )
    infos = [ClientInfo(cid, 10, (2,), (0, 1)) for cid in range(2)]
    state = strategy.setup(infos, torch_generator(0, 0, -1, "init"))
    state["head.bias"] = torch.tensor([1.0, -1.0], dtype=torch.float64)
    eps, beta, gamma = 1e-3, 0.1, 1.5
    w = [1.0, -1.0]
    v = [eps, eps]  # Algorithm 3: v0 = eps
    # (n_k, steps_k, g_k = w - w_k) per client, two rounds
    rounds = [
        [(30, 2, [0.2, 0.4]), (10, 6, [0.6, -0.3])],
        [(30, 4, [-0.1, 0.0]), (10, 1, [0.05, 0.2])],
    ]
    for rnd, clients in enumerate(rounds, start=1):
        tasks = strategy.plan(rnd, state, infos, torch_generator(0, rnd, -1, "sample"))
        results = []
        for cid, (n, s, g) in enumerate(clients):
            sent = {**state, "head.bias": state["head.bias"] - torch.tensor(g, dtype=torch.float64)}
            results.append(ClientResult(cid, sent, n, s, 0.0, extras={"a_norm": s, "steps": s}))
        state = strategy.aggregate(rnd, state, trained(tasks, results)).state
        total = sum(n for n, _, _ in clients)
        eta = gamma * sum(n / total * s for n, s, _ in clients)
        for j in range(2):
            step = eta * sum(n / total * g[j] / s for n, s, g in clients)  # eta * Delta
            v[j] += step**2
            w[j] -= beta * step / (math.sqrt(v[j]) + eps)
        got = state["head.bias"].tolist()
        assert got == pytest.approx(w, rel=1e-12, abs=1e-12)
    assert strategy.extra_state()["server_opt"]["v"]["head.bias"].tolist() == pytest.approx(v)
    assert strategy.aggregate(3, state, TrainedRound()).state == state  # no results: no step


# -- validation ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "opts", "match"),
    [
        ("fedalrc", {"alpha": -0.1}, "alpha"),
        ("fedalrc", {"Q": 0}, "Q"),
        ("fedalrc", {"gamma": 0.0}, "gamma"),
        ("fedalrc", {"theta": -1}, "theta"),
        ("ada-fedalrc", {"server_lr": 0.0}, "server_lr"),
        ("fedalrc", {"variant": "g", "theta": 3}, "variant 'g'"),
    ],
)
def test_invalid_options_are_refused(name, opts, match):
    with pytest.raises(ValidationError, match=match):
        ALGORITHMS.get(name).options(**opts)


def test_theta_beyond_the_weight_rank_is_refused_when_built():
    family = PlainFamily("linear", (1, 8, 8), 10)  # weight 10 x 64: theta in 0..10
    build = ALGORITHMS.get("fedalrc").build
    build(family, {"theta": 10}, clients_per_round=1, train=LocalTraining())
    with pytest.raises(ValueError, match=r"theta = 11 .* allowed 0\.\.10"):
        build(family, {"theta": 11}, clients_per_round=1, train=LocalTraining())
    with pytest.raises(ValueError, match="form 'linear' needs"):
        build(
            PlainFamily("mlp", (6,), 3),
            {"form": "linear"},
            clients_per_round=1,
            train=LocalTraining(),
        )
    with pytest.warns(UserWarning, match="theta does not apply"):
        build(PlainFamily("mlp", (6,), 3), {"theta": 2}, clients_per_round=1, train=LocalTraining())
    with pytest.raises(ValueError, match="alpha"):
        RademacherTerm(alpha=-1.0)
    with pytest.raises(ValueError, match="Q"):
        RademacherTerm(alpha=0.1, q=0)


def test_config_names_the_bad_option():
    with pytest.raises(ConfigError, match=r"options\.fedalrc\.alpha"):
        validate({"algorithm": "fedalrc", "options": {"fedalrc": {"alpha": -1}}})


def test_ready_configs_validate_and_decay_the_local_lr_as_the_paper():
    """Every point of every FedALRC config, comparators included: the local lr x0.1 after
    50 % and x0.01 after 75 % of the rounds (§V-A, as FedNova); the image setting runs 30
    rounds (rounds 16-22 at x0.1, 23-30 at x0.01)."""
    files = sorted(CONFIGS.glob("fedalrc_*.yaml"))
    assert len(files) >= 7
    for path in files:
        points = expand_sweep(load_raw(path))
        assert points
        for _, point in points:
            cfg = validate(point)
            rounds = cfg.train.rounds
            schedule = cfg.train.lr_schedule.lr_schedule()
            half, three_quarters = rounds // 2, math.ceil(0.75 * rounds)
            at = [1, half, half + 1, three_quarters - 1, three_quarters + 1, rounds]
            got = [schedule.factor(r, rounds) for r in at]
            assert got == pytest.approx([1, 1, 0.1, 0.1, 0.01, 0.01]), (path.name, cfg.algorithm)
            if "fmnist" in path.name:
                assert rounds == 30, path.name


def test_server_step_sweep_tunes_each_method_over_the_papers_grid():
    points = expand_sweep(load_raw(CONFIGS / "fedalrc_server_lr_fmnist.yaml"))
    configs = [validate(point) for _, point in points]
    grid = [0.001, 0.005, 0.01, 0.05, 0.1, 0.2, 0.5]
    chosen = sorted((c.algorithm, c.algorithm_options()["server_lr"]) for c in configs)
    assert chosen == sorted((a, lr) for a in ("ada-fedalrc", "fedadagrad") for lr in grid)
    assert {c.seed for c in configs} == {0}
    assert {
        (c.algorithm_options()["tau"], c.algorithm_options().get("v0", 1e-3)) for c in configs
    } == {(1e-3, 1e-3)}  # eps = 1e-3 and v0 = eps for both (Algorithm 3, line 1)
    assert points[0][0] == "fedadagrad-s0-server_lr=0.001"
    with pytest.raises(ConfigError, match="an empty key in a comma-separated list"):
        expand_sweep({"sweep": {"options.fedadagrad.server_lr,": [0.1]}})


# -- data and models ---------------------------------------------------------------------------
def test_libsvm_reader_on_a_written_file(tmp_path):
    train = tmp_path / "tiny"
    lines = [
        "# a comment line",
        "3 1:0.5 4:-1",
        "7 2:1.5   # trailing comment",
        "",
        "1 1:1 2:2 3:3",
    ]
    train.write_text("\n".join([*lines, "3 3:0.25\n"]))
    (tmp_path / "tiny.t").write_text("7 4:2\n1 1:-0.5\n9 2:1\n")  # 9 only in the test file
    ds = load_libsvm(train)
    assert ds.num_classes == 4 and ds.input_shape == (4,)
    np.testing.assert_array_equal(ds.y_train, [1, 2, 0, 1])  # labels 1, 3, 7, 9 -> 0..3
    np.testing.assert_array_equal(ds.y_test, [2, 0, 3])
    np.testing.assert_array_equal(
        ds.x_train, [[0.5, 0, 0, -1], [0, 1.5, 0, 0], [1, 2, 3, 0], [0, 0, 0.25, 0]]
    )
    np.testing.assert_array_equal(ds.x_test, [[0, 0, 0, 2], [-0.5, 0, 0, 0], [0, 1, 0, 0]])
    assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int64


def test_libsvm_without_test_file_splits_by_class(tmp_path):
    path = tmp_path / "solo"
    path.write_text("".join(f"{i % 2} 1:{i} 2:1\n" for i in range(20)))
    a, b = load_libsvm(path, seed=0), load_libsvm(path, seed=0)
    assert len(a.y_train) == 16 and np.bincount(a.y_test).tolist() == [2, 2]
    np.testing.assert_array_equal(a.x_test, b.x_test)  # the split follows the seed


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("1 0:3", "index >= 1"),
        ("1 2:1 1:1", "does not increase"),
        ("1.5 1:1", "not an integer"),
        ("x 1:1", "not a number"),
        ("1 1=2", "index>:<value"),
    ],
)
def test_libsvm_reader_names_the_bad_line(tmp_path, line, match):
    path = tmp_path / "bad"
    path.write_text(f"0 1:1\n{line}\n")
    with pytest.raises(ValueError, match=rf"bad:2: .*{match}"):
        load_libsvm(path)


def test_libsvm_needs_a_path(tmp_path):
    with pytest.raises(ValueError, match=r"data\.path"):
        load_libsvm(None)
    with pytest.raises(FileNotFoundError):
        load_libsvm(tmp_path / "missing")


def test_linear_model_weight_is_classes_by_features():
    family = PlainFamily("linear", (1, 8, 8), 10)
    model = family.build(family.global_spec([]))
    assert [tuple(p.shape) for p in model.parameters()] == [(10, 64), (10,)]


def test_default_signs_come_from_the_client_generator():
    ctx = _ctx()
    ctx.generator.manual_seed(7)
    a = RademacherTerm(0.1).signs(5, 64, 10, ctx)
    ctx.generator.manual_seed(7)
    assert torch.equal(a, RademacherTerm(0.1).signs(5, 64, 10, ctx))
    assert a.shape == (5, 64, 10) and set(a.unique().tolist()) == {-1, 1}
    assert abs(float(a.float().mean())) < 0.1  # 3200 fair signs
