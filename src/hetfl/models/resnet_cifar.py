"""DTFL's CIFAR-style bottleneck ResNet cut into eight modules, and the family of its sides.

The model ("Speed up Federated Learning in Heterogeneous Environment: A Dynamic Tiering
Approach", App. A.5, Tables 8-10; the authors' code mahmoudsajjadi/DTFL,
`model/resnet56_7t.py`), from the injected blocks of `hetfl.models.blocks`:

- md1: 3x3 convolution (C -> 16), BatchNorm, ReLU. Tables 8 and 9 list a max-pool in md1;
  the authors' code defines it and never applies it, so there is none here;
- md2..md7: six groups of `blocks` post-activation bottleneck blocks (`Bottleneck`,
  expansion 4) with planes 16, 16, 32, 32, 64, 64, i.e. 64, 64, 128, 128, 256, 256 output
  channels; the first block of md4 and of md6 has stride 2; a group's first block has a
  shortcut convolution where its input width differs (md2, md4, md6);
- md8: global average pooling and a linear layer 256 -> classes.

`blocks` = 3 is ResNet-56 (18·3 + 2 layers), 6 is ResNet-110, 1 a 20-layer model of the
same eight modules for a small machine. Any input channel count and size is accepted.

**Specs.** `family: "resnet-cifar"`, `input_shape` (C, H, W) of the images, `num_classes`,
`blocks`, and which part of the model the spec builds:

- `side: "whole"`: md1..md8 (the global model; `family.global_spec`);
- `side: "client"`, `tier: m` in 1..7 (the paper's numbering, M = 7: the client holds
  md1..md_m; the authors' code numbers tiers the other way round, code tier 8 - m), with
  `aux: True` the tier's auxiliary head after md_m (average pooling and a linear layer
  from md_m's 16/64/64/128/128/256/256 channels to the classes, Table 10), with
  `aux: False` none (SplitFed's client: its output is the activation it sends);
- `side: "server"`, `tier: m`: md_{m+1}..md8, taking md_m's output;
- `side: "edge"`, `tier: 1`: a small model of its own around md1 (FedGKT's ResNet-8,
  He et al., "Group Knowledge Transfer", NeurIPS 2020, §3 and Fig. 1; FedML's
  `resnet8_56`): md1, whose output is the feature map it uploads, then `local`, two
  bottleneck blocks of planes 16, and `head`, average pooling and a linear layer 64 ->
  classes. Its server counterpart is the server side of tier 1, md2..md8. The edge model
  is the client's own: its index map is empty (nothing of it is shared), and where every
  spec is an edge model the global model (`global_spec`) is that server side.

`family.side_spec(side, tier, aux=...)` builds one from the family's base, and
`family.server_spec(client_spec)` the server side of a client spec's tier. A tier outside
1..7 (a cut before md1, or after md8, beyond the model) and `aux` off the client side are
`SpecError`s naming the field, the allowed values and the value given.

**Tensor names** are the whole model's on every side: `md1.conv.weight`, `md1.norm.*`,
`md<i>.<block>.conv1.weight`, ..., `md<i>.<block>.shortcut.weight`, `md8.weight`,
`md8.bias`; a client's auxiliary head is `aux.weight` (classes, C_m) and `aux.bias`.

**Index maps.** Every `md…` tensor maps whole to the global tensor of the same name, so
any client side and any server side of the same tier together cover the global model
once. The auxiliary head maps to tier m's own global tensors `aux<m>.weight` and
`aux<m>.bias` (`aux_name(m, local)`), declared at their own shapes
(`declared_tensors(specs)`, `hetfl.core.declared`) with PyTorch's `nn.Linear`
initialisation: one pair per tier that some client spec with `aux` names, in tier order.

**Modules** (`modules(spec)`, the split points of the cost model): the side's `md…`
names in order, then `aux` on a client with its head. `model(x)` returns the logits
(whole, server side, client with its head) or md_m's activation (client without head);
`model(x, activations=True)` on a client with its head returns `(z, logits)`: md_m's
activation (what DTFL sends to the server) and the auxiliary head's logits; the edge
model's `model(x, activations=True)` likewise returns `(md1's feature map, logits)`.

Convolutions and linear layers start from PyTorch's defaults (`hetfl.core.init`), as
every HetFL model does; the authors' code draws convolutions from Kaiming's normal
(fan out) instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

import torch
from torch import nn

from hetfl.core.declared import DeclaredTensor
from hetfl.core.registry import Registry
from hetfl.core.spec import IndexMap, MapEntry, Spec
from hetfl.models.base import MODELS
from hetfl.models.blocks import Bottleneck, ConvUnit
from hetfl.models.norms import BatchNorm
from hetfl.models.scalable import SpecError

#: Tiers of the paper's numbering (M = 7): the client holds md1..md_m.
TIERS = tuple(range(1, 8))
#: Bottleneck planes of md2..md7, and the stride of each group's first block.
PLANES = (16, 16, 32, 32, 64, 64)
STRIDES = (1, 1, 2, 1, 2, 1)
#: Output channels of md1..md7 (md1's 16, then 4 x each group's planes).
OUT_CHANNELS = (16, *(4 * p for p in PLANES))
SIDES = ("whole", "client", "server", "edge")
Side = Literal["whole", "client", "server", "edge"]
#: Bottleneck blocks of the edge model's own group (FedGKT's ResNet-8: 1 + 2 x 3 + 1 layers).
EDGE_BLOCKS = 2
#: The local name of a client's auxiliary head (`aux.weight`, `aux.bias`).
AUX = "aux"


@dataclass(frozen=True)
class SplitArchitecture:
    """A model that splits into modules: its default blocks per group and its summary."""

    default_blocks: int
    summary: str


SPLIT: Registry[SplitArchitecture] = Registry("split model", shares_names_with=MODELS)
SPLIT.register(
    "resnet-cifar",
    SplitArchitecture(
        3, "DTFL's CIFAR bottleneck ResNet in modules md1..md8 (blocks 3: ResNet-56, 6: -110)"
    ),
)


def split_family(family: object, method: str) -> CifarResNetFamily:
    """`family` as a model cut into modules for `method`, or the error that names the fix."""
    if not isinstance(family, CifarResNetFamily):
        raise ValueError(
            f"{method} cuts a split model into a client and a server side (model.name: "
            f"resnet-cifar); a {type(family).__name__} cannot be split"
        )
    return family


def aux_name(tier: int, local: str) -> str:
    """The global name of a tier's auxiliary-head tensor: `aux.weight` -> `aux3.weight`."""
    return f"{AUX}{tier}{local[len(AUX) :]}"


