"""One job: scalable model families, one global model with sub-models sliced from it by width
and depth.

A spec of a scalable family holds:

- `family`, `input_shape` (C, H, W), `num_classes`;
- `widths`: one width ratio per *slot* (a stage, a section or a layer group, as the family
  defines them), relative to the family's base widths, so ratios may exceed 1;
- `stages`: how many slots the model has (depth by stages or sections); `blocks`: residual
  blocks per slot (depth within a section, for the ResNets, MobileNetV2 and EfficientNetV2,
  whose architectures live in `hetfl.models.mobilenet` and `hetfl.models.efficientnet` and
  register here);
- `bn`, the normalisation kind (`batch | static | per-width | per-capacity | none`, see
  `hetfl.models.norms`, which turns it into the factory the model is given), `scaler`
  (HeteroFL's), `levels` (the width levels of per-width statistics), `stem` (the ResNets'
  and MobileNetV2's input layout: `small` for CIFAR-size inputs, `imagenet`).
- optionally `step_size: True` (Pre-ResNet and EfficientNetV2): a learnable scalar on the
  residual branches (NeFL's, `hetfl.models.blocks.StepSize`); absent, the blocks have none.

Every tensor of a sub-model is a leading slice of the global tensor of the same name, so a
family's index map is the prefix map of the sub-model's tensors (`W[:out, :in]`), and the
global spec is the per-slot maximum over the clients' specs, counting a slot only for the
specs that have it (ScalableFL, Nitta et al., arXiv 2311.08716, §III-A: the global model has
the widest channels of every layer and the depth of the deepest client). Layers slice
themselves (`model(x, width=p)`), so the model built for ratio p equals a wider model run at
p.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Any, Protocol, cast, runtime_checkable

import torch
from torch import nn

from hetfl.core.registry import Registry
from hetfl.core.roles import norm_tensor_names
from hetfl.core.spec import (
    IndexMap,
    MapEntry,
    SectionBlock,
    Spec,
    capacity_group,
    group_qualified,
    prefix_index,
)
from hetfl.models.base import MODELS
from hetfl.models.blocks import BasicBlock, ConvUnit, PreActBlock, ResidualBlock, slim_conv
from hetfl.models.norms import NormFactory, evaluated_norm, norm_for
from hetfl.models.slim import SlimLinear, channels


class SpecError(ValueError):
    """A spec no model of the family can be built from."""


# -- the architectures ---------------------------------------------------------------------------
class StageCNN(nn.Module):
    """ScalableFL's Fig. 1 network: `stages` 3x3 stride-2 convolutions (base channels 32, 64,
    128, 256), each followed by BN and ReLU, global average pooling, a linear head."""

    BASE = (32, 64, 128, 256)

    def __init__(self, spec: Spec, norm: NormFactory) -> None:
        super().__init__()
        cin = spec["input_shape"][0]
        self.stages = nn.ModuleList()
        for i in range(spec["stages"]):
            unit = ConvUnit(cin, self.BASE[i], spec["widths"][i], norm, stride=2)
            self.stages.append(unit)
            cin = unit.conv.out_channels
        self.head = SlimLinear(cin, spec["num_classes"], base_out=None)
        self.pipeline = [f"stages.{i}" for i in range(len(self.stages))] + ["head"]

    def forward(self, x: torch.Tensor, width: float | None = None) -> torch.Tensor:
        for stage in self.stages:
            x = stage(x, width)  # (B, C_i, H / 2^(i+1), W / 2^(i+1))
        return self.head(x.mean(dim=(2, 3)), width)  # (B, num_classes)


class FlancCNN(nn.Module):
    """The 4-layer CNN of FLANC's Fashion-MNIST experiment (Mei et al., "Resource-Adaptive
    Federated Learning with All-In-One Neural Composition", NeurIPS 2022, supplementary
    §1.2; the layout below is the authors' code, `src/model/cnn_flanc.py`, which reproduces
    the MACs of the supplement's Table 2), undecomposed:
    a 3x3 stem conv to 64 channels that no width changes (no activation, no pool), two 3x3
    convs to 128p channels each followed by ReLU and 2x2 max-pool, a linear head on the
    flattened 128p x H/4 x W/4 features. A norm other than `none` follows each conv, as
    the HeteroFL and FjORD versions have. Width slots: the two sliced convs."""

    BASE = (128, 128)

    def __init__(self, spec: Spec, norm: NormFactory) -> None:
        super().__init__()
        c, h, w = spec["input_shape"]
        self.stem = ConvUnit(c, 64, 1.0, norm, fixed=True, relu=False)
        self.conv2 = ConvUnit(64, self.BASE[0], spec["widths"][0], norm, pool=True)
        cin = self.conv2.conv.out_channels
        self.conv3 = ConvUnit(cin, self.BASE[1], spec["widths"][1], norm, pool=True)
        features = self.conv3.conv.out_channels * (h // 4) * (w // 4)
        self.head = SlimLinear(features, spec["num_classes"], base_out=None)
        self.pipeline = ["stem", "conv2", "conv3", "head"]

    def forward(self, x: torch.Tensor, width: float | None = None) -> torch.Tensor:
        x = self.stem(x, width)  # (B, 64, H, W)
        x = self.conv3(self.conv2(x, width), width)  # (B, 128p, H/4, W/4)
        return self.head(x.flatten(1), width)  # (B, num_classes)


class ResNet(nn.Module):
    """ResNet-18-style networks of a given block class (`hetfl.models.blocks`): a stem,
    `stages` residual stages of `blocks[i]` blocks (base widths 64, 128, 256, 512; strides
    1, 2, 2, 2), global average pooling, a linear head. With `BasicBlock` it is
    post-activation (`resnet18`, ScalableFL's Table IV); with `PreActBlock` pre-activation,
    the stem without a norm and a final norm-ReLU (`preresnet`: HeteroFL, FedFA, NeFL),
    whose blocks take NeFL's step size when the spec asks (`step_size`).

    `stem="imagenet"`: 7x7 stride-2 conv, BN, ReLU, 3x3 stride-2 max-pool (ScalableFL counts
    the stem as its stage 1, so its c stages are `stages = c - 1` here); `stem="small"`: a
    3x3 stride-1 conv (CIFAR-size inputs). The stem takes stage 1's width ratio, so
    identity shortcuts always join equal widths."""

    BASE = (64, 128, 256, 512)
    STRIDES = (1, 2, 2, 2)

    def __init__(self, spec: Spec, norm: NormFactory, block: ResidualBlock) -> None:
        super().__init__()
        cin, r0 = spec["input_shape"][0], spec["widths"][0]
        imagenet = spec["stem"] == "imagenet"
        kernel = 7 if imagenet else 3
        self.stem = slim_conv(cin, self.BASE[0], r0, kernel, 2 if imagenet else 1)
        self.stem_norm = None if block.preactivation else norm(self.BASE[0], r0)
        self.stem_pool = imagenet
        self.stages = nn.ModuleList()
        c, base_in, r_in = self.stem.out_channels, self.BASE[0], r0
        stepped = {"step_size": True} if spec.get("step_size") else {}
        for i in range(spec["stages"]):
            blocks = nn.ModuleList()
            r = spec["widths"][i]
            for b in range(spec["blocks"][i]):
                stride = self.STRIDES[i] if b == 0 else 1
                blocks.append(
                    block(c, base_in, self.BASE[i], r, stride, norm, in_ratio=r_in, **stepped)
                )
                base_in, r_in = self.BASE[i] * block.expansion, r
                c = channels(r, base_in)
            self.stages.append(blocks)
        last = spec["stages"] - 1
        self.final_norm = norm(base_in, spec["widths"][last]) if block.preactivation else None
        self.head = SlimLinear(c, spec["num_classes"], base_out=None)
        self.pipeline = (
            ["stem"]
            + [
                f"stages.{i}.{b}"
                for i, s in enumerate(self.stages)
                for b in range(len(cast(nn.ModuleList, s)))
            ]
            + ["head"]
        )

    def forward(self, x: torch.Tensor, width: float | None = None) -> torch.Tensor:
        x = self.stem(x, width)
        if self.stem_norm is not None:
            x = torch.relu(self.stem_norm(x, width))
        if self.stem_pool:
            x = nn.functional.max_pool2d(x, 3, 2, 1)
        for blocks in self.stages:
            for block in cast(nn.ModuleList, blocks):  # each stage is a ModuleList of blocks
                x = block(x, width)
        if self.final_norm is not None:
            x = torch.relu(self.final_norm(x, width))
        return self.head(x.mean(dim=(2, 3)), width)  # (B, num_classes)


# -- the family ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Architecture:
    """One scalable architecture: its builder (given the spec and the normalisation
    factory), its base channel counts per width slot, its depth limits, how much a stage
    shrinks the input (for the 'input too small' check) and, optionally, a check of its own
    (`check(spec)` raises a `SpecError`: MobileNetV2's stages that cannot be repeated)."""

    make: Callable[[Spec, NormFactory], nn.Module]
    base_widths: tuple[int, ...]
    max_stages: int
    default_blocks: tuple[int, ...] | None
    min_side: Callable[[Spec], int]
    summary: str
    check: Callable[[Spec], None] | None = None
    #: Whether its blocks take a step size (`step_size` in the spec: NeFL's).
    step_sizes: bool = False
    #: The most blocks a depth candidate gives each stage (`depth_blocks`: MobileNetV2's
    #: Table 2 repeats); None: no cap, the candidate's depth in every stage.
    max_repeats: tuple[int, ...] | None = None
    #: The rank of its inputs: 3 for images (C, H, W), 1 for token sequences (T,) (the
    #: Transformer's, `hetfl.models.transformer`), whose length `min_side` bounds.
    input_rank: int = 3
    #: Whether its outputs are detections (B, A, 4 + K + 1: `hetfl.models.ssd`) rather
    #: than class logits; a run's task is classification, so a config refuses it.
    detector: bool = False

    @property
    def slots(self) -> int:
        """Width slots: one ratio per stage (or layer group)."""
        return len(self.base_widths)


ARCHITECTURES: Registry[Architecture] = Registry("scalable model", shares_names_with=MODELS)
ARCHITECTURES.register(
    "stage-cnn",
    Architecture(
        StageCNN,
        StageCNN.BASE,
        4,
        None,
        lambda s: 2 ** s["stages"],
        "ScalableFL's stage CNN (32-256 ch)",
    ),
)
ARCHITECTURES.register(
    "flanc-cnn",
    Architecture(
        FlancCNN, FlancCNN.BASE, 2, None, lambda s: 4, "FLANC's Fashion-MNIST CNN (64, 128, 128)"
    ),
)
_RESNET_SIDE = {  # input side halvings: stem (imagenet: conv and pool) + stages 2..4
    "imagenet": lambda s: 2 ** (2 + max(s["stages"] - 1, 0)),
    "small": lambda s: 2 ** max(s["stages"] - 1, 0),
}
_RESNET_BLOCKS: tuple[tuple[str, ResidualBlock, str], ...] = (
    ("resnet18", BasicBlock, "ResNet-18, post-activation, stages x blocks (ScalableFL Table IV)"),
    (
        "preresnet",
        PreActBlock,
        "Pre-activation ResNet with sections of blocks (HeteroFL, FedFA, NeFL)",
    ),
)
for _name, _block, _summary in _RESNET_BLOCKS:
    ARCHITECTURES.register(
        _name,
        Architecture(
            partial(ResNet, block=_block),
            ResNet.BASE,
            4,
            (2, 2, 2, 2),
            lambda s: _RESNET_SIDE[s["stem"]](s),
            _summary,
            step_sizes=_block is PreActBlock,
        ),
    )


def depth_blocks(spec: Spec, depth: int) -> tuple[int, ...]:
    """The blocks per stage of a depth candidate (FedFA and its baselines: one depth for
    the whole model): `min(depth, n)` in each of `spec`'s stages, where n is the family's
    `max_repeats` for that stage (none, or a spec of no registered architecture: `depth`
    itself), so MobileNetV2's one-block stages keep their block and depth 4 is its own
    full depth; slots beyond `stages` keep `spec`'s, as `global_spec` does. A depth above
    the full one is refused: it would be the full model under another label."""
    family = spec.get("family")
    caps = (
        ARCHITECTURES.get(family).max_repeats
        if isinstance(family, str) and family in ARCHITECTURES
        else None
    )
    stages = spec["stages"]
    if caps is None:
        return tuple(depth if i < stages else b for i, b in enumerate(spec["blocks"]))
    if depth > max(caps[:stages]):
        full = max(caps[:stages])
        raise SpecError(
            f"{spec['family']}: a depth candidate d puts min(d, n) blocks in a stage of n "
            f"repeats, n = {caps[:stages]}, so depth {depth} is the full model, depth "
            f"{full}; list depths up to {full}"
        )
    return tuple(min(depth, caps[i]) if i < stages else b for i, b in enumerate(spec["blocks"]))


def input_reductions(base: Spec) -> list[int]:
    """How much the family's model shrinks its input side, for `stages` = 1, 2, ...: a
    family whose entries repeat has (partly) a fixed depth."""
    arch = ARCHITECTURES.get(base["family"])
    return [arch.min_side(base.replace(stages=s)) for s in range(1, arch.max_stages + 1)]


def family_stages(base: Spec, halvings: int) -> int:
    """The family's `stages` whose model halves its input `halvings` times."""
    possible = input_reductions(base)
    if 2**halvings in possible:
        return possible.index(2**halvings) + 1
    raise ValueError(
        f"{base['family']} (stem {base.get('stem')}) cannot halve its input {halvings} "
        f"time(s): its models shrink inputs by {possible}; change the client's input size "
        "or base_size"
    )


#: Spec keys merged into the global spec (per-slot maxima); every other key must agree.
_MERGED = ("widths", "stages", "blocks", "num_classes", "input_shape", "scaler")


class ScalableFamily:
    """A scalable family: `build(spec)`, the prefix `index_map(spec)`, the merged
    `global_spec(specs)` and the ordered `modules(spec)` (the forward pipeline, whose gaps
    are the possible split points)."""

    def __init__(self, base: Mapping[str, Any]) -> None:
        self.base = self.normalise(base)
        self.max_classes = int(self.base["num_classes"])

    @staticmethod
    def normalise(values: Mapping[str, Any]) -> Spec:
        """A complete, checked spec: scalars broadcast to one value per slot."""
        name = values.get("family")
        arch = ARCHITECTURES.get(str(name))
        v = dict(values)
        v.setdefault("stages", arch.max_stages)
        v.setdefault("bn", "batch")
        v.setdefault("scaler", False)
        v.setdefault("levels", ())
        v.setdefault("stem", "small" if arch.default_blocks else None)
        # `width` (one ratio for every slot) wins over `widths`, so `{**spec, "width": p}`
        # re-widths a complete spec.
        widths = v.pop("width") if "width" in v else v.get("widths", 1.0)
        if isinstance(widths, int | float):
            widths = (float(widths),) * arch.slots
        v["widths"] = tuple(float(w) for w in widths)
        if arch.default_blocks is not None:
            blocks = v.get("blocks", arch.default_blocks)
            v["blocks"] = (blocks,) * arch.slots if isinstance(blocks, int) else tuple(blocks)
        spec = Spec(v)
        check_spec(spec)
        return spec

    def checked(self, spec: Mapping[str, Any]) -> Spec:
        """`spec` completed and checked, also against the data (no more classes than it has)."""
        spec = self.normalise(spec)
        if spec["num_classes"] > self.max_classes:
            raise SpecError(
                f"{spec['family']}: a sub-model with {spec['num_classes']} classes, but the data "
                f"has {self.max_classes}"
            )
        return spec

    def build(self, spec: Spec) -> nn.Module:
        return _make(self.checked(spec))

    def index_map(self, spec: Spec) -> IndexMap:
        """Every tensor a prefix of the global tensor of the same name; with a
        `per-capacity` norm, the normalisation tensors of `capacity_group(spec)`'s own
        global copies (`hetfl.core.spec.group_qualified`), so that they are averaged only
        among the clients of that capacity."""
        spec = self.checked(spec)
        shapes, per_capacity = _layout(spec)
        imap = [MapEntry(name, name, prefix_index(*shape)) for name, shape in shapes.items()]
        if not per_capacity:
            return imap
        return group_qualified(imap, spec_capacity_group(spec), per_capacity)

    def evaluation_spec(self, spec: Spec) -> Spec:
        """The spec a trained model of `spec` is evaluated through after a statistics pass
        (`eval.local_trained`): static BN, which keeps no running statistics, becomes
        `batch`, and HeteroFL's scaler (training only) is off, so that the pass sees what
        evaluation sees. Every tensor of `spec`'s model keeps its name and shape."""
        spec = self.checked(spec)
        return self.normalise({**spec, **evaluated_norm(spec)})

    def modules(self, spec: Spec) -> list[str]:
        with torch.device("meta"):
            return list(self.build(spec).pipeline)  # type: ignore[arg-type]

    def sections(self, spec: Spec) -> list[list[SectionBlock]]:
        """The residual blocks of each section (stage) of a spec built in sections of
        blocks (the ResNets, MobileNetV2), in order: what depth-flexible methods take apart
        (FedFA's grafting; a method that drops or steps over blocks). A family without
        residual sections is a `SpecError`."""
        spec = self.checked(spec)
        if ARCHITECTURES.get(spec["family"]).default_blocks is None:
            raise SpecError(
                f"{spec['family']} has no residual sections; a depth-flexible method needs a "
                "model built in sections of blocks (resnet18, preresnet, mobilenetv2, "
                "efficientnetv2-s, efficientnetv2-tiny)"
            )
        return [list(section) for section in _sections(spec)]

    def global_spec(self, specs: list[Spec]) -> Spec:
        if not specs:
            return self.base
        specs = [self.normalise(s) for s in specs]
        first = specs[0]
        for s in specs[1:]:
            for key in set(first) | set(s):
                if key not in _MERGED and first.get(key) != s.get(key):
                    raise SpecError(
                        f"sub-models of one global model must agree on {key!r}: "
                        f"{first.get(key)!r} vs {s.get(key)!r}"
                    )
        stages = max(s["stages"] for s in specs)

        def slot_max(key: str, default: tuple[Any, ...]) -> tuple[Any, ...]:
            return tuple(
                max((s[key][i] for s in specs if s["stages"] > i), default=default[i])
                for i in range(len(default))
            )

        merged = dict(first)
        merged["stages"] = stages
        merged["widths"] = slot_max("widths", first["widths"])
        if "blocks" in first:
            merged["blocks"] = slot_max("blocks", first["blocks"])
        merged["num_classes"] = max(s["num_classes"] for s in specs)
        # Images (C, H, W): the first's channels, the largest sides; tokens (T,): the
        # longest context.
        shape = first["input_shape"]
        largest = tuple(max(s["input_shape"][i] for s in specs) for i in range(len(shape)))
        merged["input_shape"] = (shape[0], *largest[1:]) if len(shape) == 3 else largest
        merged["scaler"] = False
        return self.normalise(merged)


def _make(spec: Spec) -> nn.Module:
    """The model of a checked spec, given the normalisation its `bn` names."""
    return ARCHITECTURES.get(spec["family"]).make(spec, norm_for(spec))


@lru_cache(maxsize=256)
def _layout(spec: Spec) -> tuple[dict[str, tuple[int, ...]], frozenset[str]]:
    """Tensor names and shapes of the model for `spec`, and the names kept per capacity
    (its normalisation tensors, found by structure, when the norm says so), built on the
    meta device (no memory, no random draws)."""
    with torch.device("meta"):
        model = _make(spec)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    kept = norm_tensor_names(model) if norm_for(spec).per_capacity else set()
    return shapes, frozenset(kept)


@runtime_checkable
class SectionMember(Protocol):
    """A block of a section that says whether it is an identity block: stride 1 and equal
    base widths, adding its input unchanged (`hetfl.models.blocks`' residual blocks without
    a shortcut, MobileNetV2's repeats after a stage's first block)."""

    identity: bool


@lru_cache(maxsize=256)
def _sections(spec: Spec) -> tuple[tuple[SectionBlock, ...], ...]:
    """Each stage's blocks of a spec built in sections, found on a model built on the meta
    device, each an identity block where it says so (`SectionMember`)."""
    with torch.device("meta"):
        model = _make(spec)
    out = []
    for i, stage in enumerate(cast(nn.ModuleList, model.stages)):
        blocks = []
        for b, block in enumerate(cast(nn.ModuleList, stage)):
            if not isinstance(block, SectionMember):
                raise SpecError(
                    f"{spec['family']}'s blocks do not say which are identity blocks; a "
                    "depth-flexible method needs resnet18, preresnet, mobilenetv2 or an "
                    "efficientnetv2"
                )
            path = f"stages.{i}.{b}"
            names = tuple(f"{path}.{k}" for k in block.state_dict())
            blocks.append(SectionBlock(path, names, block.identity))
        out.append(tuple(blocks))
    return tuple(out)


def spec_capacity_group(spec: Spec) -> str:
    """The capacity group of a spec's per-capacity tensors: `capacity_group(r)` when every
    width slot the model has is at ratio r (the width levels of HeteroFL and FjORD), else
    one group per distinct set of slot widths (`cap1-0.5`)."""
    used = spec["widths"][: spec["stages"]]
    if len(set(used)) == 1:
        return capacity_group(used[0])
    return capacity_group(used[0]) + "".join(f"-{w:g}" for w in used[1:])


def check_spec(spec: Spec) -> None:
    """Refuse a spec no model can be built from, naming the field and the fix."""
    name = spec["family"]
    arch = ARCHITECTURES.get(name)
    widths = spec["widths"]
    if len(widths) != arch.slots:
        raise SpecError(f"{name}: widths needs {arch.slots} values (one per slot), got {widths}")
    for w in widths:
        if not (isinstance(w, int | float) and math.isfinite(w) and w > 0):
            raise SpecError(f"{name}: width ratios must be positive finite numbers, got {widths}")
    stages = spec["stages"]
    if not (isinstance(stages, int) and 1 <= stages <= arch.max_stages):
        raise SpecError(f"{name}: stages must be an integer in 1..{arch.max_stages}, got {stages}")
    if arch.default_blocks is not None:
        blocks = spec["blocks"]
        if len(blocks) != arch.slots or any(not isinstance(b, int) or b < 1 for b in blocks):
            raise SpecError(f"{name}: blocks needs {arch.slots} integers >= 1, got {blocks}")
        if spec["stem"] not in ("small", "imagenet"):
            raise SpecError(f"{name}: stem must be 'small' or 'imagenet', got {spec['stem']!r}")
    if arch.check is not None:
        arch.check(spec)
    if spec.get("step_size") and not arch.step_sizes:
        with_steps = [n for n in ARCHITECTURES.names() if ARCHITECTURES.get(n).step_sizes]
        raise SpecError(
            f"{name}: step_size (NeFL's step size per residual block) needs one of "
            f"{with_steps}, whose blocks take it; use one of them as model.name"
        )
    try:
        norm_for(spec)
    except ValueError as e:
        raise SpecError(f"{name}: {e}") from None
    if not (isinstance(spec["num_classes"], int) and spec["num_classes"] >= 1):
        raise SpecError(f"{name}: num_classes must be an integer >= 1, got {spec['num_classes']}")
    shape = spec["input_shape"]
    if arch.input_rank == 1:
        if len(shape) != 1 or not (isinstance(shape[0], int) and shape[0] >= 1):
            raise SpecError(f"{name}: input_shape must be (T,) tokens, T >= 1, got {shape}")
        return
    if len(shape) != 3:
        raise SpecError(f"{name}: input_shape must be (C, H, W), got {shape}")
    need = arch.min_side(spec)
    if min(shape[1], shape[2]) < need:
        raise SpecError(
            f"{name}: input {shape[1]}x{shape[2]} is too small for {stages} stage(s): each side "
            f"must be at least {need}; use fewer stages or larger inputs"
        )
