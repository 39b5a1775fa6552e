"""MACs of the products a forward pass runs, and of the backward pass it implies, priced
from the operands' shapes as the forward runs (no backward pass is run).

A `MacTally` is a `torch.overrides.TorchFunctionMode`: plain Python around each torch
call, which needs neither a dispatcher-level mode nor `torch._dynamo` (whose first import,
by `torch.utils.flop_counter.FlopCounterMode`, cost a run seconds). The products are
convolutions, linear maps, matrix products and LSTMs (their input and recurrent
matrices); everything else (normalisation, pooling, activations) costs nothing, as is
usual and as torch's counter has it. Each product is priced with torch's FLOP formulas
(`torch.utils.flop_counter`: `conv_flop_count`, `mm_flop`, `bmm_flop`) and a MAC is half
a FLOP, so the tally equals torch's counter on the same pass.

The backward pass of a product costs one product of the forward's size per operand that
needs a gradient (one that requires grad: it depends on a parameter, or on an input that
requires grad): the input's gradient multiplies the output's gradient by the weight, the
weight's multiplies it by the input. A convolution's weight gradient is priced as
HetFL's cost model has it: torch's formula counts every input channel against every
output channel, and a grouped convolution's is divided by its groups (each of the g
groups correlates C_in/g input channels with C_out/g output gradients; a depthwise
convolution's weight gradient costs as much as its forward pass, not `channels` times as
much).

A product is charged to every watched module running when it is called (`modules`:
name -> module, tracked by forward hooks), its backward MACs too: they belong to the
module whose forward they differentiate.

Limits, each refused or checked rather than silently wrong: a product the tally does not
price (`bmm`, `einsum`, attention, GRUs, transposed convolutions, ...) raises; the pass's
result is taken to depend on every product run with gradients on (a product whose result
is dropped is still charged its backward, which a real backward pass would skip); the
tests hold the tally equal to `FlopCounterMode` on every registered family.

Convolutions and linear maps run on the first sample of the batch only and their result
is that sample repeated (`_first_sample`): the shapes and the need of gradients that
later products are priced from are right, for a fraction of the arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from math import prod
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import bmm_flop, conv_flop_count, mm_flop

_Shape = Sequence[int]


def _transposed(shape: _Shape) -> list[int]:
    return [shape[1], shape[0], *shape[2:]]


def _needs_grad(t: torch.Tensor | None) -> bool:
    return t is not None and t.requires_grad


class MacTally(TorchFunctionMode):
    """Counts, inside its block, the MACs of every product called: `total`, and per
    watched module `per_module` (name -> MACs). With `backward`, each product's backward
    MACs are added as it is called; otherwise only the forward is priced."""

    def __init__(
        self, backward: bool, modules: Mapping[str, torch.nn.Module] | None = None
    ) -> None:
        super().__init__()
        self.backward = backward
        self.total = 0
        self.per_module = dict.fromkeys(modules or {}, 0)
        self._modules = dict(modules or {})
        self._running: list[str] = []
        self._hooks: list[Any] = []

    def __enter__(self) -> MacTally:
        for name, module in self._modules.items():
            self._hooks.append(module.register_forward_pre_hook(self._enter_module(name)))
            self._hooks.append(module.register_forward_hook(self._leave_module(name)))
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _enter_module(self, name: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            self._running.append(name)

        return hook

    def _leave_module(self, name: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            self._running.remove(name)

        return hook

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = _first_sample(func, args, kwargs) if func in _PER_SAMPLE else func(*args, **kwargs)
        pricing = _PRODUCTS.get(func)
        if pricing is not None:
            self._charge(pricing(self.backward, out, *args, **kwargs))
        elif func in _UNPRICED:
            raise NotImplementedError(
                f"{getattr(func, '__name__', func)} is a product the cost model does not "
                "price; compute it with conv1d/conv2d/conv3d, linear, matmul or nn.LSTM"
            )
        return out

    def _charge(self, flops: int) -> None:
        macs = flops // 2  # every formula counts a multiply and an add per MAC
        self.total += macs
        for name in set(self._running):
            self.per_module[name] += macs


def _first_sample(func: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    """`func` (a convolution or a linear map) over the first sample of a batched input,
    repeated over the batch: the result's shape, dtype and need of a gradient for 1/B of
    the arithmetic (its values are not the product's, and no product's size depends on
    values). An unbatched input, or one passed by keyword, is computed whole."""
    if not args:
        return func(*args, **kwargs)
    x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
    batched = x.dim() > 1 if func is F.linear else x.dim() == weight.dim()
    if not batched:
        return func(*args, **kwargs)
    head = func(x[:1], *args[1:], **kwargs)
    return head.expand(x.shape[0], *head.shape[1:]).clone()


def _conv(
    backward: bool,
    out: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: Any = 1,
    padding: Any = 0,
    dilation: Any = 1,
    groups: int = 1,
) -> int:
    """FLOPs of `conv{1,2,3}d`: torch's `conv_flop` forward; backward as torch's
    `conv_backward_flop` for the input gradient and the weight gradient by groups."""
    x_shape, w_shape, out_shape = list(input.shape), list(weight.shape), list(out.shape)
    if len(x_shape) < len(w_shape):  # one unbatched sample: torch convolves a batch of 1
        x_shape, out_shape = [1, *x_shape], [1, *out_shape]
    flops = conv_flop_count(x_shape, w_shape, out_shape)
    if backward and _needs_grad(input):
        flops += conv_flop_count(out_shape, w_shape, x_shape, transposed=True)
    if backward and _needs_grad(weight):
        whole = conv_flop_count(_transposed(x_shape), _transposed(out_shape), _transposed(w_shape))
        flops += whole // groups
    return flops


def _matrix_product(backward: bool, a: torch.Tensor, b: torch.Tensor) -> int:
    """FLOPs of a (batched, broadcast) product a @ b of operands with two or more
    dimensions: one `bmm` over the broadcast batch (an `mm` when there is none; torch
    may fold the batch into the rows instead, the same count), and as much again for
    each operand's gradient."""
    if a.dim() < 2 or b.dim() < 2:
        raise NotImplementedError(
            f"the cost model prices products of matrices, got operands of shapes "
            f"{tuple(a.shape)} and {tuple(b.shape)}"
        )
    batch = prod(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    (m, k), n = a.shape[-2:], b.shape[-1]
    flops = bmm_flop((batch, m, k), (batch, k, n))
    if backward:
        flops *= 1 + _needs_grad(a) + _needs_grad(b)
    return flops


def _matmul(backward: bool, out: torch.Tensor, input: torch.Tensor, other: torch.Tensor) -> int:
    return _matrix_product(backward, input, other)


def _mm(backward: bool, out: torch.Tensor, input: torch.Tensor, mat2: torch.Tensor) -> int:
    return _matrix_product(backward, input, mat2)


def _linear(
    backward: bool,
    out: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> int:
    """FLOPs of `linear`: x (..., in) times weight.T (in, out), the leading dimensions
    folded into rows (torch's `addmm`/`mm`)."""
    rows = prod(input.shape[:-1])
    flops = mm_flop((rows, weight.shape[1]), (weight.shape[1], weight.shape[0]))
    if backward:
        flops *= 1 + _needs_grad(input) + _needs_grad(weight)
    return flops


def _lstm(
    backward: bool,
    out: Any,
    x: torch.Tensor,
    hx: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor],
    has_biases: bool,
    num_layers: int,
    dropout: float,
    train: bool,
    bidirectional: bool,
    batch_first: bool,
) -> int:
    """FLOPs of `nn.LSTM` run as the matrix products it is made of (torch's CPU kernel
    without oneDNN): per layer and direction, the input matrix over every step at once
    and the recurrent matrix once per step. The first step's recurrent product has a
    state gradient only when the initial state `hx` requires grad; a layer's input
    product has an input gradient when its input requires grad (above the first layer,
    always)."""
    if weights[1].shape[0] != weights[1].shape[1] * 4 or not x.dim() == 3:
        raise NotImplementedError(
            "the cost model prices LSTMs without projections (proj_size=0) on batched, "
            "unpacked sequences"
        )
    steps, batch = (x.shape[1], x.shape[0]) if batch_first else (x.shape[0], x.shape[1])
    per_direction = 4 if has_biases else 2
    directions = 2 if bidirectional else 1
    flops, layer_input_grad = 0, _needs_grad(x)
    for layer in range(num_layers):
        for d in range(directions):
            w_ih, w_hh = weights[(layer * directions + d) * per_direction :][:2]
            gates, inputs, hidden = w_ih.shape[0], w_ih.shape[1], w_hh.shape[1]
            each_ih = mm_flop((steps * batch, inputs), (inputs, gates))
            each_hh = mm_flop((batch, hidden), (hidden, gates))
            flops += each_ih + steps * each_hh
            if backward:
                # Past the first step the state depends on this layer's weights.
                later_states = any(w.requires_grad for w in weights) or layer_input_grad
                state_grads = (steps - 1) * later_states + _needs_grad(hx[0])
                flops += each_ih * (layer_input_grad + _needs_grad(w_ih))
                flops += each_hh * (steps * _needs_grad(w_hh) + state_grads)
        layer_input_grad = True
    return flops


#: The products priced, by the torch function called (nn.Conv2d, nn.Linear and nn.LSTM
#: call these).
_PRODUCTS: dict[Callable[..., Any], Callable[..., int]] = {
    torch.conv1d: _conv,
    torch.conv2d: _conv,
    torch.conv3d: _conv,
    F.linear: _linear,
    torch.matmul: _matmul,
    torch.Tensor.matmul: _matmul,  # also `a @ b`
    torch.mm: _mm,
    torch.Tensor.mm: _mm,
    torch.lstm: _lstm,
}

#: Products whose result keeps the input's first dimension, computed for its first sample.
_PER_SAMPLE = frozenset({torch.conv1d, torch.conv2d, torch.conv3d, F.linear})

#: Products torch's counter counts that this tally does not price: refused, not missed.
_UNPRICED: frozenset[Callable[..., Any]] = frozenset(
    {
        torch.bmm,
        torch.Tensor.bmm,
        torch.addmm,
        torch.Tensor.addmm,
        torch.baddbmm,
        torch.Tensor.baddbmm,
        torch.addbmm,
        torch.einsum,
        torch.tensordot,
        torch.bilinear,
        torch.conv_transpose1d,
        torch.conv_transpose2d,
        torch.conv_transpose3d,
        torch.conv_tbc,
        torch.lstm_cell,
        torch.gru_cell,
        torch.rnn_tanh_cell,
        torch.rnn_relu_cell,
        torch.gru,
        torch.rnn_tanh,
        torch.rnn_relu,
        F.scaled_dot_product_attention,
        F.multi_head_attention_forward,
    }
)
