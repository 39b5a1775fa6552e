"""Normalisation as a factory a model family is given, chosen once from the spec.

A scalable model never asks which normalisation it has: its constructor takes a
`NormFactory` (as torchvision's `ResNet` takes `norm_layer`) and calls it for every layer,
`norm(base, ratio)`, with the layer's base channel count and built width ratio. The spec's
`bn` names the kind; `norm_for(spec)` turns it into a factory through the `NORMS` registry,
the only place a kind's name means anything:

- `batch`: BatchNorm with running statistics (averaged like any tensor, kept private for
  FedBN, or group-qualified by a strategy's map);
- `static`: HeteroFL's sBN (Diao et al., ICLR 2021, §3; authors' code
  `train_classifier_fed.py`: `stats`): batch statistics always, no running statistics in
  training (evaluation builds the same spec with `bn="batch"` and re-estimates them);
- `per-width`: FjORD's one set of running statistics per width level, with a shared affine
  sliced to the width (Horváth et al., NeurIPS 2021; the authors' Flower baseline,
  `fjord/od/layers/batch_norm.py`); needs the spec's `levels`;
- `per-capacity`: BatchNorm whose affine and running statistics are kept per capacity
  group: the family's index map moves every normalisation tensor to
  `cap<p>/<name>` (`hetfl.core.spec.capacity_group`), so it is averaged only among the
  clients of that capacity, as FLANC's authors run every method (Mei et al., NeurIPS 2022,
  supplementary §1.2; their baseline trainer averages each BN tensor within its capacity
  group, as FLANC's own family does for all of its non-basis tensors). The layer is the
  `batch` one; each group's global tensors start as copies of the global model's (a
  client uses their leading part, as of any sliced tensor);
- `none`: identity; the convolution before it then has a bias of its own.

HeteroFL's scaler (activations divided by the width ratio during training only) is an
option of every kind but `per-width` (`scaler` in the spec): the paper's code places it
before every normalisation layer, and keeps it with no normalisation (`norm: none`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Protocol

from torch import nn

from hetfl.core.registry import Registry
from hetfl.core.spec import Spec
from hetfl.models.slim import NoNorm, PerWidthBatchNorm2d, SlimBatchNorm2d, channels


class NormFactory(Protocol):
    """Builds the normalisation after a layer of `base` channels built at width `ratio`.

    `fixed`: the layer's width never changes (FLANC's 64-channel stem): it keeps one set of
    statistics and no scaler, since neither its input nor its output depends on the width.
    `conv_bias`: the convolution before the norm needs a bias of its own (no affine follows).
    `per_capacity`: the family keeps every normalisation tensor per capacity group."""

    @property
    def conv_bias(self) -> bool: ...

    @property
    def per_capacity(self) -> bool: ...

    def __call__(self, base: int, ratio: float, *, fixed: bool = False) -> nn.Module: ...


@dataclass(frozen=True)
class BatchNorm:
    """`SlimBatchNorm2d` over the leading channels: the `batch`, `static` (no running
    statistics) and `per-capacity` kinds, each optionally with HeteroFL's scaler."""

    track_running_stats: bool = True
    scaler: bool = False
    per_capacity: bool = False
    conv_bias: ClassVar[bool] = False

    def __call__(self, base: int, ratio: float, *, fixed: bool = False) -> nn.Module:
        return SlimBatchNorm2d(
            channels(ratio, base),
            ratio=ratio,
            scaler=self.scaler and not fixed,
            track_running_stats=self.track_running_stats,
        )


@dataclass(frozen=True)
class PerWidthNorm:
    """FjORD's `PerWidthBatchNorm2d`, one set of running statistics per level of `levels`
    at or below the layer's ratio; a fixed-width layer gets plain BatchNorm."""

    levels: tuple[float, ...]
    per_capacity: ClassVar[bool] = False
    conv_bias: ClassVar[bool] = False

    def __call__(self, base: int, ratio: float, *, fixed: bool = False) -> nn.Module:
        if fixed:
            return BatchNorm()(base, ratio, fixed=True)
        return PerWidthBatchNorm2d(base, levels=self.levels, ratio=ratio)


@dataclass(frozen=True)
class Identity:
    """No normalisation (`NoNorm`), optionally with HeteroFL's scaler; the convolution
    before it keeps its bias."""

    scaler: bool = False
    per_capacity: ClassVar[bool] = False
    conv_bias: ClassVar[bool] = True

    def __call__(self, base: int, ratio: float, *, fixed: bool = False) -> nn.Module:
        return NoNorm(ratio, scaler=self.scaler and not fixed)


def _per_width(spec: Spec) -> NormFactory:
    if not spec["levels"]:
        raise ValueError("bn 'per-width' needs the width levels (spec key 'levels')")
    if spec["scaler"]:
        raise ValueError(
            "the scaler is HeteroFL's; it does not combine with bn 'per-width' "
            "(set scaler to False, or use bn 'static')"
        )
    return PerWidthNorm(tuple(spec["levels"]))


#: The normalisation kinds: spec (its `scaler`, `levels`) -> the factory a model is given.
NORMS: Registry[Callable[[Spec], NormFactory]] = Registry("normalisation")
NORMS.register("batch", lambda spec: BatchNorm(scaler=bool(spec["scaler"])))
NORMS.register(
    "static", lambda spec: BatchNorm(track_running_stats=False, scaler=bool(spec["scaler"]))
)
NORMS.register("per-width", _per_width)
NORMS.register(
    "per-capacity", lambda spec: BatchNorm(scaler=bool(spec["scaler"]), per_capacity=True)
)
NORMS.register("none", lambda spec: Identity(scaler=bool(spec["scaler"])))


#: The kind a trained model of a kind is evaluated as after a statistics pass, where it is
#: not itself: static BN keeps no running statistics to re-estimate.
_EVALUATED_AS = {"static": "batch"}


def evaluated_norm(spec: Spec) -> dict[str, object]:
    """The spec entries that evaluate a trained model of `spec` after a statistics pass
    (`eval.local_trained`): a kind with running statistics (`batch` for `static`, as
    HeteroFL evaluates it) and no scaler (HeteroFL's divides in training only, so the pass
    must not see it)."""
    return {"bn": _EVALUATED_AS.get(spec["bn"], spec["bn"]), "scaler": False}


def norm_for(spec: Spec) -> NormFactory:
    """The factory of the spec's `bn`; a `ValueError` naming the problem when the kind is
    unknown or the spec lacks what it needs."""
    kind = spec["bn"]
    if kind not in NORMS:
        raise ValueError(f"bn must be one of {', '.join(NORMS.names())}, got {kind!r}")
    return NORMS.get(kind)(spec)
