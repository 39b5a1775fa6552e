"""FedFA's baselines on FedFA's architectures: FlexiFed (Max-Common) and NeFL.

Hand computations: Max-Common's groups on hand-made architectures and the averages they
give; NeFL's per-sub-model BatchNorm and step sizes, and its nested average of the other
weights; the step size on a residual branch; a sub-model's bytes and MACs. The assignment
is FedFA's: the same seed, options and clients give the same architectures under all three
methods. Errors: mixed widths under FlexiFed, a step size the family cannot take.
"""

from __future__ import annotations

import pytest
import torch

from hetfl.algorithms import ALGORITHMS
from hetfl.algorithms.flexifed import max_common
from hetfl.algorithms.parts.architecture_choice import ArchitectureChoice, ZicoQuery, candidate_grid
from hetfl.core.client.recipe import CrossEntropy
from hetfl.core.client.terms import MaskedCrossEntropy
from hetfl.core.rng import torch_generator
from hetfl.core.spec import GROUP_SEP
from hetfl.core.state import state_bytes
from hetfl.core.training import LocalTraining
from hetfl.core.types import ClientData, ClientInfo, ClientResult, PassRecord
from hetfl.models import ScalableFamily, SpecError
from hetfl.models.blocks import PreActBlock
from hetfl.models.norms import BatchNorm
from hetfl.systems.costs import MacCounter
from strategies import trained

TRAIN = LocalTraining(lr=0.05, epochs=1, batch_size=4)
#: A two-section Pre-ResNet on 8x8 single-channel inputs.
FAMILY = ScalableFamily(
    {"family": "preresnet", "input_shape": (1, 8, 8), "num_classes": 10, "stages": 2}
)


def _infos(
    archs: list[str | None], labels: list[tuple[int, ...]] | None = None
) -> list[ClientInfo]:
    held = labels or [tuple(range(10))] * len(archs)
    return [
        ClientInfo(cid, 20, (1, 8, 8), classes, {} if a is None else {"architecture": a})
        for cid, (a, classes) in enumerate(zip(archs, held, strict=True))
    ]


def _build(method: str, **options: object):
    opts = {"choice": "random", **options}
    return ALGORITHMS.get(method).build(
        FAMILY, opts, clients_per_round=4, train=TRAIN, macs=MacCounter(FAMILY)
    )[0]


def _round(strategy, clients: list[str], values: list[float], labels=None):
    """Set up with clients declaring `clients` (holding `labels`, default every class), plan
    one round with every client, and aggregate results in which client i sends `values[i]`
    in every element; returns the tasks, the state before and after."""
    infos = _infos(clients, labels)
    state = strategy.setup(infos, torch_generator(0, 0, -1, "init"))
    tasks = strategy.plan(1, state, infos, torch_generator(0, 1, -1, "sample"))
    results = [
        ClientResult(t.cid, {k: torch.full_like(v, x) for k, v in t.payload.items()}, 20, 1, 0.0)
        for t, x in zip(tasks, values, strict=True)
    ]
    return tasks, state, strategy.aggregate(1, state, trained(tasks, results)).state


def _is(t: torch.Tensor, value: float) -> bool:
    return torch.allclose(t.double(), torch.full(t.shape, value, dtype=torch.float64), atol=1e-6)


# -- the assignment is FedFA's ---------------------------------------------------------------------
def _data(cid: int) -> ClientData:
    g = torch.Generator().manual_seed(cid)
    x, y = torch.randn(8, 1, 8, 8, generator=g), torch.randint(10, (8,), generator=g)
    return ClientData(cid, x, y, x[:0], y[:0], num_classes=10)


@pytest.mark.parametrize(
    ("baseline", "depths", "widths"),
    [("nefl", [2, 3], [0.125, 0.25]), ("flexifed", [2, 3, 4], [0.125])],
)
def test_fedfa_and_its_baselines_put_the_same_clients_on_the_same_architectures(
    baseline, depths, widths
) -> None:
    """Ten clients, one seed, the same options: FedFA and NeFL (depths x widths), FedFA
    and FlexiFed (depths at one width) choose alike, drawn budgets included."""
    infos = _infos([None] * 10)
    chosen, budgets = [], []
    for method in ("fedfa", baseline):
        strategy = _build(method, depths=depths, widths=widths)
        strategy.setup(infos, torch_generator(0, 0, -1, "init"))
        chosen.append({cid: c.label for cid, c in strategy.assignment.chosen.items()})
        budgets.append(strategy.assignment.budget_of)
    assert chosen[0] == chosen[1] and budgets[0] == budgets[1]
    assert len(set(chosen[0].values())) > 1  # not trivially alike


