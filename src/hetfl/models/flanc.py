"""FLANC's composed model family: one model per capacity, sharing only the bases.

Mei et al., "Resource-Adaptive Federated Learning with All-In-One Neural Composition"
(NeurIPS 2022), supplementary §1.2-§2: every capacity p has its own coefficients U_p, stem,
normalisation and classifier; the bases V are shared by all capacities. A spec holds
`family`, `input_shape`, `num_classes`, `capacity` p in (0, 1], `compose` (`factorised` or
`explicit`, `hetfl.models.composed`) and `basis` (the basis-size preset, `hetfl.models.
flanc_nets`: `table2` or `code` for the CNN, `code` or `table2` for the ResNet-18,
`supplement` for the RNN; the first is the default).

The index map puts a model's tensors into global ones:

- a composed layer's `…basis` maps to the bank `basis/<owner>`, the same global tensor and
  rows for every capacity (the owner is the layer's module path; in the `code` ResNet-18
  the block's, whose one bank (2·R2, R1, 3, 3) gives conv1 rows [0, R2) and conv2 rows
  [R2, 2·R2), as the authors' `resnet18_flanc.py` splits one orthogonal draw per block);
- every other tensor maps whole to `cap<p>/<local name>` (`capacity_group`), so each
  capacity is a model of its own, and no global name equals a local one.

`declared_tensors` declares all of them (`hetfl.core.declared`), each initialised at its
own shape as the authors' code does: orthogonal banks; in the ResNet-18 every convolution
N(0, sqrt(2 / (k²·out))) and BN (1, 0; statistics 0, 1); in the CNN and the RNN, which
re-initialise nothing, PyTorch's defaults. Never a slice of a wider tensor.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from torch import nn

from hetfl.core.declared import DeclaredTensor, InitFn, Role
from hetfl.core.registry import Registry
from hetfl.core.spec import GROUP_SEP, IndexMap, MapEntry, Spec, capacity_group
from hetfl.models.base import MODELS
from hetfl.models.composed import COMPOSE_MODES, ComposedConv2d, ComposedLinear, chunk_count
from hetfl.models.flanc_nets import (
    CNN_BASIS_SIZES,
    ComposedCharRNN,
    ComposedCNN,
    ComposedResNet18,
    ComposedRNN,
    Composition,
    cnn_layout,
    resnet_layout,
    rnn_layout,
)
from hetfl.models.scalable import SpecError

#: The global bank `basis/<owner>` is in this group.
BASIS_GROUP = "basis"


@dataclass(frozen=True)
class ComposedArchitecture:
    """One composed architecture: its model, its layout, the input it takes (`input_rank`
    dimensions, spatial sides of at least `min_side`), its basis presets and the initialiser
    of its plain convolutions and coefficients."""

    make: Callable[[Spec], nn.Module]
    layout: Callable[[Spec], list[Composition]]
    input_rank: int
    min_side: int
    presets: tuple[str, ...]
    conv_init: str
    summary: str


COMPOSED: Registry[ComposedArchitecture] = Registry("composed model", shares_names_with=MODELS)
COMPOSED.register(
    "composed-cnn",
    ComposedArchitecture(
        ComposedCNN,
        cnn_layout,
        3,
        4,
        tuple(CNN_BASIS_SIZES),
        "kaiming_uniform_default",
        "FLANC's Fashion-MNIST CNN, composed convolutions (basis: table2 | code)",
    ),
)
COMPOSED.register(
    "composed-resnet18",
    ComposedArchitecture(
        ComposedResNet18,
        resnet_layout,
        3,
        8,
        ("code", "table2"),
        "kaiming_normal_fan_out",
        "FLANC's ResNet-18, composed 3x3 convolutions, BN per capacity (basis: code | table2)",
    ),
)
COMPOSED.register(
    "composed-rnn",
    ComposedArchitecture(
        ComposedCharRNN,
        rnn_layout,
        1,
        1,
        ("supplement",),
        "kaiming_uniform_default",
        "FLANC's character RNN (512), composed matrices",
    ),
)

_DEFAULTS = {"capacity": 1.0, "compose": "factorised"}


class ComposedFamily:
    """The composed family of `base["family"]`: `build(spec)` is capacity p's own model,
    `index_map(spec)` its map (bases shared, the rest per capacity), `global_spec(specs)`
    the largest capacity, `declared_tensors(specs)` every global tensor."""

    def __init__(self, base: Mapping[str, Any]) -> None:
        self.base = normalise(base)

    def checked(self, spec: Mapping[str, Any]) -> Spec:
        """`spec` completed and checked, and of this family's model."""
        spec = normalise(spec)
        for key in ("family", "input_shape", "num_classes", "compose", "basis"):
            if spec[key] != self.base[key]:
                raise SpecError(
                    f"{self.base['family']}: a spec with {key} = {spec[key]!r}, but the "
                    f"family's is {self.base[key]!r}; only the capacity differs between models"
                )
        return spec

    def spec_at(self, capacity: float) -> Spec:
        """The base spec at `capacity`."""
        return self.checked(self.base.replace(capacity=capacity))

    def build(self, spec: Spec) -> nn.Module:
        spec = self.checked(spec)
        return COMPOSED.get(spec["family"]).make(spec)

    def index_map(self, spec: Spec) -> IndexMap:
        return list(_index_map(self.checked(spec)))

    def global_spec(self, specs: list[Spec]) -> Spec:
        if not specs:
            return self.base
        return max((self.checked(s) for s in specs), key=lambda s: s["capacity"])

    def modules(self, spec: Spec) -> list[str]:
        return list(_meta_model(self.checked(spec)).pipeline)  # type: ignore[arg-type]

    def declared_tensors(self, specs: list[Spec]) -> list[DeclaredTensor]:
        """The banks once, then every tensor of each distinct capacity among `specs` (the
        base's when empty), at its own shape."""
        checked = {s["capacity"]: s for s in map(self.checked, specs or [self.base])}
        ordered = [checked[p] for p in sorted(checked)]
        banks: dict[str, DeclaredTensor] = {}
        for spec in ordered:
            for c in COMPOSED.get(spec["family"]).layout(spec):
                name = f"{BASIS_GROUP}{GROUP_SEP}{c.bank}"
                banks.setdefault(name, DeclaredTensor(name, c.bank_shape, "orthogonal"))
        own = [d for spec in ordered for d in _capacity_tensors(spec)]
        return [*banks.values(), *own]


