"""Heterogeneous-rank LoRA: the adapter wrapper, and HetLoRA's, FlexLoRA's and FLoRA's
aggregation, each against a direct NumPy computation (float32 rounding), bytes and MACs by
hand, FLoRA's bases consistent without being sent, and bad settings refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from hetfl.algorithms import ALGORITHMS
from hetfl.algorithms.parts.lora_aggregation import (
    ProductSVD,
    SparsityWeights,
    stack_factors,
)
from hetfl.algorithms.parts.lora_stacking import server_copy
from hetfl.core.client.trainable import trainable_names
from hetfl.core.init import build_model, initialize
from hetfl.core.server.update import RoundResults
from hetfl.core.simulator_only import SimulatorOnlyError, refuse_simulator_only
from hetfl.core.state import Accumulator
from hetfl.core.types import ClientInfo, ClientResult, PassRecord, Trained, TrainedRound
from hetfl.models import ScalableFamily
from hetfl.models.base import PlainFamily
from hetfl.models.lora import LoRAFamily, load_base_state
from hetfl.systems.costs import MacCounter
from lora_runs import TRAIN, lora_run

ATOL = 1e-5


def _linear(max_rank: int = 4, alpha: float = 8.0, **kw) -> LoRAFamily:
    """LoRA on the one-layer linear classifier: 64 inputs, 10 classes."""
    return LoRAFamily(PlainFamily("linear", (1, 8, 8), 10), max_rank=max_rank, alpha=alpha, **kw)


# -- the wrapper ---------------------------------------------------------------------------
def test_a_lora_layer_is_its_frozen_base_plus_the_scaled_product(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(3)
    base = {"head.weight": torch.randn(10, 64, generator=gen), "head.bias": torch.randn(10)}
    torch.save(base, tmp_path / "base.pt")
    family = _linear(pretrained=load_base_state(tmp_path / "base.pt"))
    model = initialize(build_model(family, family.spec_at(2)), gen)
    assert set(model.state_dict()) == {"head.lora_A", "head.lora_B"}  # the base is never sent
    assert trainable_names(model) == {"head.lora_A", "head.lora_B"}
    with torch.no_grad():
        model.head.lora_B.normal_(generator=gen)  # B starts at zero; give it a value
    x = torch.randn(5, 1, 8, 8, generator=gen)
    a, b = model.head.lora_A.detach().numpy(), model.head.lora_B.detach().numpy()
    flat = x.flatten(1).numpy().astype(np.float64)
    want = flat @ base["head.weight"].numpy().T + base["head.bias"].numpy()
    want += (8.0 / 4) * flat @ a.T @ b.T  # one scale α / R for every rank
    np.testing.assert_allclose(model(x).detach().numpy(), want, atol=ATOL)


def test_the_base_is_the_same_for_every_client_and_a_misfit_is_refused(tmp_path: Path) -> None:
    one = build_model(_linear(), _linear().spec_at(1))
    other = initialize(build_model(_linear(), _linear().spec_at(4)), torch.Generator())
    assert torch.equal(one.head.weight, other.head.weight)  # seed-0 base, not re-drawn
    torch.save({"head.weight": torch.zeros(3, 3)}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match=r"missing \['head.bias'\].*wrong shapes \['head.weight"):
        _linear(pretrained=load_base_state(tmp_path / "bad.pt"))
    with pytest.raises(FileNotFoundError, match="pretrained: no file"):
        load_base_state(tmp_path / "absent.pt")


def test_a_base_with_running_statistics_is_refused() -> None:
    spec = {"family": "stage-cnn", "input_shape": (1, 8, 8), "num_classes": 10, "stages": 2}
    with pytest.raises(ValueError, match="running statistics"):
        LoRAFamily(ScalableFamily({**spec, "bn": "batch"}), max_rank=2, alpha=2.0)
    plain = LoRAFamily(ScalableFamily({**spec, "bn": "none"}), max_rank=2, alpha=2.0)
    assert plain.layers == ["head"]  # a CNN's linear layers take adapters


def test_macs_of_a_lora_training_pass_by_hand() -> None:
    """Linear 64 -> 10 at rank 3, batch 4. Forward: the base's D C, A x's r D, B h's C r.
    Backward: nothing for the frozen base (its input needs no gradient either), B's and
    h's gradients C r each, A's r D (x needs none): per sample D C + 2 r D + 3 C r."""
    family = _linear()
    record = PassRecord(family.spec_at(3), "train", 4, 1)
    per_sample = 64 * 10 + 2 * 3 * 64 + 3 * 10 * 3
    assert MacCounter(family).pass_macs(record, (1, 8, 8)) == 4 * per_sample


# -- aggregation, against direct computations -------------------------------------------
RANKS = (1, 2, 4)  # R = 4
N = (30, 10, 20)


def _round(name: str, options: dict | None = None):
    """A planned round of 3 clients of ranks 1, 2, 4 on the linear model, answered with
    random factors of their shapes; with the strategy and the factors (float64)."""
    family = PlainFamily("linear", (1, 8, 8), 10)
    opts = {"ranks": list(RANKS), **(options or {})}
    strategy, _ = ALGORITHMS.get(name).build(family, opts, clients_per_round=3, train=TRAIN)
    infos = [ClientInfo(cid, n, (1, 8, 8), tuple(range(10))) for cid, n in enumerate(N)]
    gen = torch.Generator().manual_seed(0)
    state = strategy.setup(infos, gen)
    tasks = strategy.plan(1, state, infos, gen)
    trained, factors = [], []
    for task, n in zip(tasks, N, strict=True):
        r = int(task.spec["lora_rank"])
        a, b = torch.randn(r, 64, generator=gen), torch.randn(10, r, generator=gen)
        result = ClientResult(task.cid, {"head.lora_A": a, "head.lora_B": b}, n, 1, 0.0)
        trained.append(Trained(task, result))
        factors.append((a.double().numpy(), b.double().numpy()))
    return strategy, state, TrainedRound(tuple(trained)), factors


def _padded(factors):
    """Each client's (A, B) zero-padded to rank 4, with its coverage masks."""
    out = []
    for a, b in factors:
        r = a.shape[0]
        pa, pb = np.zeros((4, 64)), np.zeros((10, 4))
        pa[:r], pb[:, :r] = a, b
        ma, mb = np.zeros((4, 64)), np.zeros((10, 4))
        ma[:r], mb[:, :r] = 1, 1
        out.append((pa, pb, ma, mb))
    return out


