"""Declared global tensors: global state that is not a slice of the one global model.

Most global tensors are tensors of `build(global_spec)`, and a client's tensor is a slice of
one of them. Some methods need global tensors of their own shape:

- FLANC's per-capacity coefficients `U_p` (Mei et al., "Resource-Adaptive Federated
  Learning with All-In-One Neural Composition", NeurIPS 2022, supplementary §2: a kernel is
  a shared basis times capacity-specific coefficients): each capacity's coefficients are
  initialised at that capacity's shape, so their fan is their own, not the fan of a
  full-width tensor they would be sliced from;
- DTFL's per-tier auxiliary networks ("Speed up Federated Learning in Heterogeneous
  Environment: a Dynamic Tiering Approach", §3.2): a head after the tier-m client model
  exists in no single global model.

A family or a strategy declares such tensors with `DeclaredTensor` (name, shape, dtype,
initialiser, role); `Strategy._init_global_state` builds each from a generator of its own,
derived from the run's initialisation seed and the tensor's name (`declared_generator`), so
adding, removing or reordering declarations never shifts another tensor's draws, nor the
global model's.

This module imports only `hetfl.core.rng` (a leaf), so model families may return its types.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from hetfl.core.rng import sibling_generator

#: An initialiser given as a function: (shape, generator) -> a tensor of that shape.
InitFn = Callable[[tuple[int, ...], torch.Generator], torch.Tensor]
#: `"parameter"`: trained, moved by server optimisers; `"buffer"`: statistics and counters,
#: left to plain averaging (as BatchNorm's running statistics are).
Role = Literal["parameter", "buffer"]

_NORMAL = re.compile(r"normal\((?P<std>[^)]*)\)")
#: The named initialisers (besides `"normal(<std>)"`), each PyTorch's own scheme.
NAMED_INITS = (
    "zeros",
    "ones",
    "kaiming_normal_fan_in",
    "kaiming_normal_fan_out",
    "kaiming_uniform_default",
    "orthogonal",
)


@dataclass(frozen=True)
class DeclaredTensor:
    """A global tensor built at its own shape rather than sliced from the global model.

    `init` names an initialiser (`NAMED_INITS`, or `"normal(<std>)"`, mean 0) or is a
    function `(shape, generator) -> Tensor`. Fans follow PyTorch
    (`nn.init._calculate_fan_in_and_fan_out`): for a `(rows, cols, *kernel)` tensor, fan in =
    cols * prod(kernel), fan out = rows * prod(kernel). `"kaiming_uniform_default"` is
    PyTorch's Linear/Conv weight default (`kaiming_uniform_(a=sqrt(5))`, bound
    1/sqrt(fan_in)). A group-qualified name (`"<group>/<name>"`) that is declared replaces
    the copy of the global model's tensor that group qualification would otherwise start from.
    """

    name: str
    shape: tuple[int, ...]
    init: str | InitFn
    dtype: torch.dtype = torch.float32
    role: Role = "parameter"

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if not self.name:
            raise ValueError("a declared tensor needs a non-empty name")
        if any(s < 0 for s in self.shape):
            raise ValueError(
                f"declared tensor {self.name!r} has shape {self.shape}: need sizes >= 0"
            )
        if self.role not in ("parameter", "buffer"):
            raise ValueError(
                f"declared tensor {self.name!r} has role {self.role!r}; "
                "allowed: 'parameter' or 'buffer'"
            )
        if isinstance(self.init, str):
            _named_init(self.name, self.init)  # refuse an unknown name at declaration

    def build(self, generator: torch.Generator) -> torch.Tensor:
        """The initial value, drawn from `generator` (use `declared_generator`)."""
        if isinstance(self.init, str):
            value = _named_init(self.name, self.init)(self.shape, generator)
        else:
            value = self.init(self.shape, generator)
        if tuple(value.shape) != self.shape:
            raise ValueError(
                f"initialiser of declared tensor {self.name!r} returned shape "
                f"{tuple(value.shape)}, declared {self.shape}"
            )
        return value.detach().to(self.dtype)


def declared_generator(init_generator: torch.Generator, name: str) -> torch.Generator:
    """The generator a declared tensor is drawn from: derived from the run's initialisation
    seed and the tensor's name only (`hetfl.core.rng.sibling_generator`)."""
    return sibling_generator(init_generator, f"declared/{name}")


def build_declared(
    declared: Iterable[DeclaredTensor], init_generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """Every declared tensor at its own shape, in declaration order; a name declared twice
    is an error."""
    out: dict[str, torch.Tensor] = {}
    for d in declared:
        if d.name in out:
            raise ValueError(f"global tensor {d.name!r} is declared twice")
        out[d.name] = d.build(declared_generator(init_generator, d.name))
    return out


def _named_init(name: str, init: str) -> InitFn:
    """The function behind an initialiser's name; an unknown name is an error naming it."""
    normal = _NORMAL.fullmatch(init)
    if normal is not None:
        std = _parse_std(name, normal.group("std"))
        return lambda shape, g: torch.empty(shape).normal_(0.0, std, generator=g)
    if init == "zeros":
        return lambda shape, g: torch.zeros(shape)
    if init == "ones":
        return lambda shape, g: torch.ones(shape)
    if init in ("kaiming_normal_fan_in", "kaiming_normal_fan_out"):
        mode: Literal["fan_in", "fan_out"] = "fan_in" if init.endswith("fan_in") else "fan_out"
        return _with_fan(name, lambda t, g: nn.init.kaiming_normal_(t, mode=mode, generator=g))
    if init == "kaiming_uniform_default":
        return _with_fan(
            name, lambda t, g: nn.init.kaiming_uniform_(t, a=math.sqrt(5), generator=g)
        )
    if init == "orthogonal":
        return _with_fan(name, lambda t, g: nn.init.orthogonal_(t, generator=g))
    raise ValueError(
        f"declared tensor {name!r} has initialiser {init!r}; allowed: "
        f"{', '.join(NAMED_INITS)}, 'normal(<std>)' or a function (shape, generator) -> Tensor"
    )


def _with_fan(name: str, fill: Callable[[torch.Tensor, torch.Generator], torch.Tensor]) -> InitFn:
    """A fan-based initialiser, refused for shapes that have no fan (fewer than 2 dims)."""

    def build(shape: Sequence[int], g: torch.Generator) -> torch.Tensor:
        if len(shape) < 2:
            raise ValueError(
                f"declared tensor {name!r} of shape {tuple(shape)} has no fan: fan-based "
                "initialisers need at least 2 dimensions"
            )
        return fill(torch.empty(tuple(shape)), g)

    return build


def _parse_std(name: str, text: str) -> float:
    try:
        std = float(text)
    except ValueError:
        std = math.nan
    if not (std >= 0.0 and math.isfinite(std)):
        raise ValueError(
            f"declared tensor {name!r} has initialiser 'normal({text})'; the std must be a "
            "finite number >= 0, e.g. 'normal(0.02)'"
        )
    return std