# -- specs ---------------------------------------------------------------------------------------
def normalise(values: Mapping[str, Any]) -> Spec:
    """A complete, checked spec of a composed model."""
    name = str(values.get("family"))
    if name not in COMPOSED:
        raise SpecError(COMPOSED.unknown_message(name))
    arch = COMPOSED.get(name)
    spec = Spec({**_DEFAULTS, "basis": arch.presets[0], **values})
    _check(spec, arch)
    return spec.replace(capacity=float(spec["capacity"]))


def _check(spec: Spec, arch: ComposedArchitecture) -> None:
    """Refuse a spec no model can be built from, naming the field, the value and the fix."""
    name, p = spec["family"], spec["capacity"]
    if not (isinstance(p, int | float) and math.isfinite(p) and 0 < p <= 1):
        raise SpecError(f"{name}: capacity must be a number in (0, 1], got {p!r}")
    if spec["compose"] not in COMPOSE_MODES:
        raise SpecError(
            f"{name}: compose must be one of {', '.join(COMPOSE_MODES)}, got {spec['compose']!r}"
        )
    if spec["basis"] not in arch.presets:
        raise SpecError(
            f"{name}: basis must be one of {', '.join(arch.presets)}, got {spec['basis']!r}"
        )
    classes = spec["num_classes"]
    if not (isinstance(classes, int) and classes >= 1):
        raise SpecError(f"{name}: num_classes must be an integer >= 1, got {classes!r}")
    _check_input(spec, arch)
    for c in arch.layout(spec):
        try:
            chunk_count(c.s, c.r1)
        except ValueError:
            raise SpecError(
                f"{name}: layer {c.path} at capacity {p}: S_p/R1 must be an integer, got "
                f"S_p = {c.s}, R1 = {c.r1}; choose a capacity whose width is a multiple of {c.r1}"
            ) from None


