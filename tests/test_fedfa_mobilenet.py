"""FedFA and its baselines on MobileNetV2 (Park and Joe-Wong, "Federated Learning with
Flexible Architectures", ECML-PKDD 2024, §5.1): the depth candidates (min(d, n) blocks in a
stage of n repeats), grafting between inverted residuals, the scaled aggregate through a
depthwise convolution, FlexiFed's paths, NeFL's refusal, and a short run of each."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from hetfl.algorithms import ALGORITHMS
from hetfl.algorithms.flexifed import max_common
from hetfl.algorithms.parts.architecture_choice import ArchitectureChoice, Candidate, candidate_grid
from hetfl.algorithms.parts.grafting import graft
from hetfl.core.client.program import Programs
from hetfl.core.state import extract
from hetfl.core.training import LocalTraining
from hetfl.core.types import ClientInfo
from hetfl.data import PARTITIONERS, build_clients, global_test, load_synthetic
from hetfl.engine.outputs import read_metrics
from hetfl.engine.round_settings import RoundSettings
from hetfl.models import ScalableFamily
from hetfl.sim import Simulation
from hetfl.systems.costs import MacCounter
from strategies import constant_results, trained

TRAIN = LocalTraining(batch_size=4)


def _family(**base: object) -> ScalableFamily:
    return ScalableFamily(
        {"family": "mobilenetv2", "input_shape": (3, 16, 16), "num_classes": 4, **base}
    )


def _block(name: str) -> str:
    return ".".join(name.split(".")[:3])


# -- the candidates ---------------------------------------------------------------------------
def test_a_depth_candidate_caps_each_stage_at_its_own_repeats() -> None:
    """Table 2's repeats n = (1, 2, 3, 4, 3, 3, 1): depth d gives min(d, n) blocks, so d = 2
    is (1, 2, 2, 2, 2, 2, 1), d = 3 (1, 2, 3, 3, 3, 3, 1) and d = 4 the family's own depth;
    with 3 stages the slots beyond keep the base's; a depth above the full one is refused."""
    family = _family()
    choice = ArchitectureChoice(
        family,
        family.base,
        candidate_grid([2, 3, 4], [1.0]),
        method="fedfa",
        choice="random",
        macs=MacCounter(family),
    )
    blocks = {c.depth: choice.spec(c)["blocks"] for c in choice.candidates}
    assert blocks == {2: (1, 2, 2, 2, 2, 2, 1), 3: (1, 2, 3, 3, 3, 3, 1), 4: (1, 2, 3, 4, 3, 3, 1)}
    assert family.base["blocks"] == blocks[4]
    three = _family(stages=3)
    short = ArchitectureChoice(
        three,
        three.base,
        candidate_grid([2], [0.5]),
        method="fedfa",
        choice="random",
        macs=MacCounter(three),
    )
    assert short.spec(Candidate(2, 0.5))["blocks"] == (1, 2, 2, 4, 3, 3, 1)
    with pytest.raises(
        ValueError, match=r"depth 5 is the full model, depth 4; list depths up to 4"
    ):
        ALGORITHMS.get("fedfa").build(
            family, {"depths": [2, 5]}, clients_per_round=2, train=TRAIN, macs=MacCounter(family)
        )


def test_a_depth_that_leaves_a_stage_without_an_identity_block_is_refused() -> None:
    family = _family(stages=3)
    with pytest.raises(ValidationError, match=r"a client of depth 1 has no identity block"):
        ALGORITHMS.get("fedfa").build(
            family, {"depths": [1, 2]}, clients_per_round=2, train=TRAIN, macs=MacCounter(family)
        )
    shallow = family.normalise({**family.base, "blocks": (1, 1, 1, 1, 3, 3, 1)})
    full = family.normalise({**family.base, "blocks": (1, 2, 3, 4, 3, 3, 1)})
    with pytest.raises(ValueError, match=r"section 2: grafting stages.1.0 into stages.1.1 needs"):
        graft(family, family.index_map(shallow), shallow, full)