def test_zico_scores_the_architecture_whichever_method_asks() -> None:
    """A client's ZiCo answer is the same under FedFA (static BatchNorm) and NeFL (running
    statistics, step sizes), and under a method without normalisation, whose models ZiCo
    would score otherwise: the candidates are scored as architectures, so the same scores
    give the same choices."""
    info, data = _infos([None])[0], _data(0)
    grid = candidate_grid([2, 3], [0.125, 0.25])
    answers = []
    for method in ("fedfa", "nefl"):
        strategy = _build(method, depths=[2, 3], widths=[0.125, 0.25], choice="zico")
        query = strategy.capabilities.setup_query
        assert query is not None
        answers.append(query(info, data, torch_generator(0, 0, 0, "setup-query")))
    plain = ArchitectureChoice(
        FAMILY,
        FAMILY.base,
        grid,
        method="plain",
        choice="zico",
        normalisation={"bn": "none"},
        macs=MacCounter(FAMILY),
    )
    query = ZicoQuery(FAMILY, plain, TRAIN.batch_size)
    answers.append(query(info, data, torch_generator(0, 0, 0, "setup-query")))
    assert answers[0] == answers[1] == answers[2] and len(answers[0]["zico"]) == 4


# -- FlexiFed: Max-Common --------------------------------------------------------------------------
def test_max_common_groups_by_hand() -> None:
    """Hand-made architectures a (1+1 blocks), b (1+2), c (2+2): pipelines a = stem s0.0
    s1.0 head, b = stem s0.0 s1.0 s1.1 head, c = stem s0.0 s0.1 s1.0 s1.1 head. The stem
    and s0.0 are everyone's; a and b share s1.0 (c's s1.0 follows its s0.1); every head
    (and the final norm before it) is its path's alone."""
    width = {"widths": (0.125,) * 4}
    specs = {
        name: FAMILY.base.replace(blocks=(*blocks, 1, 1), **width)
        for name, blocks in (("a", (1, 1)), ("b", (1, 2)), ("c", (2, 2)))
    }
    groups = max_common(FAMILY, specs)

    heads = {"head.weight", "head.bias", "final_norm.weight", "final_norm.bias"}
    for arch, expected in {
        "a": {"stages.1.0": "a+b"},
        "b": {"stages.1.0": "a+b", "stages.1.1": "b"},
        "c": {"stages.0.1": "c", "stages.1.0": "c", "stages.1.1": "c"},
    }.items():
        found = {".".join(t.split(".")[:3]): g for t, g in groups[arch].items()}
        assert {k: v for k, v in found.items() if k.startswith("stages.")} == expected, arch
        ends = {t: g for t, g in groups[arch].items() if t.startswith(("head.", "final_norm."))}
        assert heads <= set(ends) and set(ends.values()) == {arch}, arch
        assert not any(t.startswith(("stem.", "stages.0.0.")) for t in groups[arch])


D1, D2, D3 = "d1-w0.125", "d2-w0.125", "d3-w0.125"


def test_flexifed_averages_each_layer_over_its_shared_prefix() -> None:
    """Depths 1, 2, 3 in both sections; clients 0: d1 (sends 1), 1: d2 (2), 2: d3 (4), 3: d2
    (8). The stem and s0.0 (BatchNorm statistics included) are everyone's: 15/4; d2 and
    d3's s0.1: 14/3; d2's s1.0, s1.1 and head: 5; d1's s1.0 and head: 1; d3's s0.2 and
    second section: 4. `global_acc` is d3's model, read from d3's groups."""
    strategy = _build("flexifed", depths=[1, 2, 3], widths=[0.125])
    tasks, before, after = _round(strategy, [D1, D2, D3, D2], [1, 2, 4, 8])
    assert [t.spec["blocks"][:2] for t in tasks] == [(1, 1), (2, 2), (3, 3), (2, 2)]
    grouped = {n.split(GROUP_SEP)[0] for n in after if GROUP_SEP in n}
    assert grouped == {f"{D2}+{D3}", D1, D2, D3}
    assert set(after) == set(before)
    assert _is(after["stem.weight"], 3.75)
    assert _is(after["stages.0.0.conv1.weight"], 3.75)
    assert _is(after["stages.0.0.norm1.running_mean"], 3.75)
    assert _is(after[f"{D2}+{D3}/stages.0.1.conv2.weight"], 14 / 3)
    assert _is(after[f"{D2}/stages.1.1.conv2.weight"], 5.0) and _is(after[f"{D2}/head.weight"], 5)
    assert _is(after[f"{D1}/stages.1.0.conv1.weight"], 1.0) and _is(after[f"{D1}/head.bias"], 1)
    assert _is(after[f"{D3}/stages.0.2.conv1.weight"], 4.0) and _is(after[f"{D3}/head.weight"], 4)
    assert "stages.1.0.conv1.weight" not in after  # nobody's under its plain name
    models = strategy.eval_models(after)
    assert [m.name for m in models] == [f"arch={D3}", f"arch={D1}", f"arch={D2}"]
    assert not any(m.stats_pass for m in models)  # the averaged statistics, no pass
    assert torch.equal(
        models[0].tensors["stages.1.0.conv1.weight"], after[f"{D3}/stages.1.0.conv1.weight"]
    )
    own = strategy.eval_task(_infos([D1])[0], after, {})
    assert own.group == f"local arch={D1}" and torch.equal(
        own.payload["head.bias"], after[f"{D1}/head.bias"]
    )