def test_hetlora_zero_pads_over_all_clients_with_sparsity_weights() -> None:
    strategy, state, trained, factors = _round("hetlora")
    new = strategy.aggregate(1, state, trained).state
    w = [np.linalg.norm(b @ a) for a, b in factors]  # ‖B_k A_k‖_F, HetLoRA's weight
    padded = _padded(factors)
    want_a = sum(wk * pa for wk, (pa, _, _, _) in zip(w, padded, strict=True)) / sum(w)
    want_b = sum(wk * pb for wk, (_, pb, _, _) in zip(w, padded, strict=True)) / sum(w)
    np.testing.assert_allclose(new["head.lora_A"].numpy(), want_a, rtol=1e-5, atol=ATOL)
    np.testing.assert_allclose(new["head.lora_B"].numpy(), want_b, rtol=1e-5, atol=ATOL)


def test_coverage_normalisation_is_heterofls_per_element_mean() -> None:
    strategy, state, trained, factors = _round(
        "hetlora", {"normalisation": "coverage", "weighting": "samples"}
    )
    new = strategy.aggregate(1, state, trained).state
    padded = _padded(factors)
    num = sum(n * pa for n, (pa, _, _, _) in zip(N, padded, strict=True))
    den = sum(n * ma for n, (_, _, ma, _) in zip(N, padded, strict=True))
    np.testing.assert_allclose(new["head.lora_A"].numpy(), num / den, rtol=1e-5, atol=ATOL)
    num_b = sum(n * pb for n, (_, pb, _, _) in zip(N, padded, strict=True))
    den_b = sum(n * mb for n, (_, _, _, mb) in zip(N, padded, strict=True))
    np.testing.assert_allclose(new["head.lora_B"].numpy(), num_b / den_b, rtol=1e-5, atol=ATOL)


