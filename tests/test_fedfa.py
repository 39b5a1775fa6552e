"""FedFA (Park and Joe-Wong, "Federated Learning with Flexible Architectures", ECML-PKDD
2024): layer grafting, the 95th-percentile norm and α, the aggregate of clients of different
depths and widths, ZiCo, the choice of architectures and the settings refused."""

from __future__ import annotations

import math
import pickle
from dataclasses import replace

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from torch import nn

from hetfl.algorithms import ALGORITHMS
from hetfl.algorithms.fedfa import FedFAOptions
from hetfl.algorithms.parts.architecture_choice import ArchitectureChoice, ZicoQuery, candidate_grid
from hetfl.algorithms.parts.fedfa_scaling import QuantileNormScaling, quantile_norm
from hetfl.algorithms.parts.grafting import graft
from hetfl.algorithms.parts.zico import _Moments, zico
from hetfl.core.client.program import Programs
from hetfl.core.init import build_model, initialize
from hetfl.core.roles import layer_weight_names
from hetfl.core.spec import MapEntry, Spec, prefix_index
from hetfl.core.state import extract
from hetfl.core.training import LocalTraining
from hetfl.core.types import ClientData, ClientInfo, ClientResult, ClientTask, Trained
from hetfl.engine.outputs import read_metrics
from hetfl.engine.round_settings import RoundSettings
from hetfl.models import ScalableFamily
from hetfl.sim import Simulation
from hetfl.systems.costs import MacCounter
from strategies import constant_results, trained

FAMILY = ScalableFamily(
    {"family": "preresnet", "input_shape": (3, 8, 8), "num_classes": 4, "stages": 2}
)
TRAIN = LocalTraining(batch_size=4)


def _fedfa(**options: object):
    opts = {"depths": [2, 3], "widths": [0.25, 0.5], "choice": "random", **options}
    return ALGORITHMS.get("fedfa").build(
        FAMILY, opts, clients_per_round=2, train=TRAIN, macs=MacCounter(FAMILY)
    )[0]


def _info(cid: int, labels: tuple[int, ...] = (0, 1, 2, 3), **attrs: object) -> ClientInfo:
    return ClientInfo(cid, 10, (3, 8, 8), labels, attrs)


# -- grafting --------------------------------------------------------------------------------
def test_grafting_repeats_each_sections_last_block_into_the_deeper_identity_blocks() -> None:
    """Depth 2 at width 1/2 in a global model of depths (4, 3): block 1 of section 1 stands
    in for blocks 2 and 3, block 1 of section 2 for block 2, at the client's own slices; no
    grafted entry targets a strided or projection block; extraction reads the client's own
    blocks only."""
    local = FAMILY.normalise({**FAMILY.base, "blocks": 2, "width": 0.5})
    full = FAMILY.normalise({**FAMILY.base, "blocks": (4, 3, 2, 2)})
    own = FAMILY.index_map(local)
    imap = graft(FAMILY, own, local, full)
    assert imap[: len(own)] == own
    grafted = imap[len(own) :]

    def block(name: str) -> str:
        return ".".join(name.split(".")[:3])

    blocks = {(block(e.local), block(e.global_name)) for e in grafted}
    assert blocks == {
        ("stages.0.1", "stages.0.2"),
        ("stages.0.1", "stages.0.3"),
        ("stages.1.1", "stages.1.2"),
    }
    identity = {b.path: b.identity for s in FAMILY.sections(full) for b in s}
    assert all(identity[block(e.global_name)] for e in grafted)
    source = {e.local: e for e in own}
    for e in grafted:
        assert e.index == source[e.local].index
        assert e.global_name.split(".", 3)[3] == e.local.split(".", 3)[3]
    state = {k: torch.zeros(v.shape) for k, v in FAMILY.build(full).state_dict().items()}
    assert set(extract(state, imap)) == set(FAMILY.build(local).state_dict())
    shallow = FAMILY.normalise({**FAMILY.base, "blocks": 1})
    with pytest.raises(ValueError, match=r"identity blocks .* depth 1 there .* use depths >= 2"):
        graft(FAMILY, FAMILY.index_map(shallow), shallow, full)


