"""DTFL's CIFAR bottleneck ResNet in modules md1..md8 (`hetfl.models.resnet_cifar`): the
shapes of every tier's sides, sides that compose to the whole model, the auxiliary heads,
index maps and MACs counted by hand, and the errors for impossible cuts."""

from __future__ import annotations

import pytest
import torch

from hetfl.config import validate
from hetfl.core.init import initialize
from hetfl.core.roles import head_tensor_names
from hetfl.core.spec import MapEntry
from hetfl.core.state import extract
from hetfl.core.types import PassRecord
from hetfl.models import CifarResNetFamily, SpecError, make_family
from hetfl.systems.costs import MacCounter

C, H, W, K, B = 3, 8, 8, 5, 4
#: md1..md7's output (channels, side) for an 8x8 input: stride 2 in md4 and md6.
OUTPUTS = [(16, 8), (64, 8), (64, 8), (128, 4), (128, 4), (256, 2), (256, 2)]


def _family(blocks: int = 1) -> CifarResNetFamily:
    family = make_family("resnet-cifar", (C, H, W), K, blocks=blocks)
    assert isinstance(family, CifarResNetFamily)
    return family


def _whole(family: CifarResNetFamily, seed: int = 0) -> torch.nn.Module:
    model = initialize(family.build(family.global_spec([])), torch.Generator().manual_seed(seed))
    with torch.no_grad():  # running statistics away from their defaults, so eval tests them
        for name, t in model.named_buffers():
            if name.endswith("running_mean"):
                t.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(1))
            elif name.endswith("running_var"):
                t.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(2))
    return model


