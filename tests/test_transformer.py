"""The Transformer family (`hetfl.models.transformer`): the sub-model invariant at a width
and at a depth, MACs and bytes counted by hand on the tiny preset, FedFA's grafting over
decoder blocks, the refusals, and short HeteroFL and FedFA runs on a token task."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from hetfl.algorithms import ALGORITHMS
from hetfl.algorithms.parts.grafting import graft
from hetfl.core.client.program import Programs
from hetfl.core.init import initialize
from hetfl.core.state import extract, state_bytes
from hetfl.core.training import LocalTraining
from hetfl.core.types import PassRecord
from hetfl.data import PARTITIONERS, build_clients, global_test
from hetfl.data.dataset import Dataset
from hetfl.engine.outputs import read_metrics
from hetfl.engine.round_settings import RoundSettings
from hetfl.models import ScalableFamily, SpecError
from hetfl.sim import Simulation
from hetfl.systems.costs import MacCounter

CONTEXT, VOCAB = 4, 10


def _family(**base: object) -> ScalableFamily:
    return ScalableFamily(
        {"family": "transformer-tiny", "input_shape": (CONTEXT,), "num_classes": VOCAB, **base}
    )


def _global(family: ScalableFamily) -> dict[str, torch.Tensor]:
    model = initialize(family.build(family.global_spec([])), torch.Generator().manual_seed(0))
    return model.state_dict()


def _tokens(batch: int = 3) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, CONTEXT), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("scaler", [False, True])
def test_a_model_built_at_half_width_equals_the_global_model_run_at_half_width(scaler) -> None:
    family = _family(scaler=scaler)
    state = _global(family)
    wide = family.build(family.global_spec([]))
    wide.load_state_dict(state)
    spec = family.normalise({**family.base, "width": 0.5})
    narrow = family.build(spec)
    narrow.load_state_dict(extract(state, family.index_map(spec)))
    for training in (True, False):
        wide.train(training), narrow.train(training)
        with torch.no_grad():
            assert torch.equal(wide(_tokens(), width=0.5), narrow(_tokens())), training


def test_a_shallower_sub_model_is_the_global_models_first_blocks() -> None:
    """One layer of two at width 1/2: the global model's embedding, first block, final
    norm and head, each run at width 1/2."""
    family = _family()
    state = _global(family)
    wide = family.build(family.global_spec([])).eval()
    wide.load_state_dict(state)
    spec = family.normalise({**family.base, "width": 0.5, "blocks": 1})
    sub = family.build(spec).eval()
    sub.load_state_dict(extract(state, family.index_map(spec)))
    assert {k for k in sub.state_dict() if k.startswith("stages")} == {
        k for k in state if k.startswith("stages.0.0.")
    }
    with torch.no_grad():
        h = wide.stages[0][0](wide.embed(_tokens(), 0.5), 0.5)
        by_hand = wide.head(wide.norm(h[:, -1], 0.5), 0.5)
        assert torch.equal(sub(_tokens()), by_hand)


def _hand_macs(p: float) -> int:
    """One forward pass of one sample: per layer the query, key, value and output
    projections (4 T d^2), the scores and the mix of values (2 T^2 d), the MLP (2 T d m);
    then the head at the last position (d V). Tiny: 4 heads of 8, MLP 2 x hidden."""
    d = math.ceil(p * 4) * 8
    m = math.ceil(p * 64)
    layer = 4 * CONTEXT * d * d + 2 * CONTEXT * CONTEXT * d + 2 * CONTEXT * d * m
    return 2 * layer + d * VOCAB


@pytest.mark.parametrize("p", [1.0, 0.5, 0.25])
def test_forward_macs_match_the_hand_count(p: float) -> None:
    family = _family()
    spec = family.normalise({**family.base, "width": p})
    macs = MacCounter(family).pass_macs(PassRecord(spec, "forward", 1, 1), (CONTEXT,))
    assert macs == _hand_macs(p)
    assert _hand_macs(1.0) == 67_904 and _hand_macs(0.5) == 17_568


def test_bytes_sent_are_the_sub_models_parameters_counted_by_hand() -> None:
    """Width 1/2 (hidden 16, MLP 32), one layer: embeddings V d + T d; a block's two norms
    2 x 2d, four projections 4 (d^2 + d), MLP (d m + m) + (m d + d); the final norm 2d, the
    head d V + V. Float32: 4 bytes each."""
    family = _family()
    spec = family.normalise({**family.base, "width": 0.5, "blocks": 1})
    d, m = 16, 32
    params = (VOCAB * d + CONTEXT * d) + (4 * d + 4 * (d * d + d) + d * m + m + m * d + d)
    params += 2 * d + d * VOCAB + VOCAB
    assert state_bytes(extract(_global(family), family.index_map(spec))) == 4 * params


def test_grafting_fills_the_missing_layers_from_the_clients_last_layer() -> None:
    """FedFA's Algorithm 2 on one section of decoder blocks, every one an identity block:
    a one-layer client's block 0 also stands for block 1 of the two-layer global model,
    tensor by tensor at the client's width."""
    family = _family()
    spec = family.normalise({**family.base, "width": 0.5, "blocks": 1})
    own = family.index_map(spec)
    imap = graft(family, own, spec, family.global_spec([]))
    grafted = imap[len(own) :]
    assert {e.local for e in grafted} == {k for k in family.build(spec).state_dict()
                                         if k.startswith("stages.0.0.")}  # fmt: skip
    for e in grafted:
        assert e.global_name == e.local.replace("stages.0.0.", "stages.0.1.")
        assert e.index == next(o.index for o in own if o.local == e.local)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"width": 0.3}, "whole heads"),
        ({"input_shape": (3, 4, 4)}, r"\(T,\) tokens"),
        ({"blocks": 0}, "blocks needs 1 integers >= 1"),
        ({"widths": (1.0, 0.5)}, "widths needs 1 values"),
    ],
)
def test_specs_the_family_cannot_build_are_refused(changes, message) -> None:
    with pytest.raises(SpecError, match=message):
        _family().normalise({**_family().base, **changes})