# -- the 95th-percentile norm and alpha ------------------------------------------------------
def test_the_quantile_norm_keeps_the_entries_up_to_the_95th_percentile() -> None:
    """|w| = 1..20: the 0.95 quantile is 19 + 0.05 * (20 - 19) = 19.05, so 1..19 stay:
    L2 = sqrt(1^2 + ... + 19^2) = sqrt(2470), rms = sqrt(2470 / 19); equal magnitudes all
    stay (ties); numpy's quantile (linear interpolation) agrees on a random tensor."""
    values = torch.tensor([(-1) ** k * k for k in range(1, 21)], dtype=torch.float32)
    assert quantile_norm(values) == pytest.approx(math.sqrt(2470), rel=1e-12)
    assert quantile_norm(values, "rms") == pytest.approx(math.sqrt(130), rel=1e-12)
    assert quantile_norm(torch.full((7,), -2.0)) == pytest.approx(2 * math.sqrt(7))
    x = torch.randn(4, 250, generator=torch.Generator().manual_seed(0))
    a = np.abs(x.numpy().astype(np.float64)).ravel()
    kept = a[a <= np.quantile(a, 0.95)]
    assert quantile_norm(x) == pytest.approx(float(np.linalg.norm(kept)), rel=1e-12)


def _trained(cid: int, tensors: dict[str, torch.Tensor], imap: list[MapEntry]) -> Trained:
    task = ClientTask(cid, Spec(), {}, imap)
    return Trained(task, ClientResult(cid, tensors, num_examples=1, num_steps=1, loss=0.0))


def test_alpha_is_the_mean_norm_over_the_clients_own_norm_on_what_each_holds() -> None:
    """Client 0 holds w (4 x 8) at 1 and the head's rows 0-1 of 3 (rows masked at 1); client 1
    at width 1/4 holds w[:1, :2] at 3 and the head's rows 1-2 (the masked-out row 0 at 100
    counts nowhere). L2: w 4*sqrt(2) and 3*sqrt(2), mean 3.5*sqrt(2): alpha 0.875 and 7/6;
    head sqrt(4) = 2 and 3*sqrt(4) = 6, mean 4: alpha 2 and 2/3. rms: w 1 and 3: 2 and 2/3."""
    head0, head1 = torch.ones(3, 2), torch.tensor([[100.0, 100.0], [3.0, 3.0], [3.0, 3.0]])
    rows = torch.tensor([[True, True], [True, True], [False, False]])
    t0 = _trained(
        0,
        {"w": torch.ones(4, 8), "h": head0},
        [MapEntry("w", "w"), MapEntry("h", "h", (), rows)],
    )
    t1 = _trained(
        1,
        {"w": torch.full((1, 2), 3.0), "h": head1},
        [MapEntry("w", "w", prefix_index(1, 2)), MapEntry("h", "h", (), rows.flip(0))],
    )
    alpha = QuantileNormScaling(FAMILY)([t0, t1])
    assert alpha[0] == pytest.approx({"w": 0.875, "h": 2.0})
    assert alpha[1] == pytest.approx({"w": 7 / 6, "h": 2 / 3})
    rms = QuantileNormScaling(FAMILY, norm="rms")([t0, t1])
    assert [a["w"] for a in rms] == pytest.approx([2.0, 2 / 3])


def test_weights_only_scales_the_conv_and_linear_weights() -> None:
    spec = FAMILY.normalise({**FAMILY.base, "blocks": 2, "width": 0.25})
    tensors = {k: torch.ones_like(v) for k, v in FAMILY.build(spec).state_dict().items()}
    t = Trained(
        ClientTask(0, spec, {}, FAMILY.index_map(spec)),
        ClientResult(0, tensors, num_examples=1, num_steps=1, loss=0.0),
    )
    scaled = set(QuantileNormScaling(FAMILY, scale="weights_only").norms(t))
    weights = ("conv1.weight", "conv2.weight", "shortcut.weight", "stem.weight", "head.weight")
    assert scaled == {k for k in tensors if k.endswith(weights)}
    floats = {k for k, v in tensors.items() if v.is_floating_point()}
    assert set(QuantileNormScaling(FAMILY).norms(t)) == floats