def _x(seed: int = 3) -> torch.Tensor:
    return torch.randn(B, C, H, W, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("tier", range(1, 8))
def test_every_tier_has_the_papers_sides(tier):
    family = _family()
    client = family.build(family.side_spec("client", tier, aux=True))
    server = family.build(family.side_spec("server", tier))
    z, logits = client(_x(), activations=True)
    channels, side = OUTPUTS[tier - 1]
    assert z.shape == (B, channels, side, side) and logits.shape == (B, K)
    assert server(z).shape == (B, K)
    assert client.aux.weight.shape == (K, channels)  # Table 10: 16/64/64/128/128/256/256
    md = [f"md{i}" for i in range(1, 9)]
    assert family.modules(family.side_spec("client", tier, aux=True)) == [*md[:tier], "aux"]
    assert family.modules(family.side_spec("client", tier)) == md[:tier]
    assert family.modules(family.side_spec("server", tier)) == md[tier:]


@pytest.mark.parametrize("blocks", [1, 2])
def test_client_and_server_sides_compose_to_the_whole_model(blocks):
    family = _family(blocks)
    whole = _whole(family)
    everything = whole.state_dict()
    x = _x()
    for tier in range(1, 8):
        sides = [family.side_spec("client", tier), family.side_spec("server", tier)]
        maps = [family.index_map(s) for s in sides]
        names = [[e.global_name for e in m] for m in maps]
        assert not set(names[0]) & set(names[1])  # each tensor on exactly one side
        assert sorted(names[0] + names[1]) == sorted(everything)
        client, server = (family.build(s) for s in sides)
        for model, imap in zip((client, server), maps, strict=True):
            model.load_state_dict(extract(everything, imap), strict=True)
        for mode in ("eval", "train"):  # running statistics, then batch statistics
            for m in (whole, client, server):
                getattr(m, mode)()
            with torch.no_grad():
                assert torch.equal(server(client(x)), whole(x)), (tier, mode)


def test_auxiliary_heads_are_declared_once_per_tier_at_their_own_shapes():
    family = _family()
    specs = [family.side_spec("client", m, aux=True) for m in (3, 1, 3, 7)]
    specs += [family.side_spec("client", 2), family.side_spec("server", 5)]  # no heads
    declared = family.declared_tensors(specs)
    assert [(d.name, d.shape) for d in declared] == [
        ("aux1.weight", (K, 16)),
        ("aux1.bias", (K,)),
        ("aux3.weight", (K, 64)),
        ("aux3.bias", (K,)),
        ("aux7.weight", (K, 256)),
        ("aux7.bias", (K,)),
    ]
    # nn.Linear(16, K)'s initialisation: both U(±1/sqrt(16))
    bias = declared[1].build(torch.Generator().manual_seed(0))
    expected = torch.empty(K).uniform_(-0.25, 0.25, generator=torch.Generator().manual_seed(0))
    assert torch.equal(bias, expected)
    weight = declared[0].build(torch.Generator().manual_seed(0))
    assert 0.2 < weight.abs().max() <= 0.25


def test_index_maps_by_hand():
    family = _family()
    md1 = ["md1.conv.weight"] + [
        f"md1.norm.{k}"
        for k in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")
    ]
    client = family.index_map(family.side_spec("client", 1, aux=True))
    assert client == [MapEntry(n, n) for n in md1] + [
        MapEntry("aux.weight", "aux1.weight"),
        MapEntry("aux.bias", "aux1.bias"),
    ]
    assert family.index_map(family.side_spec("client", 5, aux=True))[-2:] == [
        MapEntry("aux.weight", "aux5.weight"),
        MapEntry("aux.bias", "aux5.bias"),
    ]
    assert family.index_map(family.side_spec("server", 7)) == [
        MapEntry("md8.weight", "md8.weight"),
        MapEntry("md8.bias", "md8.bias"),
    ]
    block = family.index_map(family.side_spec("client", 2))[len(md1) :]
    assert [e.local for e in block][:3] == [
        "md2.0.conv1.weight",
        "md2.0.norm1.weight",
        "md2.0.norm1.bias",
    ]
    assert {e.local for e in block} >= {"md2.0.shortcut.weight", "md2.0.norm_sc.running_var"}
    assert all(e.local == e.global_name and e.index == () for e in block)


def test_impossible_cuts_and_sides_are_refused_with_the_allowed_values():
    family = _family()
    with pytest.raises(SpecError, match=r"tier must be an integer in 1\.\.7.*got 0"):
        family.side_spec("client", 0)
    with pytest.raises(SpecError, match=r"got 8 \(a cut after md8 is beyond the model"):
        family.side_spec("server", 8)
    with pytest.raises(SpecError, match=r"tier must be an integer in 1\.\.7.*got None"):
        family.side_spec("client")
    with pytest.raises(SpecError, match="side must be one of whole, client, server"):
        family.checked(family.base.replace(side="middle", tier=2))
    with pytest.raises(SpecError, match=r"aux .* belongs to the client side"):
        family.side_spec("server", 2, aux=True)
    with pytest.raises(SpecError, match="the whole model has no tier"):
        family.side_spec("whole", 3)
    with pytest.raises(SpecError, match="blocks \\(per group\\) must be an integer >= 1"):
        make_family("resnet-cifar", (C, H, W), K, blocks=0)
    with pytest.raises(SpecError, match="num_classes = 7, but the family's is 5"):
        family.index_map(family.side_spec("client", 2).replace(num_classes=7))
    cost = MacCounter(family).pass_cost(PassRecord(family.base, "train", B, 1), (C, H, W))
    with pytest.raises(ValueError, match=r"split point 8 is not between two of the 8 modules"):
        cost.split_macs(8)


def test_macs_of_md1_and_of_a_bottleneck_and_the_activation_bytes_by_hand():
    family = _family()
    cost = MacCounter(family).pass_cost(PassRecord(family.base, "train", B, 1), (C, H, W))
    assert cost.modules == tuple(f"md{i}" for i in range(1, 9))
    # md1: 3x3 conv C -> 16 at every pixel, forward and weight gradient (its input, the
    # image, needs no gradient); BatchNorm is no matrix product
    assert cost.module_macs[0] == 2 * B * H * W * 16 * C * 9
    # md3's one block: 1x1 64 -> 16, 3x3 16 -> 16, 1x1 16 -> 64, no shortcut; forward,
    # weight gradient and input gradient
    assert cost.module_macs[2] == 3 * B * H * W * (64 * 16 + 16 * 16 * 9 + 16 * 64)
    assert cost.module_macs[7] == 3 * B * 256 * K  # md8: the linear layer (pooling is free)
    assert cost.split_macs(2) == (sum(cost.module_macs[:2]), sum(cost.module_macs[2:]))
    assert cost.activation_bytes(2) == B * 64 * H * W * 4  # md2's float32 output
    assert cost.activation_bytes(5) == B * 128 * (H // 2) * (W // 2) * 4


def test_config_names_the_family_with_its_blocks():
    base = {"data": {"dataset": "digits"}, "train": {"clients_per_round": 2}}
    cfg = validate({**base, "model": {"name": "resnet-cifar", "blocks": 1}})
    family = make_family(cfg.model.name, (1, 8, 8), 10, **cfg.model.family_options())
    assert isinstance(family, CifarResNetFamily) and family.base["blocks"] == 1
    assert _family(6).base["blocks"] == 6  # ResNet-110
    assert make_family("resnet-cifar", (1, 8, 8), 10).base["blocks"] == 3  # ResNet-56
    with pytest.raises(ValueError, match="one integer >= 1, the blocks of every group"):
        validate({**base, "model": {"name": "resnet-cifar", "blocks": [1, 2]}})
    with pytest.raises(ValueError, match="'resnet-cifar' is a split model: width apply"):
        validate({**base, "model": {"name": "resnet-cifar", "width": 0.5}})
    with pytest.raises(ValueError, match=r"blocks apply to the scalable models only .* or the"):
        validate({**base, "model": {"name": "mlp", "blocks": 1}})


def test_the_classifier_is_found_by_structure_under_its_own_name():
    family = _family()
    assert head_tensor_names(family.build(family.base)) == {"md8.weight", "md8.bias"}
    client = family.build(family.side_spec("client", 4, aux=True))
    assert head_tensor_names(client) == {"aux.weight", "aux.bias"}
    with pytest.raises(ValueError, match="does not mark its classifier"):
        head_tensor_names(family.build(family.side_spec("client", 4)))