def test_flexlora_gives_each_rank_the_truncated_svd_of_the_weighted_products() -> None:
    strategy, state, trained, factors = _round("flexlora")
    new = strategy.aggregate(1, state, trained).state
    delta = sum(n / sum(N) * (b @ a) for n, (a, b) in zip(N, factors, strict=True))
    u, s, vh = np.linalg.svd(delta, full_matrices=False)
    for r in (1, 2, 3, 4):  # a rank-r client extracts the leading r components
        got = new["head.lora_B"][:, :r].double() @ new["head.lora_A"][:r].double()
        want = (u[:, :r] * s[:r]) @ vh[:r]
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-4)


def test_flora_stacks_into_the_exact_weighted_sum_of_products() -> None:
    gen = torch.Generator().manual_seed(1)
    factors = [(torch.randn(r, 6, generator=gen), torch.randn(5, r, generator=gen)) for r in RANKS]
    a, b = stack_factors(factors, [float(n) for n in N])
    assert a.shape == (sum(RANKS), 6) and b.shape == (5, sum(RANKS))  # grows with the cohort
    want = sum(
        n / sum(N) * (bk.double() @ ak.double()) for n, (ak, bk) in zip(N, factors, strict=True)
    )
    np.testing.assert_allclose((b @ a).numpy(), want.numpy(), rtol=1e-5, atol=ATOL)


def test_flexlora_refuses_per_tensor_weights() -> None:
    results = [ClientResult(0, {"a": torch.ones(1, 2), "b": torch.ones(2, 1)}, 1, 1, 0.0)]
    done = RoundResults(results, [[]], [{"a": 1.0}], [], Accumulator)
    with pytest.raises(TypeError, match="one number"):
        ProductSVD([("a", "b")]).step({"a": torch.ones(1, 2), "b": torch.ones(2, 1)}, {}, done)
    # B A is the 2 x 2 matrix of ones: its Frobenius norm is 2, on both factors
    assert SparsityWeights([("a", "b")])(results[0]) == {"a": 2.0, "b": 2.0}


# -- runs: bytes by hand, FLoRA's consistent bases --------------------------------------
def _run(name, synthetic, tmp_path, *, rounds=2, cpr=4):
    sim, rows, _ = lora_run(name, {"ranks": [2, 4]}, synthetic, tmp_path, rounds=rounds, cpr=cpr)
    return sim, rows


#: The MLP's adapted layers (in + out): 64 -> 200, 200 -> 200, 200 -> 10.
MLP_IN_OUT = (64 + 200) + (200 + 200) + (200 + 10)


@pytest.mark.parametrize("name", ["hetlora", "flexlora"])
def test_a_client_sends_and_receives_its_ranks_factors(name, synthetic_federation, tmp_path):
    """Every client of 8, ranks dealt smallest first: four of rank 2, four of rank 4; each
    downloads and uploads its float32 A (r x in) and B (out x r) of every layer."""
    _, rows = _run(name, synthetic_federation, tmp_path, rounds=1, cpr=8)
    factors = (4 * 2 + 4 * 4) * MLP_IN_OUT * 4
    assert (rows[0]["bytes_down"], rows[0]["bytes_up"]) == (factors, factors)


