"""FLoRA's round (Wang, Shen, Wang, Zhou, Wang and Li, "FLoRA: Federated Fine-Tuning Large
Language Models with Heterogeneous Low-Rank Adaptations", NeurIPS 2024, §3.2) as parts:
each client trains fresh adapters of its rank on its own copy of the base, uploads them
(`AdapterUpload`); the server stacks every client's factors into one exact update
Σ_k p_k B_k A_k and sends the stack to every client (`StackedMerge`, a server phase, whose
downloads the engine delivers with each client's next task and counts in `bytes_down`
then); at the start of its next training each client merges the stack into its own
merged updates M and draws fresh adapters (`MergeThenTrain`). Every client merges the same
stacks in the same order, so its base equals the server's copy (`flora/<layer>.merged`,
which only the global evaluation reads) without the base ever being sent.

The stack of a round has Σ_k r_k rows (A) and columns (B), the sum of the cohort's ranks,
so what a client downloads grows with the cohort. A client that missed a round would miss
its merge, so every client trains every round (`EveryClient`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from hetfl.algorithms.parts.lora_aggregation import stack_factors
from hetfl.core.client.recipe import ModelCall, TrainContext
from hetfl.core.rng import sibling_generator
from hetfl.core.server.evaluation import Layout
from hetfl.core.server.phase import PhaseResult, Upload
from hetfl.core.spec import GROUP_SEP, IndexMap, Spec
from hetfl.core.state import State
from hetfl.core.types import ClientData, ClientInfo, EvalModel
from hetfl.models.lora import RANK_KEY, LoRAFamily, draw_adapter

#: The group of the server's copy of each layer's merged updates.
SERVER_COPY = "flora"


def server_copy(layer: str) -> str:
    """The global name of the server's copy of `layer`'s merged updates."""
    return f"{SERVER_COPY}{GROUP_SEP}{layer}.merged"


def stack_names(layer: str) -> tuple[str, str]:
    """The download names of `layer`'s stacked A and B."""
    return f"{layer}.stack_A", f"{layer}.stack_B"


class EveryClient:
    """Every client, every round: FLoRA's clients each merge every round's stack into
    their own base, so one that skipped a round would hold another base. Refuses a run
    with fewer clients per round than clients, or a round where some are unreachable."""

    def __init__(self, clients_per_round: int) -> None:
        self.clients_per_round = clients_per_round
        self.cids: tuple[int, ...] = ()

    def setup(self, clients: Sequence[ClientInfo]) -> None:
        if self.clients_per_round < len(clients):
            raise ValueError(
                f"flora: every client merges every round's stacked update into its own base, "
                f"so every client trains every round; train.clients_per_round is "
                f"{self.clients_per_round} for {len(clients)} clients: set it to {len(clients)}"
            )
        self.cids = tuple(sorted(c.cid for c in clients))

    def sample(
        self, round: int, available: Sequence[ClientInfo], rng: torch.Generator
    ) -> list[ClientInfo]:
        missing = sorted(set(self.cids) - {c.cid for c in available})
        if missing:
            raise ValueError(
                f"flora: round {round}: clients {missing[:5]} are unreachable, and a client "
                "that misses a round misses its merge; run flora with every client available "
                "(no availability or system trace that takes clients away)"
            )
        return sorted(available, key=lambda c: c.cid)


