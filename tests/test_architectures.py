"""Declared architectures and the methods that train them: FlexiFed (Max-Common) and NeFL.

Hand computations: Max-Common's groups on hand-made architectures and the averages they
give; NeFL's per-sub-model BatchNorm and step sizes, and its nested average of the other
weights; the step size on a residual branch; a sub-model's bytes and MACs. Errors: mixed
widths under FlexiFed, an undeclared architecture, a step size the family cannot take.
"""

from __future__ import annotations

import pytest
import torch

from hetfl.algorithms import ALGORITHMS
from hetfl.algorithms.flexifed import max_common
from hetfl.core.rng import torch_generator
from hetfl.core.spec import GROUP_SEP
from hetfl.core.state import state_bytes
from hetfl.core.training import LocalTraining
from hetfl.core.types import ClientInfo, ClientResult, PassRecord
from hetfl.models import ScalableFamily, SpecError
from hetfl.models.blocks import PreActBlock
from hetfl.models.norms import BatchNorm
from hetfl.systems.costs import MacCounter
from strategies import trained

TRAIN = LocalTraining(lr=0.05, epochs=1, batch_size=16)


def _family(**base) -> ScalableFamily:
    """A two-section Pre-ResNet on 8x8 single-channel inputs."""
    spec = {"family": "preresnet", "input_shape": (1, 8, 8), "num_classes": 10, "stages": 2}
    return ScalableFamily({**spec, **base})


def _arch(name: str, blocks: tuple[int, int], width: float = 0.125) -> dict:
    return {"name": name, "blocks": [*blocks, 1, 1], "width": width}


def _infos(archs: list[str | None]) -> list[ClientInfo]:
    return [
        ClientInfo(cid, 20, (1, 8, 8), tuple(range(10)), {} if a is None else {"architecture": a})
        for cid, a in enumerate(archs)
    ]


def _round(method: str, archs: list[dict], clients: list[str | None], values: list[float]):
    """Set up, plan one round with every client, and aggregate results in which client i
    sends `values[i]` in every element; returns the strategy, the tasks, state before and
    after."""
    strategy, _ = ALGORITHMS.get(method).build(
        _family(), {"architectures": archs}, clients_per_round=len(clients), train=TRAIN
    )
    infos = _infos(clients)
    state = strategy.setup(infos, torch_generator(0, 0, -1, "init"))
    tasks = strategy.plan(1, state, infos, torch_generator(0, 1, -1, "sample"))
    results = [
        ClientResult(t.cid, {k: torch.full_like(v, x) for k, v in t.payload.items()}, 20, 1, 0.0)
        for t, x in zip(tasks, values, strict=True)
    ]
    return strategy, tasks, state, strategy.aggregate(1, state, trained(tasks, results))


def _is(t: torch.Tensor, value: float) -> bool:
    return torch.allclose(t.double(), torch.full(t.shape, value, dtype=torch.float64), atol=1e-6)


# -- FlexiFed: Max-Common --------------------------------------------------------------------------
#: a: 1+1 blocks; b: 1+2; c: 2+2 (the deepest, and the global model).
ABC = [_arch("a", (1, 1)), _arch("b", (1, 2)), _arch("c", (2, 2))]


def test_max_common_groups_by_hand() -> None:
    """Pipelines a = stem s0.0 s1.0 head, b = stem s0.0 s1.0 s1.1 head, c = stem s0.0 s0.1
    s1.0 s1.1 head: the stem and s0.0 are everyone's; a and b share s1.0 (c's s1.0 follows
    its s0.1); every head (and the final norm before it) is its path's alone."""
    strategy, _ = ALGORITHMS.get("flexifed").build(
        _family(), {"architectures": ABC}, clients_per_round=1, train=TRAIN
    )
    specs = strategy.assignment.specs
    groups = max_common(_family(), specs)

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


def test_flexifed_averages_each_layer_over_its_shared_prefix() -> None:
    """Clients 0: a (sends 1), 1: b (2), 2: c (4), 3: b (8). The stem and s0.0 (BatchNorm
    statistics included) are everyone's: 15/4; a and b's s1.0: 11/3; b's s1.1 and head:
    5; a's head 1; c's path 4. `global_acc` is c's model, read from c's groups."""
    strategy, tasks, before, after = _round("flexifed", ABC, ["a", "b", "c", "b"], [1, 2, 4, 8])
    assert [t.spec["blocks"][:2] for t in tasks] == [(1, 1), (1, 2), (2, 2), (1, 2)]
    grouped = {n.split(GROUP_SEP)[0] for n in after if GROUP_SEP in n}
    assert grouped == {"a+b", "a", "b", "c"}
    assert set(after) == set(before)
    assert _is(after["stem.weight"], 3.75)
    assert _is(after["stages.0.0.conv1.weight"], 3.75)
    assert _is(after["stages.0.0.norm1.running_mean"], 3.75)
    assert _is(after["a+b/stages.1.0.conv1.weight"], 11 / 3)
    assert _is(after["b/stages.1.1.conv2.weight"], 5.0) and _is(after["b/head.weight"], 5.0)
    assert _is(after["a/head.bias"], 1.0) and _is(after["a/final_norm.weight"], 1.0)
    assert _is(after["c/stages.0.1.conv1.weight"], 4.0) and _is(after["c/head.weight"], 4.0)
    assert "stages.1.0.conv1.weight" not in after  # nobody's under its plain name
    models = strategy.eval_models(after)
    assert [m.name for m in models] == ["arch=c", "arch=b", "arch=a"]
    assert torch.equal(
        models[0].tensors["stages.1.0.conv1.weight"], after["c/stages.1.0.conv1.weight"]
    )