def test_flora_bases_agree_without_being_sent_and_the_stack_grows_with_the_cohort(
    synthetic_federation, tmp_path
):
    sim, rows = _run("flora", synthetic_federation, tmp_path, rounds=3, cpr=8)
    stack = (4 * 2 + 4 * 4) * MLP_IN_OUT * 4  # Σ_k r_k rows of A and columns of B, float32
    uploads = (4 * 2 + 4 * 4) * MLP_IN_OUT * 4  # each client its own factors
    assert [r["bytes_up"] for r in rows] == [uploads, 2 * uploads, 3 * uploads]
    # Round 1 sends nothing down (fresh adapters, no stack yet); then every client the stack.
    assert [r["bytes_down"] for r in rows] == [0, 8 * stack, 2 * 8 * stack]
    layers = sim.strategy.family.layers
    assert layers == ["body.1", "body.3", "head"]
    # Each client merged rounds 1 and 2 (round 3's stack is still pending): pending merged
    # now equals the server's copy, to the bit, since both compute M + s B A alike.
    for cid in range(8):
        own, pending = sim.store.get(cid), sim.downloads.get(cid)
        for path in layers:
            server = sim.state[server_copy(path)]
            merged = own[f"{path}.merged"] + sim.strategy.family.scale * (
                pending[f"{path}.stack_B"] @ pending[f"{path}.stack_A"]
            )
            assert torch.equal(merged, server), (cid, path)
            assert server.abs().sum() > 0


# -- settings ---------------------------------------------------------------------------
def test_bad_settings_are_refused_naming_them(synthetic_federation) -> None:
    options = ALGORITHMS.get("hetlora").options
    for ranks in ([0, 2], [2, 2], []):
        with pytest.raises(ValidationError, match="ranks must be distinct integers >= 1"):
            options(ranks=ranks)
    with pytest.raises(ValidationError, match="greater than 0"):
        options(alpha=0)
    family, clients, _ = synthetic_federation
    with pytest.raises(ValueError, match="flora stacks each client's factors with p_k ∝ n_k"):
        ALGORITHMS.get("flora").build(family, {"weighting": "uniform"}, clients_per_round=8,
                                      train=TRAIN)  # fmt: skip
    strategy, _ = ALGORITHMS.get("flora").build(family, {}, clients_per_round=4, train=TRAIN)
    with pytest.raises(ValueError, match="set it to 8"):
        strategy.setup([c.info() for c in clients], torch.Generator())
    with pytest.raises(SimulatorOnlyError, match="server phase's download"):
        refuse_simulator_only("flora", ALGORITHMS.get("flora").simulator_only)


def test_pretraining_uses_only_the_documents_no_client_holds(tmp_path: Path) -> None:
    """pydoc-topics dealt by document to 4 clients: the pretraining samples are the other
    documents' training samples, and the saved base loads as a LoRA base."""
    from hetfl.assembly import load_dataset, partition
    from hetfl.config import validate
    from hetfl.models import make_family
    from hetfl.pretrain import pretrain_base, unused_samples

    raw = {
        "data": {"dataset": "pydoc-topics", "num_clients": 4, "partition": {"kind": "natural"}},
        "model": {"name": "transformer-tiny"},
        "train": {"batch_size": 8, "lr": 0.05, "clients_per_round": 4},
    }
    cfg = validate(raw)
    dataset = load_dataset(cfg)
    dealt = np.concatenate(partition(cfg, dataset))
    x, y, classes = unused_samples(cfg)
    assert len(y) == len(dataset.y_train) - len(dealt) > 0
    held = {tuple(row) for row in dataset.x_train[dealt].tolist()}
    assert not any(tuple(row) in held for row in x[:200].tolist())  # other documents' contexts
    path = pretrain_base(cfg, 2, tmp_path / "base.pt")
    base = make_family("transformer-tiny", (32,), classes)
    lora = LoRAFamily(base, max_rank=2, alpha=2.0, pretrained=load_base_state(path))
    model = build_model(lora, lora.spec_at(1))
    saved = torch.load(path, weights_only=True)
    assert torch.equal(model.embed.tokens.weight, saved["embed.tokens.weight"])
    with pytest.raises(ValueError, match="steps must be >= 1"):
        pretrain_base(cfg, 0, tmp_path / "none.pt")