def _check_input(spec: Spec, arch: ComposedArchitecture) -> None:
    name, shape = spec["family"], spec["input_shape"]
    want = "(C, H, W)" if arch.input_rank == 3 else "(L,) token codes"
    if not (isinstance(shape, tuple) and len(shape) == arch.input_rank):
        raise SpecError(f"{name}: input_shape must be {want}, got {shape!r}")
    sides = shape[1:] if arch.input_rank == 3 else shape
    if min(sides) < arch.min_side:
        raise SpecError(
            f"{name}: input_shape {shape} is too small: each side must be at least {arch.min_side}"
        )


# -- maps and declared tensors -------------------------------------------------------------------
@lru_cache(maxsize=64)
def _meta_model(spec: Spec) -> nn.Module:
    """The model of `spec` on the meta device (no memory, no random draws)."""
    with torch.device("meta"):
        return COMPOSED.get(spec["family"]).make(spec)


@lru_cache(maxsize=64)
def _index_map(spec: Spec) -> tuple[MapEntry, ...]:
    bases = {f"{c.path}.basis": c for c in COMPOSED.get(spec["family"]).layout(spec)}
    group = capacity_group(spec["capacity"])
    entries = []
    for local in _meta_model(spec).state_dict():
        c = bases.get(local)
        if c is None:
            entries.append(MapEntry(local, f"{group}{GROUP_SEP}{local}"))
            continue
        whole = c.r2 == c.bank_rows
        entries.append(
            MapEntry(local, f"{BASIS_GROUP}{GROUP_SEP}{c.bank}", () if whole else (c.rows,))
        )
    return tuple(entries)


def _capacity_tensors(spec: Spec) -> list[DeclaredTensor]:
    """Every tensor of capacity p's model but the bases, as `cap<p>/<local name>`."""
    conv_init = COMPOSED.get(spec["family"]).conv_init
    group = capacity_group(spec["capacity"])
    out = []
    for path, module in _meta_model(spec).named_modules():
        own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        for name, tensor in own:
            if name == "basis" and isinstance(module, ComposedConv2d | ComposedLinear):
                continue
            init, role = _init_of(module, name, conv_init)
            local = f"{path}.{name}" if path else name
            global_name = f"{group}{GROUP_SEP}{local}"
            out.append(DeclaredTensor(global_name, tuple(tensor.shape), init, tensor.dtype, role))
    return out


@dataclass(frozen=True)
class UniformBias:
    """PyTorch's default bias, U(-1/sqrt(fan_in), 1/sqrt(fan_in)) with the fan in of the
    weight it is added to (an `InitFn`; a dataclass so that it pickles)."""

    fan_in: int

    def __call__(self, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
        bound = 1.0 / math.sqrt(self.fan_in)
        return torch.empty(shape).uniform_(-bound, bound, generator=generator)


_NORM_INITS: dict[str, tuple[str, Role]] = {
    "weight": ("ones", "parameter"),
    "bias": ("zeros", "parameter"),
    "running_mean": ("zeros", "buffer"),
    "running_var": ("ones", "buffer"),
    "num_batches_tracked": ("zeros", "buffer"),
}


def _init_of(module: nn.Module, name: str, conv_init: str) -> tuple[str | InitFn, Role]:
    """How the authors' code initialises tensor `name` of `module` (see the module doc)."""
    if isinstance(module, nn.BatchNorm2d):
        return _NORM_INITS[name]
    if isinstance(module, ComposedRNN):  # its biases
        return UniformBias(module.hidden), "parameter"
    if isinstance(module, nn.Embedding):
        return "normal(1.0)", "parameter"
    if isinstance(module, ComposedConv2d):  # the coefficients: a 1x1 convolution
        return conv_init, "parameter"
    if isinstance(module, ComposedLinear):
        return "kaiming_uniform_default", "parameter"
    if isinstance(module, nn.Conv2d | nn.Linear):
        if name == "bias":
            return UniformBias(module.weight[0].numel()), "parameter"
        weight_init = conv_init if isinstance(module, nn.Conv2d) else "kaiming_uniform_default"
        return weight_init, "parameter"
    raise TypeError(f"no initialiser for {type(module).__name__}.{name}")