@pytest.mark.parametrize("method", ["flexifed", "nefl"])
def test_static_bn_trains_without_running_statistics_and_scores_after_a_pass(method) -> None:
    """`bn: static` (FedFA's normalisation for every method it compares): the models keep
    no running statistics, every tested model is scored after a statistics pass; the
    default keeps the method's own averaged running statistics, tested without one."""
    for bn, pass_ in (("static", True), ("batch", False)):
        strategy = _build(method, depths=[1, 2], widths=[0.125], bn=bn)
        _, _, after = _round(strategy, [D1, D2, D2, D1], [1, 2, 4, 8])
        assert any("running_var" in n for n in after) is not pass_
        models = strategy.eval_models(after)
        assert models and all(m.stats_pass is pass_ for m in models)
        assert strategy.eval_task(_infos([D1])[0], after, {}).payload  # a local model too
    with pytest.raises(ValueError, match="bn"):
        _build(method, bn="running")


def test_flexifed_refuses_mixed_widths_naming_the_fix() -> None:
    with pytest.raises(ValueError, match=r"depth only.*\[0\.125, 0\.25\].*widths: \[1\.0\]"):
        _build("flexifed", widths=[0.125, 0.25])


@pytest.mark.parametrize("on", [True, False])
def test_non_iid_head_rows_come_only_from_the_clients_holding_the_class(on: bool) -> None:
    """FedFA's non-IID setting for its baselines too (§5.1): with `label_split`, a head row
    is averaged over the clients holding its class, a row nobody holds kept, and the loss
    masked; without it, every client's rows. FlexiFed: d2's head is clients 1 (sends 2,
    classes 1, 2) and 3 (8; classes 2, 3). NeFL: the head's bias is everyone's; clients 0
    (1; classes 0, 1), 1 (2; 1, 2), 2 (4; 1, 2), 3 (8; 0, 1)."""
    flexifed = ALGORITHMS.get("flexifed").build(
        FAMILY,
        {"choice": "random", "depths": [1, 2, 3], "widths": [0.125], "label_split": on},
        clients_per_round=4,
        train=TRAIN,
        macs=MacCounter(FAMILY),
    )
    labels = [(0, 1), (1, 2), (0, 1), (2, 3)]
    _, before, after = _round(flexifed[0], [D1, D2, D3, D2], [1, 2, 4, 8], labels)
    head, kept = after[f"{D2}/head.bias"], before[f"{D2}/head.bias"]
    if on:
        assert [head[c].item() for c in (1, 2, 3)] == [2.0, 5.0, 8.0]
        assert torch.equal(head[[0, *range(4, 10)]], kept[[0, *range(4, 10)]])
        assert isinstance(flexifed[1].forward, MaskedCrossEntropy)
    else:
        assert _is(head, 5.0) and isinstance(flexifed[1].forward, CrossEntropy)
    nefl = _build("nefl", depths=[1, 2], widths=[0.125, 0.25], label_split=on)
    labels = [(0, 1), (1, 2), (1, 2), (0, 1)]
    _, before, after = _round(nefl, [S, L, L, S], [1, 2, 4, 8], labels)
    bias = after["head.bias"]
    if on:
        assert [bias[c].item() for c in (0, 1, 2)] == [4.5, 3.75, 3.0]
        assert torch.equal(bias[3:], before["head.bias"][3:])
    else:
        assert _is(bias, 3.75)


# -- NeFL ------------------------------------------------------------------------------------------
S, L = "d1-w0.125", "d2-w0.25"


