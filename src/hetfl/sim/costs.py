"""MACs of local training, counted from the models themselves.

A client reports which passes it ran (`PassRecord`: spec, kind, batch size, count, width);
the engine prices each distinct (spec, kind, batch, width, input shape) once with
`torch.utils.flop_counter` on a throw-away model and caches it. A training pass is a forward
and a backward pass; MACs are half the counted FLOPs (matrix products and convolutions
only, as is usual).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from hetfl.core.init import build_model
from hetfl.core.spec import Spec
from hetfl.core.types import ModelFamily, PassRecord

_Key = tuple[Spec, str, int, float | None, tuple[int, ...]]


class MacCounter:
    def __init__(self, family: ModelFamily) -> None:
        self.family = family
        self._cache: dict[_Key, int] = {}

    def pass_macs(self, record: PassRecord, input_shape: tuple[int, ...]) -> int:
        """MACs of one pass of `record` (not multiplied by its count)."""
        key = (record.spec, record.kind, record.batch, record.width, tuple(input_shape))
        if key not in self._cache:
            self._cache[key] = self._count(record, tuple(input_shape))
        return self._cache[key]

    def price(self, records: Iterable[PassRecord], input_shape: tuple[int, ...]) -> int:
        return sum(self.pass_macs(r, input_shape) * r.count for r in records)

    def _count(self, record: PassRecord, input_shape: tuple[int, ...]) -> int:
        model = build_model(self.family, record.spec)
        x = torch.zeros((record.batch, *input_shape))
        kwargs = {} if record.width is None else {"width": record.width}
        with FlopCounterMode(display=False) as counter:
            if record.kind == "train":
                model.train()
                out = model(x, **kwargs)
                target = torch.zeros(record.batch, dtype=torch.long)
                F.cross_entropy(out, target).backward()
            elif record.kind == "forward":
                model.eval()
                with torch.no_grad():
                    model(x, **kwargs)
            else:
                raise ValueError(f"unknown pass kind {record.kind!r} (allowed: train, forward)")
        return counter.get_total_flops() // 2