# -- the aggregate ---------------------------------------------------------------------------
def test_two_clients_of_different_depth_and_width_aggregate_by_hand() -> None:
    """Client 0 (depth 2, width 1/2, 10 samples, classes 0-1) sends 1 everywhere; client 1
    (depth 3, width 1/4, 30 samples, classes 1-2) sends 3. Block 2 of section 1 exists only
    in client 1; client 0's block 1 is grafted into it. Its conv1 (32 x 32 x 3 x 3): norms
    1 * sqrt(9216) = 96 and 3 * sqrt(2304) = 144, mean 120, alpha 1.25 and 5/6; so
    [:16, :16] is (10 * 1.25 * 1 + 30 * 5/6 * 3) / 40 = 2.1875 and the rest 1.25. The head
    (4 classes x 64 features at width 1/2) over the rows each client owns: 128 entries at 1,
    norm 8 sqrt(2), and 64 at 3, norm 24. The row of class 3, which no client holds, and
    row 2 beyond client 1's 32 features keep their values."""
    strategy = _fedfa()
    infos = [_info(0, (0, 1), architecture="d2-w0.5"), _info(1, (1, 2), architecture="d3-w0.25")]
    state = strategy.setup(infos, torch.Generator().manual_seed(0))
    assert strategy.global_spec["blocks"][:2] == (3, 3)
    assert strategy.global_spec["widths"][:2] == (0.5, 0.5)
    tasks = strategy.plan(1, state, infos, torch.Generator().manual_seed(1))
    results = constant_results(tasks)
    new = strategy.aggregate(1, state, trained(tasks, results)).state
    conv = new["stages.0.2.conv1.weight"].double()
    assert conv.shape == (32, 32, 3, 3)
    assert torch.allclose(conv[:16, :16], torch.full((16, 16, 3, 3), 2.1875, dtype=torch.float64))
    assert torch.allclose(conv[16:], torch.full((16, 32, 3, 3), 1.25, dtype=torch.float64))
    head = new["head.weight"]
    assert head.shape == (4, 64)
    assert torch.equal(head[3], state["head.weight"][3])
    assert torch.equal(head[2, 32:], state["head.weight"][2, 32:])
    mean = (8 * math.sqrt(2) + 24) / 2
    alpha0, alpha1 = mean / (8 * math.sqrt(2)), mean / 24
    assert float(head[0, 0]) == pytest.approx(alpha0, rel=1e-6)
    assert float(head[1, 0]) == pytest.approx((10 * alpha0 + 30 * alpha1 * 3) / 40, rel=1e-6)
    assert float(head[2, 0]) == pytest.approx(alpha1 * 3, rel=1e-6)


# -- ZiCo and the choice --------------------------------------------------------------------
def _zico_by_hand(w1: np.ndarray, w2: np.ndarray, batches) -> float:
    """ZiCo of x -> W2 W1 x under cross-entropy, with the gradients written out:
    G = (softmax(z) - onehot(y)) / B, dW2 = G^T h with h = x W1^T, dW1 = (G W2)^T x."""
    grads: list[list[np.ndarray]] = [[], []]
    for x, y in batches:
        x = x.numpy().astype(np.float64)
        h = x @ w1.T
        z = h @ w2.T
        p = np.exp(z - z.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        p[np.arange(len(y)), y.numpy()] -= 1
        g = p / len(y)
        grads[0].append((g @ w2).T @ x)
        grads[1].append(g.T @ h)
    score = 0.0
    for layer in grads:
        stacked = np.stack([g.ravel() for g in layer])
        std = stacked.std(axis=0)
        ratio = np.abs(stacked).mean(axis=0)[std > 0] / std[std > 0]
        score += math.log(ratio.sum())
    return score


def test_zico_matches_a_hand_computation_on_a_two_layer_network() -> None:
    g = torch.Generator().manual_seed(3)
    model = nn.Sequential(nn.Linear(3, 4, bias=False), nn.Linear(4, 2, bias=False))
    with torch.no_grad():
        for layer in model:
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=g))
    batches = [
        (torch.randn(5, 3, generator=g), torch.randint(2, (5,), generator=g)) for _ in range(2)
    ]
    expected = _zico_by_hand(model[0].weight.detach().double().numpy(),
                             model[1].weight.detach().double().numpy(), batches)  # fmt: skip
    assert zico(model, batches) == pytest.approx(expected, rel=1e-5)
    with pytest.raises(ValueError, match="at least 2 mini-batches"):
        zico(model, batches[:1])


