"""Model families: a module per spec and the map from its tensors into the global state.

A *plain* family has one architecture: every client trains the whole model, so its index
map is the identity over the model's tensors. Scalable families (width- and depth-sliced)
implement the same three methods with real maps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import nn

from hetfl.core.init import build_model
from hetfl.core.registry import Registry
from hetfl.core.spec import IndexMap, Spec, full_map


@dataclass(frozen=True)
class ModelBuilder:
    """How to build one registered model for a dataset's input shape and class count.

    `make(input_shape, num_classes)` returns the module; `accepts(input_shape)` says
    whether the architecture fits that input (checked at config time, with `requirement`
    as the message).
    """

    make: Callable[[tuple[int, ...], int], nn.Module]
    accepts: Callable[[tuple[int, ...]], bool]
    requirement: str


MODELS: Registry[ModelBuilder] = Registry("model")


class PlainFamily:
    """One fixed architecture: every spec is the same model, every map the identity."""

    def __init__(self, model: str, input_shape: Sequence[int], num_classes: int) -> None:
        builder = MODELS.get(model)
        shape = tuple(int(s) for s in input_shape)
        if not builder.accepts(shape):
            raise ValueError(
                f"model {model!r} does not accept inputs of shape {shape}: {builder.requirement}"
            )
        self._builder = builder
        self._spec = Spec(model=model, input_shape=shape, num_classes=int(num_classes))
        self._names: list[str] | None = None
        self._modules: list[str] | None = None

    def build(self, spec: Spec) -> nn.Module:
        return self._builder.make(tuple(spec["input_shape"]), int(spec["num_classes"]))

    def index_map(self, spec: Spec) -> IndexMap:
        if self._names is None:
            self._names = list(self.build(spec).state_dict())
        return full_map(self._names)

    def global_spec(self, specs: list[Spec]) -> Spec:
        return self._spec

    def modules(self, spec: Spec) -> list[str]:
        """The model's top-level children in order: its forward pipeline, where split
        points lie (every plain model runs its children one after the other)."""
        if self._modules is None:
            self._modules = [name for name, _ in build_model(self, spec).named_children()]
        return list(self._modules)