# -- grafting ---------------------------------------------------------------------------------
def test_grafting_fills_each_stages_missing_repeats_from_its_last_block() -> None:
    """A client of depth 2 at width 1/2, blocks (1, 2, 2, 2), in a global model of depth 4,
    (1, 2, 3, 4): block 1 of stage 3 stands in for block 2, block 1 of stage 4 for blocks
    2 and 3, every tensor of the block (expansion, depthwise, projection and their norms)
    at the client's own slice; stages 1 and 2 are whole, nothing targets a stage's first
    block, and extraction still reads the client's own blocks only."""
    family = _family(stages=4)
    local = family.normalise({**family.base, "blocks": (1, 2, 2, 2, 3, 3, 1), "width": 0.5})
    full = family.normalise({**family.base, "blocks": (1, 2, 3, 4, 3, 3, 1)})
    own = family.index_map(local)
    imap = graft(family, own, local, full)
    assert imap[: len(own)] == own
    grafted = imap[len(own) :]
    pairs = {(_block(e.local), _block(e.global_name)) for e in grafted}
    assert pairs == {
        ("stages.2.1", "stages.2.2"),
        ("stages.3.1", "stages.3.2"),
        ("stages.3.1", "stages.3.3"),
    }
    parts = {
        e.global_name.split(".", 3)[3] for e in grafted if _block(e.global_name) == "stages.3.3"
    }
    norm = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")
    assert parts == {"expand.conv.weight", "depthwise.weight", "project.weight"} | {
        f"{n}.{t}" for n in ("expand.norm", "norm1", "norm2") for t in norm
    }
    source = {e.local: e for e in own}
    for e in grafted:
        assert e.index == source[e.local].index
        assert e.global_name.split(".", 3)[3] == e.local.split(".", 3)[3]
    assert source["stages.3.1.depthwise.weight"].index[:2] == (slice(0, 192), slice(0, 1))
    identity = [[b.identity for b in s] for s in family.sections(full)]
    assert identity == [[False], [False, True], [False, True, True], [False, True, True, True]]
    with torch.device("meta"):
        state, sent = family.build(full).state_dict(), family.build(local).state_dict()
    assert set(extract(dict(state), imap)) == set(sent)


# -- the aggregate ----------------------------------------------------------------------------
def test_two_clients_of_different_depth_aggregate_a_depthwise_filter_by_hand() -> None:
    """Three stages; client 0 (d2-w0.5, blocks (1, 2, 2), 10 samples, classes 0-1) sends 1
    everywhere, client 1 (d3-w0.25, (1, 2, 3), 30 samples, classes 1-2) sends 3. Stage 3's
    third block (base hidden 6 x 32 = 192) exists only in client 1 (48 filters); client 0's
    second block (96 filters) is grafted into it. The depthwise weights' norms: 1 x
    sqrt(96 x 9) = 12 sqrt(6) and 3 x sqrt(48 x 9) = 36 sqrt(3); alpha = their mean over
    each; filters [:48] are (10 a0 + 30 a1 3) / 40, [48:96] a0 (client 0 alone); the head
    row of class 3, which no client holds, keeps its value."""
    family = _family(stages=3)
    options = {"depths": [2, 3], "widths": [0.25, 0.5], "choice": "random"}
    strategy = ALGORITHMS.get("fedfa").build(
        family, options, clients_per_round=2, train=TRAIN, macs=MacCounter(family)
    )[0]
    infos = [
        ClientInfo(0, 10, (3, 16, 16), (0, 1), {"architecture": "d2-w0.5"}),
        ClientInfo(1, 30, (3, 16, 16), (1, 2), {"architecture": "d3-w0.25"}),
    ]
    state = strategy.setup(infos, torch.Generator().manual_seed(0))
    assert strategy.global_spec["blocks"][:3] == (1, 2, 3)
    tasks = strategy.plan(1, state, infos, torch.Generator().manual_seed(1))
    results = constant_results(tasks)
    assert results[0].tensors["stages.2.1.depthwise.weight"].shape == (96, 1, 3, 3)
    assert results[1].tensors["stages.2.2.depthwise.weight"].shape == (48, 1, 3, 3)
    new = strategy.aggregate(1, state, trained(tasks, results)).state
    dw = new["stages.2.2.depthwise.weight"].double()
    assert dw.shape == (96, 1, 3, 3)
    mean = (12 * math.sqrt(6) + 36 * math.sqrt(3)) / 2
    a0, a1 = mean / (12 * math.sqrt(6)), mean / (36 * math.sqrt(3))
    both = torch.full((48, 1, 3, 3), (10 * a0 + 30 * a1 * 3) / 40, dtype=torch.float64)
    assert torch.allclose(dw[:48], both)
    assert torch.allclose(dw[48:], torch.full((48, 1, 3, 3), a0, dtype=torch.float64))
    assert torch.equal(new["head.weight"][3], state["head.weight"][3])


