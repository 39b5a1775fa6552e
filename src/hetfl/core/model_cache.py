"""One model per spec of a family, built once and reused: a run builds each sub-model once,
however many clients train it."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hetfl.core.init import build_model
from hetfl.core.spec import Spec
from hetfl.core.types import ModelFamily


class ModelCache:
    """One model per spec of a family, built on first use on `device`.

    The training cache's models are templates: local training calls them on each client's
    own tensors (`torch.func.functional_call`) and never loads a client's tensors into
    them. An evaluation cache (the engine's own) loads the evaluated tensors in place."""

    def __init__(self, family: ModelFamily, device: torch.device | str = "cpu") -> None:
        self.family = family
        self.device = torch.device(device)
        self._models: dict[Spec, nn.Module] = {}

    def model_for(self, spec: Spec) -> nn.Module:
        model = self._models.get(spec)
        if model is None:
            model = build_model(self.family, spec).to(self.device)
            self._models[spec] = model
        return model

    def __len__(self) -> int:
        return len(self._models)

    def __getstate__(self) -> dict[str, Any]:
        """A cache pickles empty: a process that receives it (a worker) builds its own."""
        return {**self.__dict__, "_models": {}}
