"""Neural composition: a layer's weight is a shared basis times layer-specific coefficients.

Mei et al., "Resource-Adaptive Federated Learning with All-In-One Neural Composition"
(NeurIPS 2022), supplementary §2: a width-p kernel of shape (T_p, S_p, k, k) is composed
from a basis V of R2 filters of shape (R1, k, k), shared by every width, and coefficients
U_p of shape (T_p, (S_p/R1)·R2), specific to the width:

    W[t, g·R1 + i] = sum_r U[t, g·R2 + r] · V[r, i]        (g < S_p/R1, i < R1, r < R2)

so each R1-channel chunk g of the input has its own R2 coefficients per output channel.
Supplementary §3 computes it in two equivalent ways, both here (`mode`):

- `"explicit"` (strategy 1): compose W (one matrix product, T_p·S_p·R2·k² MACs) and
  convolve once;
- `"factorised"` (strategy 2, the default, as the authors' code `conv_basis` and
  `DecomBlock`): convolve every chunk of the input with V, then mix the G·R2 maps with U as a
  1×1 convolution; cheaper (supplementary eq. 2) and what the cost model then prices.

The parameters are plain `basis` and `coef` (no bias, as the code's `DecomBlock`); each
layer declares its `basis` in the role "basis" (`hetfl_tensor_roles`), by which FLANC's
orthogonality penalty finds the banks (`hetfl.core.roles.tensor_roles`). `S_p/R1` must be
an integer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

#: How a composed layer computes its output (supplementary §3's two strategies).
COMPOSE_MODES = ("factorised", "explicit")


def chunk_count(in_features: int, basis_size: int) -> int:
    """G = S_p / R1, the number of input chunks; refused when it is not an integer."""
    if basis_size < 1 or in_features % basis_size:
        raise ValueError(
            f"S_p/R1 must be an integer: in_channels S_p = {in_features}, "
            f"basis_size R1 = {basis_size}"
        )
    return in_features // basis_size


def _checked_mode(mode: str) -> str:
    if mode not in COMPOSE_MODES:
        raise ValueError(f"mode must be one of {', '.join(COMPOSE_MODES)}, got {mode!r}")
    return mode


def compose(coef: torch.Tensor, basis: torch.Tensor, groups: int) -> torch.Tensor:
    """The explicit weight W (T, G·R1, *kernel) from U (T, G·R2, ...) and V (R2, R1, *kernel):
    one (T·G, R2) x (R2, R1·k²) matrix product."""
    t, r2, r1 = coef.shape[0], basis.shape[0], basis.shape[1]
    kernel = tuple(basis.shape[2:])
    u = coef.reshape(t * groups, r2)
    w = u @ basis.reshape(r2, -1)  # (T·G, R1·k²): row t·G + g is W[t, g·R1:(g+1)·R1]
    return w.reshape(t, groups * r1, *kernel)


def _reset(basis: torch.Tensor, coef: torch.Tensor, generator: torch.Generator | None) -> None:
    """The code's initialisation at this layer's own shape: an orthogonal basis
    (`cnn_flanc.py`: `torch.nn.init.orthogonal`), PyTorch's default for the coefficients.
    `generator=None` draws from the global RNG, as PyTorch's layer constructors do."""
    with torch.no_grad():
        nn.init.orthogonal_(basis, generator=generator)
        bound = 1.0 / coef[0].numel() ** 0.5
        coef.uniform_(-bound, bound, generator=generator)


def _check_input(layer: nn.Module, got: int, expected: int) -> None:
    if got != expected:
        raise ValueError(
            f"{type(layer).__name__}: input has {got} channels/features, the layer takes {expected}"
        )