# -- the baselines ----------------------------------------------------------------------------
def test_flexifed_shares_mobilenet_blocks_up_to_where_the_depths_part() -> None:
    """Depths 2 and 3 on three stages, (1, 2, 2) and (1, 2, 3): every block up to stage 3's
    second is shared; stage 3's third block is d3's alone; the last convolution and the head
    follow a different block in each, so each keeps its own."""
    family = _family(stages=3)
    choice = ArchitectureChoice(
        family,
        family.base,
        candidate_grid([2, 3], [1.0]),
        method="flexifed",
        choice="random",
        macs=MacCounter(family),
    )
    groups = max_common(family, {c.label: choice.spec(c) for c in choice.candidates})
    assert {_block(t) if t.startswith("stages") else t.split(".")[0] for t in groups["d2-w1"]} == {
        "last",
        "head",
    }
    assert {_block(t) if t.startswith("stages") else t.split(".")[0] for t in groups["d3-w1"]} == {
        "stages.2.2",
        "last",
        "head",
    }
    assert set(groups["d3-w1"].values()) == {"d3-w1"}


def test_nefl_refuses_mobilenet_naming_what_takes_it() -> None:
    with pytest.raises(
        ValueError, match=r"step size.*use model.name preresnet, or fedfa or flexifed"
    ):
        ALGORITHMS.get("nefl").build(
            _family(),
            {"choice": "random"},
            clients_per_round=2,
            train=TRAIN,
            macs=MacCounter(_family()),
        )


@pytest.mark.parametrize("method", ["fedfa", "flexifed"])
def test_a_short_run_on_mobilenet_completes_with_finite_metrics(method: str, tmp_path) -> None:
    """Two clients of depths 2 and 3 of a three-stage model (widths 1/4 and 1/2 under
    FedFA), one round of two steps on a synthetic 4-class problem at 8 x 8."""
    ds = load_synthetic(n_train=64, n_test=32, num_classes=4, shape=(3, 8, 8), seed=0)
    parts = PARTITIONERS.get("iid")(ds.y_train, 2, np.random.default_rng(0))
    clients = build_clients(ds, parts, test_per_client=8, seed=0)
    family = ScalableFamily(
        {"family": "mobilenetv2", "input_shape": (3, 8, 8), "num_classes": 4, "stages": 3}
    )
    widths = [0.25, 0.5] if method == "fedfa" else [1.0]
    options = {"depths": [2, 3], "widths": widths, "choice": "random"}
    train = LocalTraining(steps=2, batch_size=8)
    strategy, recipe = ALGORITHMS.get(method).build(
        family, options, clients_per_round=2, train=train, macs=MacCounter(family)
    )
    w = widths[-1]
    attrs = {0: {"architecture": "d2-w0.25" if method == "fedfa" else "d2-w1"},
             1: {"architecture": f"d3-w{w:g}"}}  # fmt: skip
    settings = RoundSettings(rounds=1, seed=3, local_eval="sampled")
    Simulation(
        strategy, Programs(family, recipe, seed=0), clients, global_test(ds, "cpu"), settings,
        tmp_path, attrs=attrs,
    ).run()  # fmt: skip
    assert strategy.global_spec["blocks"][:3] == (1, 2, 3)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    values = [v for r in rows for k, v in r.items() if k in ("global_acc", "global_loss", "loss")]
    assert values and all(math.isfinite(v) for v in values)
