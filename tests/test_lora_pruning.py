"""HetLoRA's local rank self-pruning (Cho et al., EMNLP 2024, §3): the regulariser's value
and gradient by hand, the pruning rule on constructed norms, a run whose pruned ranks
persist, price its bytes and survive a resume, and bad settings refused."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from hetfl.algorithms import ALGORITHMS
from hetfl.algorithms.parts.lora_pruning import (
    PrunedRanks,
    TailRegulariser,
    pruned_rank,
    tail_norm,
)
from hetfl.algorithms.parts.width_assignment import WidthAssignment
from hetfl.core.types import ClientInfo, ClientResult, PassRecord, Trained, TrainedRound
from hetfl.models.base import PlainFamily
from hetfl.models.lora import LoRAFamily
from hetfl.systems.costs import MacCounter
from lora_runs import TRAIN, lora_run

#: The MLP's adapted layers (in + out): 64 -> 200, 200 -> 200, 200 -> 10.
MLP_IN_OUT = (64 + 200) + (200 + 200) + (200 + 10)


def test_pruned_rank_is_the_floor_of_gamma_r_and_at_least_one() -> None:
    cases = {(16, 0.99): 15, (2, 0.99): 1, (4, 0.5): 2, (5, 0.5): 2, (1, 0.5): 1, (100, 0.29): 29}
    assert {case: pruned_rank(*case) for case in cases} == cases


def test_the_regulariser_is_lambda_times_the_trailing_products_norm_by_hand() -> None:
    """Layer "p" of rank 4, γ = 1/2: components 2 and 3 trail; B_tail A_tail is
    [[1, 0, 0], [0, 2, 0]], norm √5. Layer "q" of rank 2: component 1 trails, the outer
    product of (3, 4) and (1, 0), norm 5. The leading components do not enter."""
    a_p = torch.tensor([[9.0, 9, 9], [9, 9, 9], [1, 0, 0], [0, 2, 0]], requires_grad=True)
    b_p = torch.tensor([[7.0, 7, 1, 0], [7, 7, 0, 1]], requires_grad=True)
    a_q = torch.tensor([[5.0, 5], [1, 0]], requires_grad=True)
    b_q = torch.tensor([[6.0, 3], [6, 4]], requires_grad=True)
    params = {"p.A": a_p, "p.B": b_p, "q.A": a_q, "q.B": b_q}
    term = TailRegulariser((("p.A", "p.B"), ("q.A", "q.B")), gamma=0.5, lam=0.1)
    value = term(torch.zeros(1), torch.zeros(1), torch.zeros(1), SimpleNamespace(params=params))
    assert value is not None
    assert value.item() == pytest.approx(0.1 * (5**0.5 + 5), rel=1e-6)
    value.backward()
    # d/dB_tail λ‖B_tail A_tail‖ = λ (B_tail A_tail) A_tailᵀ / ‖·‖; the leading part: zero
    assert torch.equal(b_p.grad[:, :2], torch.zeros(2, 2)) and torch.equal(
        a_p.grad[:2], torch.zeros(2, 3)
    )
    product, a_tail = torch.tensor([[1.0, 0, 0], [0, 2, 0]]), torch.tensor([[1.0, 0, 0], [0, 2, 0]])
    want = 0.1 * product @ a_tail.T / 5**0.5  # [[0.1, 0], [0, 0.4]] / √5
    torch.testing.assert_close(b_p.grad[:, 2:], want)
    # a rank-1 layer has no trailing part: nothing to add
    assert tail_norm({"a": torch.ones(1, 3), "b": torch.ones(2, 1)}, [("a", "b")], 0.5) is None
    zero = TailRegulariser((("p.A", "p.B"),), gamma=0.5, lam=0.0)
    assert (
        zero(torch.zeros(1), torch.zeros(1), torch.zeros(1), SimpleNamespace(params=params)) is None
    )


def _ledger(gamma: float = 0.5) -> tuple[PrunedRanks, list[ClientInfo]]:
    """Self-pruning over the linear classifier (64 -> 10), ranks {2, 4}: client 0 rank 2,
    client 1 rank 4."""
    family = LoRAFamily(PlainFamily("linear", (1, 8, 8), 10), max_rank=4, alpha=8.0)
    inner = WidthAssignment([0.5, 1.0], None, lambda level: family.spec_at(round(level * 4)))
    ranks = PrunedRanks(inner, family, gamma)
    infos = [ClientInfo(cid, 10, (1, 8, 8), tuple(range(10))) for cid in range(2)]
    ranks.setup(infos)
    return ranks, infos


def _factors(rank: int, tail: float) -> dict[str, torch.Tensor]:
    """Rank-`rank` factors of the head whose trailing product (γ = 1/2) has norm `tail`:
    B's trailing columns e_0 · tail, A's trailing rows e_0; leading parts large."""
    a, b = torch.full((rank, 64), 3.0), torch.full((10, rank), 3.0)
    start = pruned_rank(rank, 0.5)
    a[start:], b[:, start:] = 0.0, 0.0
    a[start, 0], b[0, start] = 1.0, tail
    return {"head.lora_A": a, "head.lora_B": b}


def test_a_client_prunes_only_when_its_trailing_norm_fell_below_its_previous_rounds() -> None:
    ranks, (c0, c1) = _ledger()
    ranks.decide(1, _factors(4, 2.0))  # first participation: no previous round
    assert ranks.rank_of(1) is None and int(ranks.spec_of(c1)["lora_rank"]) == 4
    ranks.decide(1, _factors(4, 2.0))  # equal: not smaller
    assert ranks.rank_of(1) is None
    ranks.decide(1, _factors(4, 1.5))  # fell: ⌊4 / 2⌋ = 2
    assert ranks.rank_of(1) == 2
    assert [int(s["lora_rank"]) for s in ranks.specs_in_round(3, [c0, c1], torch.Generator())] == [
        2,
        2,
    ]
    ranks.decide(1, _factors(2, 3.0))  # rose (at rank 2): keeps rank 2
    assert ranks.rank_of(1) == 2
    ranks.decide(1, _factors(2, 0.5))  # fell: ⌊2 / 2⌋ = 1, the floor
    ranks.decide(1, {"head.lora_A": torch.ones(1, 64), "head.lora_B": torch.ones(10, 1)})
    assert ranks.rank_of(1) == 1 and int(ranks.spec_of(c1)["lora_rank"]) == 1
    assert ranks.rank_of(0) is None and int(ranks.spec_of(c0)["lora_rank"]) == 2
    # the record round-trips through the extra state
    again, _ = _ledger()
    again.load_extra_state(ranks.extra_state())
    assert (again.ranks, again.tails) == (ranks.ranks, ranks.tails)


def _answered(strategy, state, infos, tails, gen):
    """Round `len(tails)`'s tasks answered with random factors whose trailing parts
    (γ = 1/2) are scaled to have norm `tails[i]`; with the factors (float64)."""
    tasks = strategy.plan(1, state, infos, gen)
    trained, factors = [], []
    for task, tail in zip(tasks, tails, strict=True):
        r = int(task.spec["lora_rank"])
        a, b = torch.randn(r, 64, generator=gen), torch.randn(10, r, generator=gen)
        s = pruned_rank(r, 0.5)
        b[:, s:] *= tail / torch.linalg.matrix_norm(b[:, s:] @ a[s:])
        result = ClientResult(task.cid, {"head.lora_A": a, "head.lora_B": b}, 10, 1, 0.0)
        trained.append(Trained(task, result))
        factors.append((a.double().numpy(), b.double().numpy()))
    return TrainedRound(tuple(trained)), factors


def test_a_pruning_client_is_aggregated_with_its_factors_cut_to_its_new_rank() -> None:
    """Two rounds of clients of ranks 2 and 4 on the linear classifier, γ = 1/2: in round
    2 the rank-4 client's trailing norm falls (1.0 -> 0.5) and the rank-2 client's rises,
    so the rank-4 client sends only its leading 2 components: round 2's state is the
    sparsity-weighted zero-padded mean with its factors cut, by NumPy (components 2 and 3,
    which no client sent, keep their values: HetFL's fill "keep")."""
    family = PlainFamily("linear", (1, 8, 8), 10)
    opts = {"ranks": [2, 4], "self_pruning": {"enabled": True, "gamma": 0.5}}
    strategy, _ = ALGORITHMS.get("hetlora").build(family, opts, clients_per_round=2, train=TRAIN)
    infos = [ClientInfo(cid, 10, (1, 8, 8), tuple(range(10))) for cid in range(2)]
    gen = torch.Generator().manual_seed(0)
    state = strategy.setup(infos, gen)
    first, _ = _answered(strategy, state, infos, [1.0, 1.0], gen)
    state = strategy.aggregate(1, state, first).state
    second, factors = _answered(strategy, state, infos, [2.0, 0.5], gen)
    new = strategy.aggregate(2, state, second).state
    assert strategy.assignment.rank_of(1) == 2 and strategy.assignment.rank_of(0) is None
    (a0, b0), (a1, b1) = factors
    sent = [(a0, b0), (a1[:2], b1[:, :2])]  # the pruning client's cut factors
    w = [np.linalg.norm(b @ a) for a, b in sent]  # ‖B_k A_k‖_F of what each sends
    want_a, want_b = state["head.lora_A"].double().numpy(), state["head.lora_B"].double().numpy()
    want_a[:2], want_b[:, :2] = 0.0, 0.0
    for wk, (a, b) in zip(w, sent, strict=True):
        want_a[:2] += wk * a / sum(w)
        want_b[:, :2] += wk * b / sum(w)
    np.testing.assert_allclose(new["head.lora_A"].numpy(), want_a, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(new["head.lora_B"].numpy(), want_b, rtol=1e-5, atol=1e-5)
    # round 3: the pruned client is planned at rank 2, the other keeps its rank
    assert [int(t.spec["lora_rank"]) for t in strategy.plan(3, new, infos, gen)] == [2, 2]


def _pruning_run(synthetic, run_dir, *, rounds: int, resume: bool = False):
    pruning = {"enabled": True, "gamma": 0.5, "lam": 1.0}
    options = {"ranks": [2, 4], "self_pruning": pruning}
    return lora_run("hetlora", options, synthetic, run_dir, rounds=rounds, resume=resume)


def test_pruned_ranks_persist_are_priced_and_survive_a_resume(synthetic_federation, tmp_path):
    """5 rounds of 4 of 8 clients (ranks 2 and 4, γ = 1/2, λ = 1): the trace's ranks never
    grow, some client prunes and keeps its lower rank, each round's bytes are its clients'
    ranks' factors and each client's MACs its rank's training pass, and a run stopped
    after round 2 and resumed is the same run."""
    sim, rows, trace = _pruning_run(synthetic_federation, tmp_path / "whole", rounds=5)
    trained = [r for r in trace if r["fields"]]
    by_client: dict[int, list[int]] = {}
    for r in trained:
        by_client.setdefault(r["cid"], []).append(r["fields"]["rank"])
    assert all(a >= b for ranks in by_client.values() for a, b in itertools.pairwise(ranks))
    pruned = {cid for cid, ranks in by_client.items() if ranks[-1] < ranks[0]}
    assert pruned, by_client
    assert all(sim.strategy.assignment.rank_of(cid) is not None for cid in pruned)
    for rnd in range(1, 6):
        ranks = sum(r["fields"]["rank"] for r in trained if r["round"] == rnd)
        up = rows[rnd - 1]["bytes_up"] - (rows[rnd - 2]["bytes_up"] if rnd > 1 else 0)
        assert up == ranks * MLP_IN_OUT * 4, rnd  # float32 A (r x in) and B (out x r)
    family, counter = sim.strategy.family, MacCounter(sim.strategy.family)
    for r in trained:  # each client: its rank's factors both ways, one epoch at its rank
        rank = r["fields"]["rank"]
        assert r["bytes_down"] == r["bytes_up"] == rank * MLP_IN_OUT * 4
        one_epoch = PassRecord(family.spec_at(rank), "train", r["samples"], 1)
        assert r["macs"] == counter.pass_macs(one_epoch, (1, 8, 8)), r
    _pruning_run(synthetic_federation, tmp_path / "part", rounds=2)
    resumed, rows_r, trace_r = _pruning_run(
        synthetic_federation, tmp_path / "part", rounds=5, resume=True
    )
    for name, tensor in sim.state.items():
        assert torch.equal(tensor, resumed.state[name]), name
    assert [(r["round"], r["cid"], r["fields"]) for r in trace_r] == [
        (r["round"], r["cid"], r["fields"]) for r in trace
    ]
    assert rows_r[-1]["bytes_up"] == rows[-1]["bytes_up"]
    assert resumed.strategy.assignment.extra_state() == sim.strategy.assignment.extra_state()


def test_self_pruning_is_off_by_default_and_bad_settings_are_refused() -> None:
    options = ALGORITHMS.get("hetlora").options
    assert options().self_pruning.enabled is False
    family = PlainFamily("linear", (1, 8, 8), 10)
    _, recipe = ALGORITHMS.get("hetlora").build(family, {}, clients_per_round=2, train=TRAIN)
    assert recipe.loss_terms == ()
    for gamma, message in ((0.0, "greater than 0"), (1.0, "less than 1"), (1.5, "less than 1")):
        with pytest.raises(ValidationError, match=rf"self_pruning\.gamma\n.*{message}"):
            options(self_pruning={"enabled": True, "gamma": gamma})
    with pytest.raises(ValidationError, match=r"self_pruning\.lam\n.*greater than or equal to 0"):
        options(self_pruning={"enabled": True, "lam": -0.1})
    with pytest.raises(ValidationError, match=r"self_pruning\.lambda\n.*Extra inputs"):
        options(self_pruning={"enabled": True, "lambda": 0.1})
