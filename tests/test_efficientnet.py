"""EfficientNetV2 (`hetfl.models.efficientnet`): torchvision's parameter count and MACs,
MACs and bytes counted by hand from Table 4, squeeze-and-excitation sliced with the
block, the sub-model invariant in width and depth, the settings the family refuses, and
FedFA (grafting), HeteroFL, FlexiFed and NeFL on it.

Tan and Le, "EfficientNetV2: Smaller Models and Faster Training", ICML 2021, Table 4;
Park and Joe-Wong, "Federated Learning with Flexible Architectures", ECML-PKDD 2024, §5.1.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from flop_oracle import oracle_cost
from hetfl.algorithms import ALGORITHMS
from hetfl.algorithms.parts.grafting import graft
from hetfl.core.client.program import Programs
from hetfl.core.init import initialize
from hetfl.core.spec import prefix_index
from hetfl.core.state import extract, state_bytes
from hetfl.core.training import LocalTraining
from hetfl.core.types import PassRecord
from hetfl.data import PARTITIONERS, build_clients, global_test, load_synthetic
from hetfl.engine.outputs import read_metrics
from hetfl.engine.round_settings import RoundSettings
from hetfl.models import ScalableFamily, SpecError
from hetfl.models.scalable import depth_blocks
from hetfl.sim import Simulation
from hetfl.systems.costs import MacCounter

#: Table 4 as the paper prints it: (fused, expansion, channels, layers, stride) per stage.
TABLE_4 = [(True, 1, 24, 2, 1), (True, 4, 48, 4, 2), (True, 4, 64, 4, 2),
           (False, 4, 128, 6, 2), (False, 6, 160, 9, 1), (False, 6, 256, 15, 2)]  # fmt: skip
#: The tiny preset: a quarter of the channels (stem 6, last 320), at most 3 repeats.
TINY = [(f, e, c // 4, min(n, 3), s) for f, e, c, n, s in TABLE_4]


def _family(name="efficientnetv2-tiny", shape=(3, 8, 8), classes=10, **base) -> ScalableFamily:
    return ScalableFamily({"family": name, "input_shape": shape, "num_classes": classes, **base})


def _spec(family: ScalableFamily, **changes):
    return family.normalise({**family.base, **changes})


def _hand(table, stem, last, side, cin, classes, stem_layout, widths, blocks):
    """(forward MACs of one sample, parameters, BatchNorm channels, BatchNorm layers),
    layer by layer: ceil(p x channels) everywhere; a 3x3 convolution of stride s (padding
    1) gives side ceil(side / s); a k x k convolution costs side^2 x in x out x k^2
    (depthwise: side^2 x 9 per channel); squeeze-and-excitation's two 1x1 convolutions (to
    a quarter of the block input's channels and back, with biases) act on a 1x1 map; a
    BatchNorm has 2 parameters per channel (its affine)."""
    strides = [s for *_, s in table] if stem_layout == "imagenet" else [1, 1, 2, 2, 1, 2]
    side = math.ceil(side / (2 if stem_layout == "imagenet" else 1))
    c = math.ceil(widths[0] * stem)
    macs, params, bn = side * side * cin * c * 9, cin * c * 9, [c]
    base_in = stem
    for (fused, e, out, _, _), stride, p, n in zip(table, strides, widths, blocks, strict=True):
        ch = lambda k, p=p: math.ceil(p * k)  # noqa: E731
        for b in range(n):
            new = math.ceil(side / (stride if b == 0 else 1))
            if fused and e == 1:
                macs += new * new * c * ch(out) * 9
                params += c * ch(out) * 9
                bn += [ch(out)]
            elif fused:
                hidden = ch(base_in * e)
                macs += new * new * (c * hidden * 9 + hidden * ch(out))
                params += c * hidden * 9 + hidden * ch(out)
                bn += [hidden, ch(out)]
            else:
                hidden, squeeze = ch(base_in * e), ch(base_in // 4)
                macs += side * side * c * hidden  # 1x1 expansion, before the stride
                macs += new * new * (hidden * 9 + hidden * ch(out))  # depthwise, projection
                macs += 2 * hidden * squeeze  # squeeze-and-excitation
                params += c * hidden + hidden * 9 + hidden * ch(out)
                params += 2 * hidden * squeeze + squeeze + hidden  # SE weights and biases
                bn += [hidden, hidden, ch(out)]
            side, c, base_in = new, ch(out), out
    wide = math.ceil(widths[-1] * last)
    macs += side * side * c * wide + wide * classes
    params += c * wide + wide * classes + classes
    bn += [wide]
    return macs, params + 2 * sum(bn), sum(bn), len(bn)


# -- the architecture --------------------------------------------------------------------------
def test_the_imagenet_model_has_torchvisions_parameters_and_macs() -> None:
    """Table 4's model (stem imagenet, 1000 classes) holds 21,458,488 parameters and costs
    8.37 G multiply-adds per 384x384 image, torchvision's `efficientnet_v2_s` figures
    (`EfficientNet_V2_S_Weights.IMAGENET1K_V1` meta, "num_params" and "_ops"); both equal
    the hand count of Table 4 (counted on the meta device: nothing is computed)."""
    family = _family("efficientnetv2-s", (3, 384, 384), 1000, stem="imagenet")
    with torch.device("meta"):
        model = family.build(family.global_spec([])).eval()
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            model(torch.zeros(1, 3, 384, 384))
    macs, params, _, norms = _hand(
        TABLE_4, 24, 1280, 384, 3, 1000, "imagenet", [1.0] * 6, [n for *_, n, _ in TABLE_4]
    )
    assert sum(p.numel() for p in model.parameters()) == params == 21_458_488
    assert counter.get_total_flops() // 2 == macs
    assert round(macs / 1e9, 2) == 8.37
    assert norms == 1 + 2 + 2 * (4 + 4) + 3 * (6 + 9 + 15) + 1


def test_a_sub_models_macs_and_bytes_by_hand() -> None:
    """The tiny preset on 1x16x16, widths (1/2, 1/2, 1/4, 1/4, 1/2, 1/2), blocks (2, 1, 2, 1,
    2, 1): one forward pass of one sample is the hand count, a training pass of two adds
    the weights' and the inputs' gradients (the stem's input, the data, needs none); the
    payload is every parameter and running statistic (mean and variance per BatchNorm
    channel) in float32 plus one int64 counter per BatchNorm; and the
    cost model agrees with torch's own counter over a real backward pass."""
    shape, widths, blocks = (1, 16, 16), (0.5, 0.5, 0.25, 0.25, 0.5, 0.5), (2, 1, 2, 1, 2, 1)
    family = _family(shape=shape)
    spec = _spec(family, widths=widths, blocks=blocks)
    macs, params, bn_channels, norms = _hand(TINY, 6, 320, 16, 1, 10, "small", widths, blocks)
    counter = MacCounter(family)
    assert counter.pass_macs(PassRecord(spec, "forward", 1, 1), shape) == macs
    stem = 16 * 16 * 1 * 3 * 9  # stride 1, ceil(6 / 2) channels
    train = PassRecord(spec, "train", 2, 1)
    assert counter.pass_macs(train, shape) == 2 * (3 * macs - stem)
    assert counter.pass_cost(train, shape) == oracle_cost(family, train, shape)
    state = initialize(family.build(family.global_spec([])), torch.Generator()).state_dict()
    payload = extract(state, family.index_map(spec))
    assert state_bytes(payload) == 4 * (params + 2 * bn_channels) + 8 * norms


def test_index_map_slices_squeeze_excitation_with_the_block_and_keeps_the_first_repeats() -> None:
    family = _family()
    spec = _spec(family, width=0.5, blocks=(2, 1, 2, 1, 2, 1))
    imap = {e.local: e.index for e in family.index_map(spec)}
    # Stage 1 (Fused-MBConv1): one 3x3 convolution from the stem's 3 channels to 3.
    assert imap["stages.0.0.fused.conv.weight"] == prefix_index(3, 3, 3, 3)
    assert "stages.0.0.project.weight" not in imap
    # Stage 2 (Fused-MBConv4 from 6 base channels): 24 expanded (12 at 1/2), to 12 (6).
    assert imap["stages.1.0.fused.conv.weight"] == prefix_index(12, 3, 3, 3)
    assert imap["stages.1.0.project.weight"] == prefix_index(6, 12, 1, 1)
    # Stage 4 (MBConv4 from 16): 64 expanded (32), SE to 16 / 4 = 4 (2), depthwise by groups.
    assert imap["stages.3.0.expand.conv.weight"] == prefix_index(32, 8, 1, 1)
    assert imap["stages.3.0.depthwise.weight"] == prefix_index(32, 1, 3, 3)
    assert imap["stages.3.0.se.reduce.weight"] == prefix_index(2, 32, 1, 1)
    assert imap["stages.3.0.se.reduce.bias"] == prefix_index(2)
    assert imap["stages.3.0.se.expand.weight"] == prefix_index(32, 2, 1, 1)
    assert imap["stages.3.0.se.expand.bias"] == prefix_index(32)
    # Later repeats take the stage's own channels: SE on 40 / 4 = 10 (5) of 240 (120).
    assert imap["stages.4.1.se.reduce.weight"] == prefix_index(5, 120, 1, 1)
    assert imap["last.conv.weight"] == prefix_index(160, 32, 1, 1)
    assert imap["head.weight"] == prefix_index(10, 160)
    assert "stages.4.1.project.weight" in imap and "stages.4.2.project.weight" not in imap
    assert "stages.1.0.project.weight" in imap and "stages.1.1.project.weight" not in imap
    model = family.build(family.global_spec([]))
    assert [[b.identity for b in s] for s in model.stages] == [[True, True]] + [
        [False, True, True]
    ] * 5


def _truncated(model: nn.Module, blocks: tuple[int, ...]) -> nn.Module:
    """`model` with each stage cut to its first `blocks[i]` blocks (in place)."""
    for stage, n in zip(model.stages, blocks, strict=False):
        del stage[n:]
    return model


def _lively(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """`state` redrawn so that a random model's output depends on its input through all
    its blocks (PyTorch's default initialisation shrinks the signal block by block, so that
    logits barely differ between samples): weights N(0, 2 / fan-in), BatchNorm affines and
    running statistics spread around their defaults."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        if not t.is_floating_point():
            out[name] = t
        elif t.dim() > 1:
            out[name] = torch.randn(t.shape, generator=g) * math.sqrt(2 / t[0].numel())
        elif name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "running_var")):
            out[name] = 0.5 + torch.rand(t.shape, generator=g)
        else:
            out[name] = 0.1 * torch.randn(t.shape, generator=g)
    return out


@pytest.mark.parametrize("bn", ["batch", "static", "none"])
def test_a_sliced_model_equals_the_wide_model_run_at_its_width_and_depth(bn: str) -> None:
    """Built at widths (1/2, 1/4, ...) and blocks (1, 2, 1, 3, 2, 1) from its slice of the
    global state, the model computes what the global model computes on its first blocks of
    each stage run at those widths, in training and in evaluation mode (the running
    statistics the training pass updates are the same leading slices), on a state whose
    outputs differ from sample to sample (without normalisation, over four stages)."""
    family = _family(bn=bn, stages=4 if bn == "none" else 6)
    glob = family.global_spec([])
    state = _lively(dict(family.build(glob).state_dict()), 0)
    blocks = (1, 2, 1, 3, 2, 1)
    spec = _spec(family, width=0.5, blocks=blocks)
    narrow = family.build(spec)
    narrow.load_state_dict(extract(state, family.index_map(spec)))
    wide = family.build(glob)
    wide.load_state_dict(state)
    _truncated(wide, blocks)
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    for mode in (True, False):
        wide.train(mode)
        narrow.train(mode)
        with torch.no_grad():
            out = narrow(x)
            assert torch.equal(wide(x, width=0.5), out), mode
            assert (out[1:] - out[0]).abs().max() > 1e-3
    if bn == "batch":
        assert torch.equal(
            wide.stages[3][0].norm1.running_mean[:32], narrow.stages[3][0].norm1.running_mean
        )


def test_a_step_size_scales_the_residual_branch_of_identity_blocks_only() -> None:
    family = _family(step_size=True)
    model = initialize(family.build(family.global_spec([])), torch.Generator().manual_seed(0))
    steps = [n for n in model.state_dict() if n.endswith("step.weight")]
    assert "stages.3.1.residual.step.weight" in steps and "stages.0.0.residual.step.weight" in steps
    assert not any(n.startswith(("stages.3.0.", "stages.1.0.")) for n in steps)
    block = model.stages[3][1].eval()
    x = torch.randn(2, 32, 2, 2, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        branch = block(x) - x
        block.residual.step.weight.fill_(0.0)
        assert torch.equal(block(x), x)
        block.residual.step.weight.fill_(2.5)
        assert torch.allclose(block(x), x + 2.5 * branch, atol=1e-6)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"blocks": (2, 3, 3)}, "blocks needs 6 integers >= 1"),
        ({"blocks": (2, 0, 3, 3, 3, 3)}, "blocks needs 6 integers >= 1"),
        ({"widths": (1.0, 0.5)}, "widths needs 6 values"),
        ({"widths": (1.0, 0.5, 0.0, 1.0, 1.0, 1.0)}, "width ratios must be positive"),
        ({"input_shape": (1, 4, 4)}, "each side must be at least 8"),
        ({"stem": "imagenet"}, "each side must be at least 32"),
        ({"stem": "cifar"}, "stem must be 'small' or 'imagenet'"),
        ({"stages": 7}, r"stages must be an integer in 1\.\.6"),
    ],
)
def test_specs_the_family_cannot_build_are_refused(changes, message) -> None:
    family = _family()
    with pytest.raises(SpecError, match=message):
        family.normalise({**family.base, **changes})


def test_depth_candidates_cap_each_stage_at_its_repeats() -> None:
    """FedFA's depth d puts min(d, n) blocks in a stage of n repeats: the tiny preset's
    (2, 3, 3, 3, 3, 3) at d = 2 is 2 everywhere; the S preset at d = 4 keeps stage 1's
    2; a depth beyond the deepest stage's repeats is refused, naming the full depth."""
    tiny, small = _family().base, _family("efficientnetv2-s").base
    assert depth_blocks(tiny, 2) == (2,) * 6 and depth_blocks(tiny, 3) == tiny["blocks"]
    assert depth_blocks(small, 4) == (2, 4, 4, 4, 4, 4)
    with pytest.raises(SpecError, match=r"depth 4 is the full model, depth 3; list depths up"):
        depth_blocks(tiny, 4)
    with pytest.raises(SpecError, match=r"depth 16 is the full model, depth 15"):
        depth_blocks(small, 16)


# -- the methods -------------------------------------------------------------------------------
def test_grafting_fills_each_stages_missing_repeats_from_its_last_block() -> None:
    """A client of depth 2 in a global model of depth 3: in stages 2-6 its second block
    (MBConv's SE included) stands in for the third at its own slice; stage 1 is whole."""
    family = _family()
    local = _spec(family, blocks=depth_blocks(family.base, 2), width=0.5)
    full = _spec(family, blocks=depth_blocks(family.base, 3))
    own = family.index_map(local)
    grafted = graft(family, own, local, full)[len(own) :]
    pairs = {(".".join(e.local.split(".")[:3]), ".".join(e.global_name.split(".")[:3]))
             for e in grafted}  # fmt: skip
    assert pairs == {(f"stages.{i}.1", f"stages.{i}.2") for i in range(1, 6)}
    source = {e.local: e for e in own}
    for e in grafted:
        assert e.index == source[e.local].index
    assert any(e.global_name == "stages.5.2.se.expand.bias" for e in grafted)


@pytest.mark.parametrize("method", ["fedfa", "heterofl", "flexifed", "nefl"])
def test_a_short_run_completes_with_finite_metrics(method: str, tmp_path) -> None:
    """Two clients, one round of two steps on a synthetic 4-class problem at 8 x 8, with
    three stages of the tiny preset: depths 2 and 3 (widths 1/4 and 1/2 where the method
    varies width; HeteroFL's levels 1/2 and 1)."""
    ds = load_synthetic(n_train=64, n_test=32, num_classes=4, shape=(3, 8, 8), seed=0)
    parts = PARTITIONERS.get("iid")(ds.y_train, 2, np.random.default_rng(0))
    clients = build_clients(ds, parts, test_per_client=8, seed=0)
    family = _family(classes=4, stages=3)
    train = LocalTraining(steps=2, batch_size=8)
    attrs = None
    if method == "heterofl":
        options: dict[str, object] = {"levels": [0.5, 1.0]}
    else:
        widths = [1.0] if method == "flexifed" else [0.25, 0.5]
        options = {"depths": [2, 3], "widths": widths, "choice": "random"}
        attrs = {
            0: {"architecture": f"d2-w{widths[0]:g}"},
            1: {"architecture": f"d3-w{widths[-1]:g}"},
        }
    strategy, recipe = ALGORITHMS.get(method).build(
        family, options, clients_per_round=2, train=train, macs=MacCounter(family)
    )
    settings = RoundSettings(rounds=1, seed=3, local_eval="sampled")
    Simulation(
        strategy, Programs(family, recipe, seed=0), clients, global_test(ds, "cpu"), settings,
        tmp_path, attrs=attrs,
    ).run()  # fmt: skip
    rows = read_metrics(tmp_path / "metrics.jsonl")
    values = [v for r in rows for k, v in r.items() if k in ("global_acc", "loss", "macs")]
    assert len(values) == 3 and all(math.isfinite(v) for v in values)
