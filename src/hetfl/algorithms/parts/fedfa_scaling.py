"""Scalable aggregation: each client's tensors rescaled to the round's mean magnitude before
they are averaged (Park and Joe-Wong, "Federated Learning with Flexible Architectures",
ECML-PKDD 2024, §4.3 and Algorithm 1, lines 12-18) — a round-level scaling part of a
`Strategy` (`hetfl.core.server.weighting.Scaling`), usable by any method that averages weights.

Per client c and global tensor l, `‖M_95%,c^(l)‖` is the L2 norm of the entries of the
tensor the client trained whose magnitude is at most the 0.95 quantile of their magnitudes
(§4.3: "under the 95th percentile"; linear interpolation between order statistics, as
`numpy.quantile` defaults to, ties kept). It is taken over the elements the client holds,
never over a tensor padded to the global shape: its local tensor, the same local tensor
for every global tensor it is grafted into (Algorithm 2), and only the entries it uploads
where a contribution mask narrows them (the head rows of its own classes). Then

    α_c^(l) = mean over the clients κ covering l of ‖M_95%,κ^(l)‖  /  ‖M_95%,c^(l)‖,

and the reducer adds `n_c · α_c^(l) · M_c^(l)` over `n_c` (Algorithm 1, lines 18-22).

HetFL's choices where the paper is silent:
- `norm: rms` divides each norm by the square root of the entries kept: plain L2 grows
  with the number of entries, so a width-1/4 client's layer (1/16 of the entries) gets a
  large α only because it is small, against §4.3's aim (App. 0.F compares the *mean*
  magnitude per weight); `l2` (the default) is the paper's formula;
- `scale: weights_only` rescales the convolution and linear weights and leaves biases and
  normalisation affines as they are; `all` (the default) rescales every tensor a client
  uploads ("for all layers l"), which with static BatchNorm are all trainable;
- a client whose kept entries are all zero has nothing to rescale: its α is 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch

from hetfl.core.init import build_model
from hetfl.core.roles import layer_weight_names
from hetfl.core.spec import Spec
from hetfl.core.types import ModelFamily, Trained

NormKind = Literal["l2", "rms"]
ScaledTensors = Literal["all", "weights_only"]
#: The quantile of |w| above which entries are left out of a norm (§4.3).
QUANTILE = 0.95


def quantile_norm(values: torch.Tensor, kind: NormKind = "l2", q: float = QUANTILE) -> float:
    """The L2 norm (or, with `kind="rms"`, the root mean square) of the entries whose
    magnitude is at most the q-quantile of all the magnitudes, computed in float64 from one
    sort (`torch.quantile` refuses tensors of more than 16M elements)."""
    if kind not in ("l2", "rms"):
        raise ValueError(f"norm must be 'l2' or 'rms', got {kind!r}")
    magnitudes = values.detach().reshape(-1).abs().to(torch.float64)
    n = magnitudes.numel()
    if n == 0:
        raise ValueError("the quantile norm of an empty tensor is undefined")
    ordered = torch.sort(magnitudes).values
    position = q * (n - 1)
    below = math.floor(position)
    above = min(below + 1, n - 1)
    threshold = ordered[below] + (position - below) * (ordered[above] - ordered[below])
    kept = magnitudes[magnitudes <= threshold]
    norm = float(torch.linalg.vector_norm(kept))
    return norm / math.sqrt(kept.numel()) if kind == "rms" else norm


class QuantileNormScaling:
    """α per client and global tensor from every result of the round (module docstring).
    `family` builds a client's model (on the meta device) to tell its layer weights from
    its other tensors."""

    def __init__(
        self, family: ModelFamily, *, norm: NormKind = "l2", scale: ScaledTensors = "all"
    ) -> None:
        if scale not in ("all", "weights_only"):
            raise ValueError(f"scale must be 'all' or 'weights_only', got {scale!r}")
        if norm not in ("l2", "rms"):
            raise ValueError(f"norm must be 'l2' or 'rms', got {norm!r}")
        self.family, self.norm, self.scale = family, norm, scale
        self._weights: dict[Spec, set[str]] = {}

    def __call__(self, trained: Sequence[Trained]) -> list[dict[str, float]]:
        norms = [self.norms(t) for t in trained]
        covering: dict[str, list[float]] = {}
        for client in norms:
            for name, value in client.items():
                covering.setdefault(name, []).append(value)
        mean = {name: sum(values) / len(values) for name, values in covering.items()}
        return [
            {name: mean[name] / value if value > 0 else 1.0 for name, value in client.items()}
            for client in norms
        ]

    def norms(self, t: Trained) -> dict[str, float]:
        """One client's quantile norm per global tensor it uploads to and that is scaled:
        the norm of the local tensor its map entry reads, over the entries the entry's
        mask keeps."""
        scaled = None if self.scale == "all" else self._layer_weights(t.task.spec)
        out: dict[str, float] = {}
        unmasked: dict[str, float] = {}  # a grafted block's tensor is measured once
        for entry in t.task.index_map:
            values = t.result.tensors[entry.local]
            if (scaled is not None and entry.local not in scaled) or not values.is_floating_point():
                continue
            if entry.mask is not None:
                kept = values[entry.mask.to(device=values.device, dtype=torch.bool)]
                if kept.numel():
                    out.setdefault(entry.global_name, quantile_norm(kept, self.norm))
                continue
            if entry.local not in unmasked:
                unmasked[entry.local] = quantile_norm(values, self.norm)
            out.setdefault(entry.global_name, unmasked[entry.local])
        return out

    def _layer_weights(self, spec: Spec) -> set[str]:
        if spec not in self._weights:
            with torch.device("meta"):
                self._weights[spec] = layer_weight_names(build_model(self.family, spec))
        return self._weights[spec]