def _zico_stacked(model: nn.Module, batches) -> float:
    """ZiCo as it was first written: every batch's gradients kept, stacked, and reduced by
    PyTorch's `std` and `mean` over the batches (the oracle of the moments kept per batch)."""
    params = {n: p for n, p in model.named_parameters() if n in layer_weight_names(model)}
    grads: dict[str, list[torch.Tensor]] = {n: [] for n in params}
    for x, y in batches:
        model.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        for name, p in params.items():
            grads[name].append(p.grad.detach().reshape(-1).to(torch.float64))
    model.zero_grad(set_to_none=True)
    score = 0.0
    for stacked in (torch.stack(g) for g in grads.values()):
        spread = stacked.std(dim=0, correction=0)
        total = float((stacked.abs().mean(dim=0)[spread > 0] / spread[spread > 0]).sum())
        score += math.log(total) if total > 0 else 0.0
    return score


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal entry by entry, the sign of a zero included, NaN where the other is NaN."""
    equal = (a == b) & (torch.signbit(a) == torch.signbit(b))
    return bool((equal | (a.isnan() & b.isnan())).all())


@pytest.mark.parametrize("batches", [2, 3])
def test_zico_moments_are_torch_std_and_mean_over_the_stacked_gradients_bit_for_bit(batches):
    """The moments kept a batch at a time equal `std(0, correction=0)` and `abs().mean(0)`
    over the stacked gradients in every bit, on float32 gradients of every magnitude, float64
    ones (where `torch.sqrt` would miss by one unit in the last place), zeros of both
    signs, equal entries and infinities."""
    g = torch.Generator().manual_seed(7)
    rows = [torch.randn(20_000, generator=g) * torch.exp(4 * torch.randn(20_000, generator=g))
            for _ in range(batches)]  # fmt: skip
    rows[0][:50], rows[-1][50:100], rows[1][100:150] = 0.0, -0.0, rows[0][100:150]
    rows[0][150:160] = float("inf")
    wide = [r.double() * (1 + 1e-9 * torch.randn(r.shape, generator=g, dtype=torch.float64))
            for r in rows]  # fmt: skip
    for grads in (rows, wide):
        moments = _Moments(grads[0])
        for grad in grads:
            moments.add(grad)
        stacked = torch.stack([grad.double() for grad in grads])
        spread, mean_abs = moments.spread_and_mean_abs()
        assert _same_bits(spread, stacked.std(dim=0, correction=0))
        assert _same_bits(mean_abs, stacked.abs().mean(dim=0))


def test_zico_equals_the_stacked_computation_exactly_on_a_residual_network() -> None:
    model = initialize(build_model(FAMILY, FAMILY.base.replace(bn="static")),
                       torch.Generator().manual_seed(2)).train()  # fmt: skip
    g = torch.Generator().manual_seed(4)
    batches = [(torch.randn(6, 3, 8, 8, generator=g), torch.randint(4, (6,), generator=g))
               for _ in range(2)]  # fmt: skip
    assert zico(model, batches) == _zico_stacked(model, batches)


def test_a_query_reusing_its_models_answers_as_fresh_builds_do_bit_for_bit() -> None:
    """One query asked by three clients in turn (each candidate built once, re-initialised
    in place) gives every client the scores a query built afresh for it gives, floats
    compared with ==; a re-initialised model is a fresh one in every parameter and buffer,
    running BatchNorm statistics included; a copy travels without the models."""
    choice = _choice(choice="zico", limited_share=0.0)
    reused = ZicoQuery(FAMILY, choice, batch_size=4)
    for cid in (0, 1, 2):
        answer = reused(_info(cid), _data(cid), torch.Generator().manual_seed(10 + cid))
        fresh = ZicoQuery(FAMILY, choice, batch_size=4)
        assert answer == fresh(_info(cid), _data(cid), torch.Generator().manual_seed(10 + cid))
        assert len(answer["zico"]) == 4
    assert len(reused._models) == 4
    assert pickle.loads(pickle.dumps(reused))._models == {}
    running = ZicoQuery(FAMILY, choice, batch_size=4)
    running.architectures = {k: v.replace(bn="batch") for k, v in running.architectures.items()}
    running(_info(0), _data(0), torch.Generator().manual_seed(1))  # moves the statistics
    for label, spec in running.architectures.items():
        again = running._model(label, 99, torch.device("cpu")).state_dict()
        new = initialize(build_model(FAMILY, spec), torch.Generator().manual_seed(99))
        assert any(k.endswith("running_mean") for k in again)
        assert again.keys() == new.state_dict().keys()
        assert all(torch.equal(again[k], v) for k, v in new.state_dict().items()), label


def _choice(**kw: object) -> ArchitectureChoice:
    base = FAMILY.base.replace(bn="static")
    grid = candidate_grid([2, 3], [0.25, 0.5])
    return ArchitectureChoice(FAMILY, base, grid, method="fedfa", **kw, macs=MacCounter(FAMILY))


def _data(cid: int) -> ClientData:
    g = torch.Generator().manual_seed(cid)
    x, y = torch.randn(8, 3, 8, 8, generator=g), torch.randint(4, (8,), generator=g)
    return ClientData(cid, x, y, x[:0], y[:0], num_classes=4)


def test_zico_choice_is_seeded_and_takes_the_best_candidate_within_the_budget() -> None:
    """The query gives the same scores from the same generator; a client takes the best
    scored candidate whose MACs fit its budget, even when a dearer one scores higher; with
    limited_share 0.5 one of two clients takes the smallest candidate."""
    choice = _choice(choice="zico", limited_share=0.0)
    query = ZicoQuery(FAMILY, choice, batch_size=4)
    first = query(_info(0), _data(0), torch.Generator().manual_seed(5))
    assert first == query(_info(0), _data(0), torch.Generator().manual_seed(5))
    assert set(first["zico"]) == {"d2-w0.25", "d2-w0.5", "d3-w0.25", "d3-w0.5"}
    macs = {c.label: choice.macs(c) for c in choice.candidates}
    assert macs["d2-w0.25"] < macs["d3-w0.25"] < macs["d2-w0.5"] < macs["d3-w0.5"]
    scores = {"d2-w0.25": 1.0, "d3-w0.25": 3.0, "d2-w0.5": 2.0, "d3-w0.5": 9.0}
    infos = [_info(0, zico=scores, macs_budget=macs["d2-w0.5"]),
             _info(1, zico=scores, macs_budget=macs["d2-w0.25"])]  # fmt: skip
    choice.setup_seeded(infos, torch.Generator().manual_seed(0))
    assert {cid: c.label for cid, c in choice.chosen.items()} == {0: "d3-w0.25", 1: "d2-w0.25"}
    half = _choice(choice="zico")
    half.setup_seeded(infos, torch.Generator().manual_seed(0))
    assert sorted(c.label for c in half.chosen.values()).count("d2-w0.25") >= 1
    assert len(half.budget_of) == 1  # the limited client has no budget


def test_the_scored_clients_are_those_whose_choice_reads_a_score() -> None:
    """Neither a limited client, nor one that declares its architecture, nor one whose
    budget fits one candidate is scored; the draws are setup_seeded's (same generator)."""
    choice = _choice(choice="zico")
    macs = sorted(choice.macs(c) for c in choice.candidates)
    infos = [_info(0, architecture="d3-w0.5"), _info(1, macs_budget=macs[0])]
    infos += [_info(c, macs_budget=macs[-1]) for c in range(2, 8)]
    scored = choice.scored_clients(infos, torch.Generator().manual_seed(4))
    scores = {c.label: float(i) for i, c in enumerate(choice.candidates)}
    answered = [replace(i, attrs={**i.attrs, "zico": scores}) if i.cid in scored else i
                for i in infos]  # fmt: skip
    choice.setup_seeded(answered, torch.Generator().manual_seed(4))  # raises on a missing one
    limited = {cid for cid in range(8) if cid not in choice.budget_of} - {0}
    assert len(limited) >= 3 and set(scored) == set(range(2, 8)) - limited
    assert scored == {cid: {"macs_budget": choice.budget_of[cid]} for cid in scored}
    assert _choice(choice="random").scored_clients(infos, torch.Generator()) == {}