def _token_data(n_train: int = 48, n_test: int = 16) -> Dataset:
    """Contexts of a cyclic sequence (the next token is the last one plus 1 mod V)."""
    rng = np.random.default_rng(0)

    def contexts(n: int) -> tuple[np.ndarray, np.ndarray]:
        start = rng.integers(0, VOCAB, n)
        x = (start[:, None] + np.arange(CONTEXT)) % VOCAB
        return x.astype(np.int64), ((x[:, -1] + 1) % VOCAB).astype(np.int64)

    x_train, y_train = contexts(n_train)
    x_test, y_test = contexts(n_test)
    return Dataset("cycle", x_train, y_train, x_test, y_test, VOCAB)


@pytest.mark.parametrize("method", ["heterofl", "fedfa", "flexifed", "fjord"])
def test_a_short_run_on_the_transformer_completes_with_finite_metrics(method, tmp_path) -> None:
    ds = _token_data()
    parts = PARTITIONERS.get("iid")(ds.y_train, 2, np.random.default_rng(0))
    clients = build_clients(ds, parts, test_per_client=4, seed=0)
    family = _family(blocks=3)
    if method == "fedfa":  # FedFA's options take depths from 2 (§5.1's candidates)
        options = {"depths": [2, 3], "widths": [0.5, 1.0], "choice": "random"}
        attrs = {0: {"architecture": "d2-w0.5"}, 1: {"architecture": "d3-w1"}}
    elif method == "flexifed":  # no grafting: depth 1 beside 3
        options = {"depths": [1, 3], "choice": "random"}
        attrs = {0: {"architecture": "d1-w1"}, 1: {"architecture": "d3-w1"}}
    else:
        options, attrs = {"levels": (1.0, 0.5)}, None
    train = LocalTraining(steps=2, batch_size=8)
    strategy, recipe = ALGORITHMS.get(method).build(
        family, options, clients_per_round=2, train=train, macs=MacCounter(family)
    )
    settings = RoundSettings(rounds=1, seed=3, local_eval="sampled")
    Simulation(
        strategy, Programs(family, recipe, seed=0), clients, global_test(ds, "cpu"), settings,
        tmp_path, attrs=attrs,
    ).run()  # fmt: skip
    assert strategy.global_spec["blocks"] == (3,)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    values = [rows[-1][k] for k in ("global_acc", "test_loss", "loss")]
    assert all(v is not None and math.isfinite(v) for v in values), values
    # Perplexity: exp of the global test loss; the local one, each evaluated client's
    # exp(local_loss), averaged over clients (FedFA's "average local perplexity").
    assert rows[-1]["global_ppl"] == pytest.approx(math.exp(rows[-1]["test_loss"]), rel=1e-12)
    traced = [json.loads(line) for line in (tmp_path / "clients.jsonl").read_text().splitlines()]
    local = [math.exp(c["local_loss"]) for c in traced if c.get("local_loss") is not None]
    assert local and rows[-1]["local_ppl"] == pytest.approx(sum(local) / len(local), rel=1e-12)
    assert 1.0 < rows[-1]["local_ppl"] < 2 * VOCAB  # near chance (V) after two steps


def test_nefl_refuses_the_transformer_naming_what_takes_it() -> None:
    family = _family()
    with pytest.raises(ValueError, match="fedfa or flexifed on transformer-tiny"):
        ALGORITHMS.get("nefl").build(
            family,
            {"choice": "random"},
            clients_per_round=2,
            train=LocalTraining(batch_size=4),
            macs=MacCounter(family),
        )