class Group(nn.ModuleList):
    """One of md2..md7: bottleneck blocks run in order."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self:
            x = block(x)
        return x


class PoolLinear(nn.Linear):
    """Global average pooling, then the linear layer: md8 and the auxiliary heads."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.mean(dim=(2, 3)))  # (B, C, H, W) -> (B, C) -> (B, classes)


class CifarResNet(nn.Module):
    """The modules of one side of the model (see the module docstring)."""

    def __init__(self, spec: Spec) -> None:
        super().__init__()
        first, last = _module_range(spec)
        norm = BatchNorm()
        for i in range(first, last + 1):
            if i == 1:
                module: nn.Module = ConvUnit(spec["input_shape"][0], OUT_CHANNELS[0], 1.0, norm)
            elif i == 8:
                module = PoolLinear(OUT_CHANNELS[-1], spec["num_classes"])
            else:
                module = _group(i, spec["blocks"], norm)
            self.add_module(f"md{i}", module)
        self.body = [f"md{i}" for i in range(first, last + 1)]
        self.aux: PoolLinear | None = None
        if spec["aux"]:
            self.aux = PoolLinear(OUT_CHANNELS[spec["tier"] - 1], spec["num_classes"])
        self.pipeline = self.body + ([AUX] if self.aux is not None else [])

    @property
    def head(self) -> nn.Module | None:
        """The classifier (`hetfl.core.roles`): md8, or a client's auxiliary head."""
        md8 = self._modules.get("md8")
        return md8 if md8 is not None else self.aux

    def forward(
        self, x: torch.Tensor, activations: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        for name in self.body:
            x = self._modules[name](x)  # type: ignore[misc]
        if self.aux is None:
            return x  # logits after md8, else md_m's activation (B, C_m, H_m, W_m)
        logits = self.aux(x)  # (B, classes)
        return (x, logits) if activations else logits


class EdgeResNet(nn.Module):
    """The edge model (`side: "edge"`, see the module docstring): md1, `local`, `head`."""

    def __init__(self, spec: Spec) -> None:
        super().__init__()
        norm = BatchNorm()
        self.md1 = ConvUnit(spec["input_shape"][0], OUT_CHANNELS[0], 1.0, norm)
        self.local = _group(2, EDGE_BLOCKS, norm)
        self.head = PoolLinear(OUT_CHANNELS[1], spec["num_classes"])
        self.pipeline = ["md1", "local", "head"]

    def forward(
        self, x: torch.Tensor, activations: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        z = self.md1(x)  # (B, 16, H, W): the feature map the client uploads
        logits = self.head(self.local(z))  # (B, classes)
        return (z, logits) if activations else logits


def _group(i: int, blocks: int, norm: BatchNorm) -> Group:
    """md_i (2..7): `blocks` bottlenecks, the first taking md_{i-1}'s output."""
    planes, stride, cin = PLANES[i - 2], STRIDES[i - 2], OUT_CHANNELS[i - 2]
    group = Group()
    for b in range(blocks):
        base_in = cin if b == 0 else planes * Bottleneck.expansion
        group.append(Bottleneck(base_in, base_in, planes, 1.0, stride if b == 0 else 1, norm))
    return group


def _module_range(spec: Spec) -> tuple[int, int]:
    """The first and last md index a spec's side holds."""
    if spec["side"] == "whole":
        return 1, 8
    if spec["side"] == "client":
        return 1, spec["tier"]
    return spec["tier"] + 1, 8


class CifarResNetFamily:
    """The family of a `SPLIT` model's sides (see the module docstring): `build(spec)`,
    `index_map(spec)`, `global_spec(specs)` (the whole model), `modules(spec)`,
    `declared_tensors(specs)` (the auxiliary heads), `side_spec(...)` and `server_spec`."""

    def __init__(self, base: Mapping[str, Any]) -> None:
        self.base = normalise({**base, "side": "whole", "tier": None, "aux": False})

    def side_spec(self, side: Side, tier: int | None = None, *, aux: bool = False) -> Spec:
        """The base spec's `side` at `tier` (None for the whole model)."""
        return self.checked(self.base.replace(side=side, tier=tier, aux=aux))

    def server_spec(self, client: Spec) -> Spec:
        """The server side of a client spec's tier (what its server copy trains)."""
        return self.side_spec("server", self.checked(client)["tier"])

    def checked(self, spec: Mapping[str, Any]) -> Spec:
        """`spec` completed and checked, and of this family's model."""
        spec = normalise(spec)
        for key in ("family", "input_shape", "num_classes", "blocks"):
            if spec[key] != self.base[key]:
                raise SpecError(
                    f"{self.base['family']}: a spec with {key} = {spec[key]!r}, but the "
                    f"family's is {self.base[key]!r}; only side, tier and aux differ"
                )
        return spec

    def build(self, spec: Spec) -> nn.Module:
        return self._model(spec)

    def _model(self, spec: Spec) -> CifarResNet | EdgeResNet:
        spec = self.checked(spec)
        return EdgeResNet(spec) if spec["side"] == "edge" else CifarResNet(spec)

    def index_map(self, spec: Spec) -> IndexMap:
        spec = self.checked(spec)
        if spec["side"] == "edge":
            return []  # the client's own model: nothing of it is shared
        return [
            MapEntry(n, aux_name(spec["tier"], n) if n.startswith(AUX + ".") else n)
            for n in _layout(spec)
        ]

    def global_spec(self, specs: list[Spec]) -> Spec:
        """The whole model, or, where every spec is an edge model, its server side."""
        checked = [self.checked(s) for s in specs]
        if checked and all(s["side"] == "edge" for s in checked):
            return self.side_spec("server", 1)
        return self.base

    def modules(self, spec: Spec) -> list[str]:
        with torch.device("meta"):
            return list(self._model(spec).pipeline)

    def declared_tensors(self, specs: Sequence[Spec]) -> list[DeclaredTensor]:
        """Each auxiliary head some client spec has, once per tier, in tier order, as
        `nn.Linear` initialises it (weight Kaiming-uniform, bias U(±1/sqrt(fan in)))."""
        tiers = sorted({s["tier"] for s in map(self.checked, specs) if s["aux"]})
        classes = self.base["num_classes"]
        out = []
        for m in tiers:
            fan_in = OUT_CHANNELS[m - 1]
            out.append(
                DeclaredTensor(
                    aux_name(m, f"{AUX}.weight"), (classes, fan_in), "kaiming_uniform_default"
                )
            )
            out.append(DeclaredTensor(aux_name(m, f"{AUX}.bias"), (classes,), FanUniform(fan_in)))
        return out


@dataclass(frozen=True)
class FanUniform:
    """U(-1/sqrt(fan_in), 1/sqrt(fan_in)): `nn.Linear`'s bias initialisation."""

    fan_in: int

    def __call__(self, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
        bound = 1.0 / self.fan_in**0.5
        return torch.empty(shape).uniform_(-bound, bound, generator=generator)


@lru_cache(maxsize=64)
def _layout(spec: Spec) -> tuple[str, ...]:
    """The state names of a checked spec's model (not the edge's), built on the meta device."""
    with torch.device("meta"):
        return tuple(CifarResNet(spec).state_dict())


def normalise(values: Mapping[str, Any]) -> Spec:
    """A complete, checked spec (defaults: the whole model, the architecture's blocks)."""
    v = dict(values)
    name = str(v.get("family"))
    arch = SPLIT.get(name)
    v.setdefault("blocks", arch.default_blocks)
    v.setdefault("side", "whole")
    v.setdefault("tier", None)
    v.setdefault("aux", False)
    spec = Spec(v)
    _check(name, spec)
    return spec


def _check(name: str, spec: Spec) -> None:
    """Refuse a spec no model can be built from, naming the field and the fix."""
    blocks = spec["blocks"]
    if not (isinstance(blocks, int) and not isinstance(blocks, bool) and blocks >= 1):
        raise SpecError(
            f"{name}: blocks (per group) must be an integer >= 1 (3: ResNet-56, "
            f"6: ResNet-110), got {blocks!r}"
        )
    side, tier = spec["side"], spec["tier"]
    if side not in SIDES:
        raise SpecError(f"{name}: side must be one of {', '.join(SIDES)}, got {side!r}")
    if side == "whole" and tier is not None:
        raise SpecError(
            f"{name}: the whole model has no tier, got tier {tier!r}; use side 'client' "
            "or 'server' for a cut"
        )
    if side == "edge" and tier != 1:
        raise SpecError(
            f"{name}: the edge model's feature extractor is md1, so its tier must be 1, "
            f"got {tier!r}"
        )
    if side != "whole" and not (isinstance(tier, int) and tier in TIERS):
        beyond = (
            " (a cut after md8 is beyond the model: md8 is its classifier)"
            if isinstance(tier, int) and tier > TIERS[-1]
            else ""
        )
        raise SpecError(
            f"{name}: tier must be an integer in 1..7 (the client holds md1..md_tier, the "
            f"server the rest), got {tier!r}{beyond}"
        )
    if spec["aux"] not in (True, False):
        raise SpecError(f"{name}: aux must be true or false, got {spec['aux']!r}")
    if spec["aux"] and side != "client":
        raise SpecError(
            f"{name}: aux (the tier's auxiliary head) belongs to the client side, got it "
            f"on side {side!r}"
        )
    shape = spec["input_shape"]
    if len(shape) != 3 or min(shape) < 1:
        raise SpecError(f"{name}: input_shape must be (C, H, W) of sizes >= 1, got {shape}")
    if not (isinstance(spec["num_classes"], int) and spec["num_classes"] >= 1):
        raise SpecError(f"{name}: num_classes must be an integer >= 1, got {spec['num_classes']}")