class ComposedConv2d(nn.Module):
    """A k×k convolution S_p -> T_p composed from `basis` (R2, R1, k, k) and `coef`
    (T_p, (S_p/R1)·R2, 1, 1)."""

    #: `basis` is a shared neural basis (`hetfl.core.roles.tensor_roles`).
    hetfl_tensor_roles: ClassVar[Mapping[str, str]] = {"basis": "basis"}

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        basis_size: int,
        n_basis: int,
        kernel_size: int,
        *,
        stride: int = 1,
        padding: int = 0,
        mode: str = "factorised",
    ) -> None:
        super().__init__()
        self.groups = chunk_count(in_channels, basis_size)
        self.in_channels, self.out_channels = in_channels, out_channels
        self.basis_size, self.n_basis = basis_size, n_basis
        self.stride, self.padding, self.mode = stride, padding, _checked_mode(mode)
        self.basis = nn.Parameter(torch.empty(n_basis, basis_size, kernel_size, kernel_size))
        self.coef = nn.Parameter(torch.empty(out_channels, self.groups * n_basis, 1, 1))
        _reset(self.basis, self.coef, None)

    def kernel(self) -> torch.Tensor:
        """The composed (T_p, S_p, k, k) kernel."""
        return compose(self.coef, self.basis, self.groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        _check_input(self, c, self.in_channels)
        if self.mode == "explicit":
            return F.conv2d(x, self.kernel(), None, self.stride, self.padding)
        # Chunk g of sample b becomes sample b·G + g: one convolution with V for all chunks.
        chunks = x.reshape(b * self.groups, self.basis_size, h, w)
        maps = F.conv2d(chunks, self.basis, None, self.stride, self.padding)  # (B·G, R2, H', W')
        maps = maps.reshape(b, self.groups * self.n_basis, *maps.shape[-2:])  # g·R2 + r
        return F.conv2d(maps, self.coef)  # (B, T_p, H', W')

    def reset_parameters_with(self, generator: torch.Generator) -> None:
        _reset(self.basis, self.coef, generator)

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, basis_size={self.basis_size}, "
            f"n_basis={self.n_basis}, kernel_size={self.basis.shape[-1]}, stride={self.stride}, "
            f"padding={self.padding}, mode={self.mode}"
        )


class ComposedLinear(nn.Module):
    """A matrix S_p -> T_p composed from `basis` (R2, R1) and `coef` (T_p, (S_p/R1)·R2),
    applied to the last dimension of its input. No bias: a model keeps its biases as
    parameters of its own."""

    #: `basis` is a shared neural basis (`hetfl.core.roles.tensor_roles`).
    hetfl_tensor_roles: ClassVar[Mapping[str, str]] = {"basis": "basis"}

    def __init__(
        self,
        in_features: int,
        out_features: int,
        basis_size: int,
        n_basis: int,
        *,
        mode: str = "factorised",
    ) -> None:
        super().__init__()
        self.groups = chunk_count(in_features, basis_size)
        self.in_features, self.out_features = in_features, out_features
        self.basis_size, self.n_basis = basis_size, n_basis
        self.mode = _checked_mode(mode)
        self.basis = nn.Parameter(torch.empty(n_basis, basis_size))
        self.coef = nn.Parameter(torch.empty(out_features, self.groups * n_basis))
        _reset(self.basis, self.coef, None)

    def kernel(self) -> torch.Tensor:
        """The composed (T_p, S_p) matrix."""
        return compose(self.coef, self.basis, self.groups)

    def operator(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The layer as a function of its input, with the matrix composed once (explicit
        mode): for a caller that applies it many times, as a recurrence does."""
        if self.mode == "explicit":
            return partial(self._explicit, self.kernel())
        return self._factorised

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.operator()(x)

    def _explicit(self, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        _check_input(self, int(x.shape[-1]), self.in_features)
        return F.linear(x, weight)

    def _factorised(self, x: torch.Tensor) -> torch.Tensor:
        _check_input(self, int(x.shape[-1]), self.in_features)
        lead = x.shape[:-1]
        chunks = x.reshape(*lead, self.groups, self.basis_size)
        mixed = F.linear(chunks, self.basis)  # (..., G, R2)
        return F.linear(mixed.reshape(*lead, self.groups * self.n_basis), self.coef)

    def reset_parameters_with(self, generator: torch.Generator) -> None:
        _reset(self.basis, self.coef, generator)

    def extra_repr(self) -> str:
        return (
            f"{self.in_features}, {self.out_features}, basis_size={self.basis_size}, "
            f"n_basis={self.n_basis}, mode={self.mode}"
        )
