"""`Parts`: what a run is made of, as explicit pieces an engine runs.

The engines (`hetfl.sim`, `hetfl.deploy`) take these pieces, never a config: the face
(`hetfl.assembly.build_parts`) takes the validated config apart into them, so the engines
know nothing of the config's layout (docs/contracts.md, "Layers").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from hetfl.core.client.program import Programs
from hetfl.core.server.strategy import Strategy
from hetfl.core.types import ClientData
from hetfl.engine.progress import Progress
from hetfl.engine.round_settings import RoundSettings
from hetfl.engine.store import StoreSettings


@dataclass
class Parts:
    """What a run is made of, before an engine runs it. `clients` holds every client's
    data on this machine (the Flower server builds it too, and uses only the pooled
    validation splits). `store` bounds the simulator's client store in memory (the Flower
    nodes keep their private state in their own state directory). `attrs` holds what clients
    declare about themselves at set-up (a malicious client's claim to the largest model)."""

    strategy: Strategy
    programs: Programs
    clients: list[ClientData]
    test: tuple[torch.Tensor, torch.Tensor]
    settings: RoundSettings
    info: dict[str, Any]
    progress: Progress
    store: StoreSettings
    attrs: dict[int, dict[str, Any]] = field(default_factory=dict)