def test_nefl_keeps_bn_and_step_sizes_per_sub_model_and_nests_the_rest() -> None:
    """Clients 0: s = d1-w0.125 (sends 1), 1: l = d2-w0.25 (2), 2: l (4), 3: s (8). Step
    sizes and every BatchNorm tensor are each sub-model's own: s's 9/2, l's 3.
    Convolutions: s's 8x8 corner of s0.0's conv1 is everyone's, 15/4; the rest of it and
    l's extra blocks are l's, 3. The head's bias is everyone's; its weight nested by input
    channels (16 of s, 32 of l)."""
    strategy = _build("nefl", depths=[1, 2], widths=[0.125, 0.25])
    tasks, before, after = _round(strategy, [S, L, L, S], [1, 2, 4, 8])
    assert [t.spec["widths"][0] for t in tasks] == [0.125, 0.25, 0.25, 0.125]
    norms = ("stages.0.0.norm1.weight", "stages.1.0.norm2.running_var", "final_norm.bias")
    for name in ("stages.0.0.step.weight", "stages.1.0.step.weight", *norms):
        small = tasks[0].payload[name].shape[0]  # s's leading part of its own copy
        assert _is(after[f"{S}/{name}"][:small], 4.5) and _is(after[f"{L}/{name}"], 3.0), name
        assert torch.equal(after[f"{S}/{name}"][small:], before[f"{S}/{name}"][small:])
        assert name not in after  # no shared copy
    assert _is(after[f"{L}/stages.0.1.step.weight"], 3.0)
    conv = after["stages.0.0.conv1.weight"]  # (16, 16, 3, 3)
    assert _is(conv[:8, :8], 3.75) and _is(conv[8:], 3.0) and _is(conv[:8, 8:], 3.0)
    assert _is(after["stages.0.1.conv2.weight"], 3.0)
    assert _is(after["head.bias"], 3.75)
    assert _is(after["head.weight"][:, :16], 3.75) and _is(after["head.weight"][:, 16:], 3.0)
    models = strategy.eval_models(after)
    assert [m.name for m in models] == [f"arch={L}", f"arch={S}"]  # the largest first
    assert _is(models[0].tensors["stages.0.0.norm1.weight"], 3.0)
    assert _is(models[0].tensors["stages.1.1.step.weight"], 3.0)
    assert _is(models[1].tensors["stages.0.0.norm1.weight"], 4.5)


def test_a_step_size_multiplies_the_residual_branch_only() -> None:
    torch.manual_seed(0)
    block = PreActBlock(8, 64, 64, 0.125, 1, BatchNorm(), step_size=True).eval()
    plain = PreActBlock(8, 64, 64, 0.125, 1, BatchNorm()).eval()
    plain.load_state_dict({k: v for k, v in block.state_dict().items() if "step" not in k})
    x = torch.randn(2, 8, 4, 4)
    branch = plain(x) - x
    with torch.no_grad():
        block.step.weight.fill_(0.0)
        assert torch.equal(block(x), x)  # a skipped block: the identity
        block.step.weight.fill_(2.5)
        assert torch.allclose(block(x), x + 2.5 * branch, atol=1e-6)
    with pytest.raises(
        SpecError,
        match=r"step_size .* needs one of \['efficientnetv2-s', 'efficientnetv2-tiny', "
        r"'preresnet'\]",
    ):
        ScalableFamily(
            {"family": "resnet18", "input_shape": (1, 8, 8), "num_classes": 10, "step_size": True}
        )


def test_a_sub_models_bytes_and_macs_by_hand() -> None:
    """s (width 1/8, one block per section) on 1x8x8: 8 then 16 channels. Its payload:
    5204 floats (stem 72; s0.0 norms 2x(4x8), convs 2x576, step 1; s1.0 norms 4x8 + 4x16,
    convs 1152 + 2304, shortcut 128, step 1; final norm 4x16; head 160 + 10) and five
    int64 counters. Forward MACs per sample: stem 8x9x64, s0.0 2x(8x8x9x64), s1.0
    16x8x9x16 + 16x16x9x16 + 16x8x16 (shortcut), head 16x10; training triples every
    product but the stem's input gradient. l's extra blocks cost s nothing."""
    strategy = _build("nefl", depths=[1, 2], widths=[0.125, 0.25])
    tasks, _, _ = _round(strategy, [S, L], [1, 2])
    assert state_bytes(tasks[0].payload) == 5204 * 4 + 5 * 8
    forward = (
        8 * 9 * 64 + 2 * 8 * 8 * 9 * 64 + 16 * 8 * 9 * 16 + 16 * 16 * 9 * 16 + 16 * 8 * 16 + 160
    )
    counter = MacCounter(FAMILY)
    spec = tasks[0].spec
    assert counter.pass_macs(PassRecord(spec, "forward", 3, 1), (1, 8, 8)) == 3 * forward
    train = 3 * forward - 8 * 9 * 64
    assert counter.pass_macs(PassRecord(spec, "train", 3, 1), (1, 8, 8)) == 3 * train
    assert strategy.describe()["architectures"][S]["macs"] == forward