def test_flexifed_refuses_mixed_widths_naming_the_candidates() -> None:
    archs = [_arch("narrow", (1, 1), 0.125), _arch("wide", (1, 2), 0.25)]
    with pytest.raises(ValueError, match=r"depth only.*'wide' has widths \[0\.25"):
        ALGORITHMS.get("flexifed").build(
            _family(), {"architectures": archs}, clients_per_round=2, train=TRAIN
        )


# -- declared architectures ------------------------------------------------------------------------
def test_half_take_the_smallest_the_rest_the_others_and_declarations_win() -> None:
    """Ten clients, two of them declaring: of the eight others (id order) half take the
    smallest (a), the rest b and c in equal shares; a declared name outside the candidates
    is refused naming the client."""
    strategy, _ = ALGORITHMS.get("flexifed").build(
        _family(), {"architectures": ABC[::-1]}, clients_per_round=1, train=TRAIN
    )
    infos = _infos(["c", None, None, None, None, "b", None, None, None, None])
    strategy.setup(infos, torch_generator(0, 0, -1, "init"))
    names = [strategy.assignment.name(i) for i in infos]
    assert names == ["c", "a", "a", "a", "a", "b", "c", "c", "b", "b"]
    with pytest.raises(ValueError, match=r"client 1 declares architecture 'z'.*candidates"):
        strategy.setup(_infos([None, "z"]), torch_generator(0, 0, -1, "init"))


# -- NeFL ------------------------------------------------------------------------------------------
#: s: width 1/8, 1+1 blocks; l: width 1/4, 2+2 blocks (the global model).
SL = [_arch("s", (1, 1), 0.125), _arch("l", (2, 2), 0.25)]


def test_nefl_keeps_bn_and_step_sizes_per_sub_model_and_nests_the_rest() -> None:
    """Clients 0: s (sends 1), 1: l (2), 2: l (4), 3: s (8). Step sizes and every BatchNorm
    tensor are each sub-model's own: s's 9/2, l's 3. Convolutions: s's 8x8 corner of
    s0.0's conv1 is everyone's, 15/4; the rest of it and l's extra blocks are l's, 3. The
    head's bias is everyone's; its weight nested by input channels (16 of s, 32 of l)."""
    strategy, tasks, before, after = _round("nefl", SL, ["s", "l", "l", "s"], [1, 2, 4, 8])
    assert [t.spec["widths"][0] for t in tasks] == [0.125, 0.25, 0.25, 0.125]
    norms = ("stages.0.0.norm1.weight", "stages.1.0.norm2.running_var", "final_norm.bias")
    for name in ("stages.0.0.step.weight", "stages.1.0.step.weight", *norms):
        small = tasks[0].payload[name].shape[0]  # s's leading part of its own copy
        assert _is(after[f"s/{name}"][:small], 4.5) and _is(after[f"l/{name}"], 3.0), name
        assert torch.equal(after[f"s/{name}"][small:], before[f"s/{name}"][small:])
        assert name not in after  # no shared copy
    assert _is(after["l/stages.0.1.step.weight"], 3.0)
    conv = after["stages.0.0.conv1.weight"]  # (16, 16, 3, 3)
    assert _is(conv[:8, :8], 3.75) and _is(conv[8:], 3.0) and _is(conv[:8, 8:], 3.0)
    assert _is(after["stages.0.1.conv2.weight"], 3.0)
    assert _is(after["head.bias"], 3.75)
    assert _is(after["head.weight"][:, :16], 3.75) and _is(after["head.weight"][:, 16:], 3.0)
    largest = strategy.eval_models(after)[0]
    assert largest.name == "arch=l"
    assert _is(largest.tensors["stages.0.0.norm1.weight"], 3.0)
    assert _is(largest.tensors["stages.1.1.step.weight"], 3.0)


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
    with pytest.raises(SpecError, match=r"step_size .* needs one of \['preresnet'\]"):
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
    _, tasks, _, _ = _round("nefl", SL, ["s", "l"], [1, 2])
    assert state_bytes(tasks[0].payload) == 5204 * 4 + 5 * 8
    forward = (
        8 * 9 * 64 + 2 * 8 * 8 * 9 * 64 + 16 * 8 * 9 * 16 + 16 * 16 * 9 * 16 + 16 * 8 * 16 + 160
    )
    counter = MacCounter(_family())
    spec = tasks[0].spec
    assert counter.pass_macs(PassRecord(spec, "forward", 3, 1), (1, 8, 8)) == 3 * forward
    train = 3 * forward - 8 * 9 * 64
    assert counter.pass_macs(PassRecord(spec, "train", 3, 1), (1, 8, 8)) == 3 * train
