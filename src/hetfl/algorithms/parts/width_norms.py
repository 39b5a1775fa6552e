"""The normalisation a width-sliced method (HeteroFL, FjORD) runs its levels with, chosen
by the method's `norm` option from the injected kinds of `hetfl.models.norms`: the spec
clients train at each level, the spec each level is evaluated with, and whether evaluation
re-estimates BatchNorm statistics first.

- `static`: HeteroFL's sBN (Diao et al., ICLR 2021, §3): batch statistics in training; the
  evaluated spec is plain BatchNorm after a statistics pass over the clients' data;
- `per-width`: FjORD's one set of running statistics per width level (Horváth et al.,
  NeurIPS 2021; the authors' Flower baseline), evaluated as trained;
- `per-capacity`: BatchNorm whose tensors are averaged within each capacity group only, as
  FLANC's authors run every method on ResNet-18 (Mei et al., NeurIPS 2022, supplementary
  §1.2), evaluated as trained;
- `none`: no normalisation, the convolutions with biases (FLANC's Fashion-MNIST CNN for
  every method, supplementary §1.2; HeteroFL's code, `norm: none`).

The scaler (HeteroFL's, activations / r in training only) combines with every kind but
`per-width`, which refuses it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import Field

from hetfl.algorithms.parts.widths import LevelSpec, level_specs
from hetfl.core.spec import Spec

WidthNorm = Literal["static", "per-width", "per-capacity", "none"]
#: The `norm` option of HeteroFL and FjORD (each sets its own default).
NormOption = Annotated[
    WidthNorm,
    Field(
        description="the normalisation after every convolution: static (HeteroFL's sBN, "
        "statistics re-estimated before evaluation), per-width (FjORD's running statistics "
        "per width), per-capacity (BatchNorm averaged within each capacity, as FLANC's "
        "authors run every method on ResNet-18) or none (FLANC's Fashion-MNIST CNN)"
    ),
]


@dataclass(frozen=True)
class LevelNorm:
    """A width-sliced method's levels under one normalisation: `train`, the spec a client
    trains at ratio r; `evaluate`, the spec level r is tested with (its tensors those of
    `train`'s map); `stats_pass`, whether evaluation re-estimates BatchNorm statistics
    from training data first (static BN only); `per_capacity`, whether a level's
    normalisation tensors exist only once some client has trained that level."""

    train: LevelSpec
    evaluate: LevelSpec
    stats_pass: bool
    per_capacity: bool


def level_norm(base: Spec, norm: WidthNorm, levels: Sequence[float], *, scaler: bool) -> LevelNorm:
    """The `LevelNorm` of `norm` over the full-width `base`, with HeteroFL's scaler when
    `scaler` (which `per-width` refuses when a model is built)."""
    if norm == "static":
        trained = level_specs(base, bn="static", scaler=scaler)
        return LevelNorm(trained, level_specs(base, bn="batch", scaler=False), True, False)
    if norm == "per-width":
        spec = level_specs(base, bn="per-width", levels=tuple(levels), scaler=scaler)
        return LevelNorm(spec, spec, False, False)
    trained = level_specs(base, bn=norm, scaler=scaler)
    tested = level_specs(base, bn=norm, scaler=False)
    return LevelNorm(trained, tested, False, norm == "per-capacity")
