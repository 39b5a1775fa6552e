"""MACs of local training, counted from the models themselves, per module of the pipeline.

A client reports which passes it ran (`PassRecord`: spec, kind, batch size, count, width);
the engine prices each distinct (spec, kind, batch, width, input shape) once with
`torch.utils.flop_counter` on a throw-away model and caches it. A training pass is a forward
and a backward pass; MACs are half the counted FLOPs (matrix products and convolutions
only, as is usual). The counter's formula for a convolution's backward prices the weight
gradient of a grouped convolution as if every input channel met every output channel;
`_convolution_backward_flops` divides it by the groups (a depthwise convolution's weight
gradient costs as much as its forward pass, not `channels` times as much).

The throw-away input is float zeros, or, for a model that declares `input_dtype` (token
codes: `hetfl.models.char`), zeros of that dtype. oneDNN's fused CPU kernel for recurrent
layers (`aten.mkldnn_rnn_layer`) has no formula in the counter, so pricing turns oneDNN off
and the LSTM runs as the matrix products it is made of, which are counted; convolutions
are counted above the backend either way.

When the family names its forward pipeline (`ModelFamily.modules(spec)`), the same pass is
also broken down per module, with the bytes of the tensor entering each one: the MACs on
either side of any split point, and the activation a split there sends, at any width.
Families without `modules` are priced whole.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode, conv_flop_count

from hetfl.core.dropout import dropout_masks
from hetfl.core.init import build_model
from hetfl.core.spec import Spec
from hetfl.core.types import ModelFamily, PassRecord

_Key = tuple[Spec, str, int, float | None, tuple[int, ...]]


@dataclass(frozen=True)
class PassCost:
    """One pass priced: `total` MACs, and per module of the family's pipeline (in order)
    its MACs and the bytes of its input for the pass's batch. Backward MACs belong to the
    module whose forward they differentiate. `modules` is empty for families priced whole.
    """

    total: int
    modules: tuple[str, ...] = ()
    module_macs: tuple[int, ...] = ()
    input_bytes: tuple[int, ...] = ()

    def _check_point(self, point: int) -> None:
        if not self.modules:
            raise ValueError("this family does not name its modules (ModelFamily.modules)")
        if not 1 <= point < len(self.modules):
            raise ValueError(
                f"split point {point} is not between two of the {len(self.modules)} modules "
                f"{list(self.modules)} (allowed: 1..{len(self.modules) - 1})"
            )

    def split_macs(self, point: int) -> tuple[int, int]:
        """(client, server) MACs when the first `point` modules run on the client."""
        self._check_point(point)
        return sum(self.module_macs[:point]), sum(self.module_macs[point:])

    def activation_bytes(self, point: int) -> int:
        """Bytes of the activation a split after the first `point` modules sends."""
        self._check_point(point)
        return self.input_bytes[point]


def _input_dtype(model: torch.nn.Module) -> torch.dtype:
    """What the model takes: its declared `input_dtype` (token models), else float32."""
    dtype = getattr(model, "input_dtype", torch.float32)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{type(model).__name__}.input_dtype must be a torch.dtype, got {dtype!r}")
    return dtype


def _decomposed_rnns() -> contextlib.AbstractContextManager[None]:
    """oneDNN off and nothing else changed (None leaves a flag as it is)."""
    return torch.backends.mkldnn.flags(
        enabled=False, deterministic=None, allow_tf32=None, fp32_precision=None
    )


def _transposed(shape: list[int]) -> list[int]:
    return [shape[1], shape[0], *shape[2:]]


def _convolution_backward_flops(
    grad_out_shape: list[int],
    x_shape: list[int],
    w_shape: list[int],
    _bias: Any,
    _stride: Any,
    _padding: Any,
    _dilation: Any,
    transposed: bool,
    _output_padding: Any,
    groups: int,
    output_mask: list[bool],
    out_shape: list[list[int] | None],
    **_: Any,
) -> int:
    """FLOPs of `aten.convolution_backward`, torch's formula (`flop_counter.
    conv_backward_flop`) with the weight gradient divided by `groups`: each of the g groups
    correlates its C_in/g input channels with its C_out/g output gradients, C_in C_out / g
    channel pairs, where torch's formula counts C_in C_out. The input gradient is right as
    torch counts it (its weight shape already holds C_in/g)."""
    flops = 0
    if output_mask[0] and out_shape[0] is not None:
        flops += conv_flop_count(grad_out_shape, w_shape, out_shape[0], not transposed)
    if output_mask[1] and out_shape[1] is not None:
        # The weight gradient as a convolution over the batch: conv(input, grad_out), or
        # conv(grad_out, input) for a transposed convolution, channels and batch swapped.
        a, b = (grad_out_shape, x_shape) if transposed else (x_shape, grad_out_shape)
        whole = conv_flop_count(_transposed(a), _transposed(b), _transposed(out_shape[1]))
        flops += whole // groups
    return flops


def counting_flops() -> FlopCounterMode:
    """torch's FLOP counter with grouped convolutions priced by their groups
    (`_convolution_backward_flops`): every pricing in HetFL counts through it."""
    return FlopCounterMode(
        display=False,
        custom_mapping={torch.ops.aten.convolution_backward: _convolution_backward_flops},
    )


class MacCounter:
    def __init__(self, family: ModelFamily) -> None:
        self.family = family
        self._cache: dict[_Key, PassCost] = {}

    def pass_cost(self, record: PassRecord, input_shape: tuple[int, ...]) -> PassCost:
        """The cost of one pass of `record` (not multiplied by its count)."""
        key = (record.spec, record.kind, record.batch, record.width, tuple(input_shape))
        if key not in self._cache:
            self._cache[key] = self._count(record, tuple(input_shape))
        return self._cache[key]

    def pass_macs(self, record: PassRecord, input_shape: tuple[int, ...]) -> int:
        """MACs of one pass of `record` (not multiplied by its count)."""
        return self.pass_cost(record, input_shape).total

    def price(self, records: Iterable[PassRecord], input_shape: tuple[int, ...]) -> int:
        return sum(self.pass_macs(r, input_shape) * r.count for r in records)

    def _count(self, record: PassRecord, input_shape: tuple[int, ...]) -> PassCost:
        model = build_model(self.family, record.spec)
        names = self._module_names(record.spec)
        # Pipeline modules may be nested (a ResNet's blocks are `stages.1.0`).
        children = dict(model.named_modules())
        unknown = [n for n in names if n not in children]
        if unknown:
            raise ValueError(
                f"modules({record.spec}) names {unknown}, which are not submodules of the "
                f"built model"
            )
        inputs: dict[str, int] = {}

        def capture(name: str) -> Any:
            def hook(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
                if name not in inputs and args and isinstance(args[0], torch.Tensor):
                    inputs[name] = args[0].numel() * args[0].element_size()

            return hook

        handles = [children[n].register_forward_pre_hook(capture(n)) for n in names]
        x = torch.zeros((record.batch, *input_shape), dtype=_input_dtype(model))
        kwargs = {} if record.width is None else {"width": record.width}
        try:
            # Dropout masks change no product's size: any generator prices the pass.
            with (
                _decomposed_rnns(),
                counting_flops() as counter,
                dropout_masks(model, torch.Generator()),
            ):
                if record.kind == "train+input" and not x.is_floating_point():
                    raise ValueError(
                        f"pass kind 'train+input' needs float inputs, but {record.spec} takes "
                        f"{x.dtype} token codes, which have no gradient"
                    )
                if record.kind in ("train", "train+input"):
                    x.requires_grad_(record.kind == "train+input")
                    model.train()
                    # Any scalar of the output back-propagates through the same products as
                    # the loss; a sum also fits models that end in an activation (split
                    # learning's client side), which cross-entropy would not.
                    model(x, **kwargs).sum().backward()
                elif record.kind == "forward":
                    model.eval()
                    with torch.no_grad():
                        model(x, **kwargs)
                else:
                    raise ValueError(
                        f"unknown pass kind {record.kind!r} (allowed: train, train+input, forward)"
                    )
        finally:
            for h in handles:
                h.remove()
        total = counter.get_total_flops() // 2
        if not names:
            return PassCost(total)
        skipped = [n for n in names if n not in inputs]
        if skipped:
            raise ValueError(f"modules {skipped} of {record.spec} did not run in the forward pass")
        per_module = counter.get_flop_counts()
        root = type(model).__name__
        macs = tuple(sum(per_module.get(f"{root}.{n}", {}).values()) // 2 for n in names)
        return PassCost(total, tuple(names), macs, tuple(inputs[n] for n in names))

    def _module_names(self, spec: Spec) -> list[str]:
        modules = getattr(self.family, "modules", None)
        return [] if modules is None else list(modules(spec))
