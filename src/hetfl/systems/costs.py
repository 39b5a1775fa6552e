"""MACs of local training, counted from the models themselves, per module of the pipeline.

A client reports which passes it ran (`PassRecord`: spec, kind, batch size, count, width);
the engine prices each distinct (spec, kind, batch, width, input shape) once, running the
forward pass of a throw-away model under `hetfl.systems.products.MacTally`, and caches it.
The tally prices each matrix product and convolution from its operands' shapes with torch's
FLOP formulas (MACs are half the FLOPs; nothing else is counted, as is usual), and the
backward pass a training pass adds from which operands need a gradient, without running it.
The numbers are those of `torch.utils.flop_counter.FlopCounterMode` over a real forward and
backward pass, with grouped convolutions' weight gradients priced by their groups (the
tests hold the two equal, `tests/flop_oracle.py`); the counter itself is not used in a run
(its first use imports `torch._dynamo`, seconds of a run's first round).

The throw-away input is float zeros, or, for a model that declares `input_dtype` (token
codes: `hetfl.models.char`), zeros of that dtype; the model runs in training mode for a
training pass (gradients on) and in evaluation mode without gradients for a forward pass.

When the family names its forward pipeline (`ModelFamily.modules(spec)`), the same pass is
also broken down per module, with the bytes of the tensor entering each one: the MACs on
either side of any split point, and the activation a split there sends, at any width.
Families without `modules` are priced whole.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from hetfl.core.client.dropout import dropout_masks
from hetfl.core.init import build_model
from hetfl.core.spec import Spec
from hetfl.core.types import ModelFamily, PassRecord
from hetfl.systems.products import MacTally

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
        if record.kind not in ("train", "train+input", "forward"):
            raise ValueError(
                f"unknown pass kind {record.kind!r} (allowed: train, train+input, forward)"
            )
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

        x = torch.zeros((record.batch, *input_shape), dtype=_input_dtype(model))
        if record.kind == "train+input" and not x.is_floating_point():
            raise ValueError(
                f"pass kind 'train+input' needs float inputs, but {record.spec} takes "
                f"{x.dtype} token codes, which have no gradient"
            )
        kwargs = {} if record.width is None else {"width": record.width}
        handles = [children[n].register_forward_pre_hook(capture(n)) for n in names]
        training = record.kind != "forward"
        tally = MacTally(backward=training, modules={n: children[n] for n in names})
        try:
            # Dropout masks change no product's size: any generator prices the pass.
            with tally, dropout_masks(model, torch.Generator()), torch.set_grad_enabled(training):
                x.requires_grad_(record.kind == "train+input")
                model.train(training)(x, **kwargs)
        finally:
            for h in handles:
                h.remove()
        if not names:
            return PassCost(tally.total)
        skipped = [n for n in names if n not in inputs]
        if skipped:
            raise ValueError(f"modules {skipped} of {record.spec} did not run in the forward pass")
        macs = tuple(tally.per_module[n] for n in names)
        return PassCost(tally.total, tuple(names), macs, tuple(inputs[n] for n in names))

    def _module_names(self, spec: Spec) -> list[str]:
        modules = getattr(self.family, "modules", None)
        return [] if modules is None else list(modules(spec))