@dataclass(frozen=True)
class StackedMerge:
    """The server phase: the round's factors stacked with weights p_k ∝ n_k
    (`stack_factors`), the exact update merged into the server's copy, the stack sent to
    every client of the run (the valid ones' factors; a client that failed still merges
    it, so no base drifts)."""

    family: LoRAFamily
    sampler: EveryClient

    def uploads(self, info: ClientInfo, spec: Spec) -> Mapping[str, tuple[int, ...]]:
        r = int(spec[RANK_KEY])
        out: dict[str, tuple[int, ...]] = {}
        for path, (rows, cols) in self.family.shapes.items():
            out[f"{path}.lora_A"] = (r, cols)
            out[f"{path}.lora_B"] = (rows, r)
        return out

    def run(
        self,
        round: int,
        state: Mapping[str, torch.Tensor],
        uploads: Sequence[Upload],
        generator: torch.Generator,
    ) -> PhaseResult:
        new = dict(state)
        if not uploads:
            return PhaseResult(new)
        weights = [float(u.num_examples) for u in uploads]
        download: State = {}
        for path in self.family.layers:
            factors = [(u.tensors[f"{path}.lora_A"], u.tensors[f"{path}.lora_B"]) for u in uploads]
            a, b = stack_factors(factors, weights)
            name = server_copy(path)
            new[name] = merge(state[name], a, b, self.family.scale)
            stack_a, stack_b = stack_names(path)
            download[stack_a], download[stack_b] = a, b
        return PhaseResult(new, {cid: dict(download) for cid in self.sampler.cids})


def merge(merged: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """M + s B A: the one merge both the server and every client compute."""
    return merged + scale * (b @ a)


@dataclass(frozen=True)
class MergeThenTrain:
    """The forward of FLoRA's clients: before the first step, the stack delivered with the
    task (none in a client's first round) merged into the client's own M, and fresh
    adapters (A drawn from the client's round generator, B zero: FLoRA re-initialises
    them every round); then the model and its cross-entropy."""

    layers: tuple[str, ...]
    scale: float
    vectorises: ClassVar[str] = "merges its download and redraws its adapters at the first step"

    def __call__(
        self, model: ModelCall, x: torch.Tensor, y: torch.Tensor, ctx: TrainContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if ctx.step == 0:
            self._start(ctx)
        outputs = model(x)
        return outputs, F.cross_entropy(outputs, y, reduction="none")

    def _start(self, ctx: TrainContext) -> None:
        draws = sibling_generator(
            ctx.generator, "flora-adapters", ctx.params[f"{self.layers[0]}.lora_A"].device
        )
        with torch.no_grad():
            for path in self.layers:
                stack_a, stack_b = stack_names(path)
                if stack_a in ctx.task.download:
                    own = ctx.buffers[f"{path}.merged"]
                    a = ctx.task.download[stack_a].to(own.device)
                    b = ctx.task.download[stack_b].to(own.device)
                    own.copy_(merge(own, a, b, self.scale))
                draw_adapter(ctx.params[f"{path}.lora_A"], draws)
                ctx.params[f"{path}.lora_B"].zero_()


@dataclass(frozen=True)
class AdapterUpload:
    """What a FLoRA client uploads: its trained factors A_k and B_k of every layer."""

    layers: tuple[str, ...]

    def __call__(self, model: ModelCall, data: ClientData, ctx: TrainContext) -> State:
        out: State = {}
        for path in self.layers:
            for name in (f"{path}.lora_A", f"{path}.lora_B"):
                out[name] = ctx.params[name].detach().clone()
        return out


@dataclass(frozen=True)
class MergedGlobal:
    """The global model FLoRA evaluates: the base with the server's copy of the merged
    updates (adapters zero: the last round's update is merged)."""

    family: LoRAFamily

    def eval_models(self, layout: Layout, state: Mapping[str, torch.Tensor]) -> list[EvalModel]:
        spec = layout.global_spec
        r = int(spec[RANK_KEY])
        tensors: State = {}
        for path, (rows, cols) in self.family.shapes.items():
            tensors[f"{path}.lora_A"] = torch.zeros(r, cols)
            tensors[f"{path}.lora_B"] = torch.zeros(rows, r)
            tensors[f"{path}.merged"] = state[server_copy(path)].detach().clone()
        return [EvalModel(name="global", spec=spec, tensors=tensors)]


class NothingShared:
    """A map transform that shares nothing through index maps: FLoRA's clients download
    the stack (a server phase's download) and upload their factors (declared uploads)."""

    def shared(self, imap: IndexMap, spec: Spec) -> IndexMap:
        return []

    def for_client(
        self,
        imap: IndexMap,
        spec: Spec,
        client: ClientInfo,
        state: Mapping[str, torch.Tensor],
    ) -> IndexMap:
        return []