def test_random_choice_and_drawn_budgets_are_seeded_and_within_budget() -> None:
    infos = [_info(c) for c in range(8)]
    a, b = _choice(choice="random"), _choice(choice="random")
    a.setup_seeded(infos, torch.Generator().manual_seed(1))
    b.setup_seeded(infos, torch.Generator().manual_seed(1))
    assert a.chosen == b.chosen and a.budget_of == b.budget_of
    assert len(a.budget_of) == 4  # half are limited
    costs = [a.macs(c) for c in a.candidates]
    for cid, budget in a.budget_of.items():
        assert budget is not None and min(costs) <= budget <= max(costs)
        assert a.macs(a.chosen[cid]) <= budget
    assert {a.chosen[c].label for c in range(8) if c not in a.budget_of} == {"d2-w0.25"}


# -- bad settings ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"depths": [1, 2]}, "depths \\[1, 2\\]: a client of depth 1 has no identity block"),
        ({"widths": [0.0, 0.5]}, "widths must be multipliers in \\(0, 1\\], got \\[0.0, 0.5\\]"),
        ({"widths": [1.5]}, "widths must be multipliers in \\(0, 1\\]"),
        ({"budgets": [0.0]}, "budgets must be positive"),
    ],
)
def test_bad_options_are_refused(options: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        FedFAOptions(**options)


def test_a_declared_depth_above_the_candidates_and_a_budget_no_candidate_fits_are_refused():
    with pytest.raises(ValueError, match=r"declares architecture 'd5-w0.5', not a candidate"):
        _fedfa().setup([_info(0, architecture="d5-w0.5")], torch.Generator())
    with pytest.raises(ValueError, match=r"budget of 1 MACs per sample fits no candidate"):
        _fedfa(limited_share=0.0).setup([_info(0, macs_budget=1)], torch.Generator())
    with pytest.raises(ValueError, match=r"grafts residual blocks.*model.name preresnet"):
        stage = ScalableFamily(
            {"family": "stage-cnn", "input_shape": (3, 8, 8), "num_classes": 4, "stages": 2}
        )
        ALGORITHMS.get("fedfa").build(
            stage, None, clients_per_round=2, train=TRAIN, macs=MacCounter(stage)
        )


# -- bytes and MACs --------------------------------------------------------------------------
def test_a_client_is_charged_the_bytes_and_macs_of_its_own_architecture(
    synthetic_federation, tmp_path
):
    """One round of a client declaring d2-w0.25 in a global model of depth 3 and width 1/2
    (the other client's d3-w0.5): its payload and upload are its own blocks only, grafting
    costs nothing on the wire. Pre-ResNet of one section at width 1/4 on 1 x 8 x 8: stem
    1 -> 16 (144), two blocks of two 16 x 16 x 3 x 3 convs (4,608) and two norms (64), the
    final norm (32), the head 16 x 10 + 10 (170). Forward MACs per sample: stem
    8 * 8 * 16 * 9 = 9,216, four convs 8 * 8 * 16 * 16 * 9 = 147,456 each, head 160; a
    training pass adds the weight gradients (the same again) and the input gradients of
    every layer but the stem: 8 samples cost 8 * (3 * 599,200 - 9,216)."""
    _, clients, test = synthetic_federation
    family = ScalableFamily(
        {"family": "preresnet", "input_shape": (1, 8, 8), "num_classes": 10, "stages": 1}
    )
    options = {"depths": [2, 3], "widths": [0.25, 0.5], "choice": "random"}
    train = LocalTraining(steps=1, batch_size=8)
    strategy, recipe = ALGORITHMS.get("fedfa").build(
        family, options, clients_per_round=2, train=train, macs=MacCounter(family)
    )
    attrs = {0: {"architecture": "d2-w0.25"}, 1: {"architecture": "d3-w0.5"}}
    settings = RoundSettings(rounds=1, seed=3, local_eval="sampled")
    sim = Simulation(
        strategy, Programs(family, recipe, seed=0), clients[:2], test, settings, tmp_path,
        attrs=attrs,
    )  # fmt: skip
    sim.run()
    assert strategy.global_spec["blocks"][0] == 3 and strategy.global_spec["widths"][0] == 0.5
    row = next(r for r in read_metrics(tmp_path / "clients.jsonl") if r["cid"] == 0)
    assert row["fields"] == {"arch": "d2-w0.25", "macs_budget": None}
    params = 144 + 2 * (4608 + 64) + 32 + 170
    assert row["bytes_down"] == row["bytes_up"] == 4 * params
    forward = 9216 + 4 * 147456 + 160
    assert strategy.describe()["architectures"]["d2-w0.25"] == {"macs": forward, "clients": [0]}
    assert row["macs"] == 8 * (2 * forward + forward - 9216)
