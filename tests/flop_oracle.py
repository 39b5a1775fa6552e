"""The tests' oracle for `hetfl.systems.costs.MacCounter`: the same passes priced by
torch's own counter, `torch.utils.flop_counter.FlopCounterMode`, on real zeros with a real
backward pass (HetFL priced runs this way before `hetfl.systems.products.MacTally`; its
first use imports `torch._dynamo`, which a run no longer pays for).

A training pass is a forward and a backward pass; MACs are half the counted FLOPs. The
counter's formula for a convolution's backward prices the weight gradient of a grouped
convolution as if every input channel met every output channel;
`_convolution_backward_flops` divides it by the groups, as HetFL's cost model does.
oneDNN's fused CPU kernel for recurrent layers (`aten.mkldnn_rnn_layer`) has no formula in
the counter, so pricing turns oneDNN off and the LSTM runs as the matrix products it is
made of. Per module, the counter charges a product to every module running when it is
called (in the backward pass, the modules whose forward it differentiates).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode, conv_flop_count

from hetfl.core.client.dropout import dropout_masks
from hetfl.core.init import build_model
from hetfl.core.types import ModelFamily, PassRecord
from hetfl.systems.costs import PassCost


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
    """FLOPs of `aten.convolution_backward`: torch's formula (`flop_counter.
    conv_backward_flop`) with the weight gradient divided by `groups`."""
    flops = 0
    if output_mask[0] and out_shape[0] is not None:
        flops += conv_flop_count(grad_out_shape, w_shape, out_shape[0], not transposed)
    if output_mask[1] and out_shape[1] is not None:
        a, b = (grad_out_shape, x_shape) if transposed else (x_shape, grad_out_shape)
        whole = conv_flop_count(_transposed(a), _transposed(b), _transposed(out_shape[1]))
        flops += whole // groups
    return flops


def counting_flops() -> FlopCounterMode:
    """torch's FLOP counter with grouped convolutions priced by their groups."""
    return FlopCounterMode(
        display=False,
        custom_mapping={torch.ops.aten.convolution_backward: _convolution_backward_flops},
    )


def oracle_cost(family: ModelFamily, record: PassRecord, input_shape: tuple[int, ...]) -> PassCost:
    """One pass of `record` priced by `FlopCounterMode`, whole and per pipeline module
    (`family.modules`, with each module's input bytes), as `MacCounter.pass_cost` gives it."""
    model = build_model(family, record.spec)
    modules = getattr(family, "modules", None)
    names = [] if modules is None else list(modules(record.spec))
    children = dict(model.named_modules())
    inputs: dict[str, int] = {}

    def capture(name: str) -> Any:
        def hook(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
            if name not in inputs and args and isinstance(args[0], torch.Tensor):
                inputs[name] = args[0].numel() * args[0].element_size()

        return hook

    handles = [children[n].register_forward_pre_hook(capture(n)) for n in names]
    x = torch.zeros(
        (record.batch, *input_shape), dtype=getattr(model, "input_dtype", torch.float32)
    )
    kwargs = {} if record.width is None else {"width": record.width}
    try:
        with (
            _decomposed_rnns(),
            counting_flops() as counter,
            dropout_masks(model, torch.Generator()),
        ):
            if record.kind == "forward":
                model.eval()
                with torch.no_grad():
                    model(x, **kwargs)
            else:
                x.requires_grad_(record.kind == "train+input")
                model.train()
                model(x, **kwargs).sum().backward()
    finally:
        for h in handles:
            h.remove()
    total = counter.get_total_flops() // 2
    if not names:
        return PassCost(total)
    per_module = counter.get_flop_counts()
    root = type(model).__name__
    macs = tuple(sum(per_module.get(f"{root}.{n}", {}).values()) // 2 for n in names)
    return PassCost(total, tuple(names), macs, tuple(inputs[n] for n in names))
