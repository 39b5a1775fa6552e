"""Low-rank adapters on a frozen base: any model family's linear layers fine-tuned through
LoRA factors, with a client's rank as a width on the adapters' inner axis.

LoRA (Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", ICLR 2022, §4.1)
keeps a pretrained weight W0 (out x in) frozen and trains a product B A, A (r x in) and
B (out x r), so a layer computes `W0 x + s B A x`. A is drawn as the authors' code draws it
(`nn.init.kaiming_uniform_(A, a=sqrt(5))`, PyTorch's Linear default) and B is zero, so
training starts from the base model.

**The scale.** §4.1 sets s = α / r. With clients of different ranks, HetFL uses one scale
for every client, s = α / R with R the largest rank of the run (LoRA's rule at the global
rank): a rank-r client's factors are then the leading r rows of A and columns of B of a
rank-R adapter with the same update, so zero-padding (HetLoRA: Cho et al., "Heterogeneous
LoRA for Federated Fine-tuning of On-Device Foundation Models", EMNLP 2024, §3) adds the
update the client trained, and the rank-r prefix of an SVD of the global update is its
best rank-r approximation (FlexLoRA: Bai et al., "Federated Fine-tuning of Large Language
Models under Heterogeneous Tasks and Client Resources", NeurIPS 2024, §3). A rank-dependent
scale (α / r, or rsLoRA's α / √r) would make the server rescale every factor it sends and
receives per rank; with one rank, s = α / r exactly as in LoRA.

**The family.** `LoRAFamily` wraps any family: its spec is the base family's global spec
with `lora_rank`; its model is the base model with every `nn.Linear` replaced by a
`LoRALinear` of that rank; its index map names only the adapters, as leading slices of
the rank-R global adapters (`A[:r, :]`, `B[:, :r]`), so HeteroFL's nested-slice
extraction and aggregation (`hetfl.core.state`) serve the rank axis. Every base tensor
(linear weights, embeddings, norms) is a non-persistent buffer: frozen, never sent, never
in a client's private store, the same in every client — the pretrained state given
(`load_base_state`) or, without one, the base family's initialisation from seed 0. A base
with BatchNorm running statistics is refused: a frozen base would still update them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from hetfl.core.init import build_model, initialize
from hetfl.core.spec import IndexMap, MapEntry, Spec, prefix_index
from hetfl.core.state import State
from hetfl.core.types import ModelFamily

#: The spec key of a client's adapter rank.
RANK_KEY = "lora_rank"
#: The seed of the base model's initialisation when no pretrained state is given.
BASE_SEED = 0


class LoRALinear(nn.Module):
    """`(W0 + M) x + b + scale * B (A x)` on the last axis: the frozen `weight` W0 and
    `bias` are buffers (not in the state dict); `lora_A` (rank x in) and `lora_B`
    (out x rank) train. With `mergeable`, M (`merged`, out x in, zero at first) is a
    persistent buffer, a client's own merged updates (FLoRA); without, M is absent."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        rank: int,
        scale: float,
        *,
        mergeable: bool = False,
    ) -> None:
        super().__init__()
        out_features, in_features = weight.shape
        self.weight: torch.Tensor
        self.bias: torch.Tensor | None
        self.register_buffer("weight", weight.detach().clone(), persistent=False)
        self.register_buffer(
            "bias", None if bias is None else bias.detach().clone(), persistent=False
        )
        self.merged: torch.Tensor | None
        self.register_buffer("merged", torch.zeros_like(weight) if mergeable else None)
        self.lora_A = nn.Parameter(torch.zeros(rank, in_features))
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank))
        self.scale = scale

    def reset_parameters_with(self, generator: torch.Generator) -> None:
        """A as PyTorch's Linear default (the LoRA code's kaiming_uniform, a = sqrt(5)):
        U(±1/sqrt(in)); B zero, so the adapted model starts as the base; M zero."""
        draw_adapter(self.lora_A, generator)
        self.lora_B.zero_()
        if self.merged is not None:
            self.merged.zero_()

    def forward(self, x: torch.Tensor, width: float | None = None) -> torch.Tensor:
        if width is not None and width != 1.0:
            raise ValueError(
                f"a LoRA layer runs its base at full width; it was asked for width {width}"
            )
        weight = self.weight if self.merged is None else self.weight + self.merged
        base = F.linear(x, weight, self.bias)
        return base + self.scale * F.linear(F.linear(x, self.lora_A), self.lora_B)


def draw_adapter(a: torch.Tensor, generator: torch.Generator) -> None:
    """A fresh A (rank x in), in place: U(±1/sqrt(in)), PyTorch's Linear default."""
    bound = 1.0 / math.sqrt(a.shape[1])
    a.uniform_(-bound, bound, generator=generator)


def _freeze_into_buffers(module: nn.Module) -> None:
    """Every parameter of `module` (recursively) becomes a non-persistent buffer of the same
    name and value; the adapters of `LoRALinear` layers stay parameters."""
    for sub in module.modules():
        if isinstance(sub, LoRALinear):
            continue
        for name, param in list(sub.named_parameters(recurse=False)):
            delattr(sub, name)
            sub.register_buffer(name, param.detach(), persistent=False)


def _refuse_running_statistics(model: nn.Module) -> None:
    """A frozen base cannot keep buffers that training updates (BatchNorm's statistics)."""
    params = {n for n, _ in model.named_parameters()}
    kept = [n for n in model.state_dict() if n not in params]
    if kept:
        raise ValueError(
            f"LoRA freezes the base model, but it keeps buffers {kept[:3]} (BatchNorm running "
            "statistics) that training would still update; use a base without them "
            "(model.bn: none, or a Transformer)"
        )


def lora_layers(model: nn.Module) -> list[str]:
    """The module paths of `model`'s linear layers, in registration order."""
    return [path for path, sub in model.named_modules() if isinstance(sub, nn.Linear)]


def load_base_state(path: str | Path) -> State:
    """A base model's state dict saved with `torch.save(model.state_dict(), path)`."""
    found = Path(path)
    if not found.is_file():
        raise FileNotFoundError(
            f"pretrained: no file at {found}; give the path of a base model's state dict "
            "(torch.save(model.state_dict(), path), e.g. from hetfl.models.lora_pretrain)"
        )
    loaded = torch.load(found, map_location="cpu", weights_only=True)
    if not isinstance(loaded, Mapping) or not all(
        isinstance(v, torch.Tensor) for v in loaded.values()
    ):
        raise ValueError(f"pretrained: {found} does not hold a state dict of tensors")
    return {str(k): v for k, v in loaded.items()}


class LoRAFamily:
    """`base`'s global model, frozen, with rank-`lora_rank` adapters on its linear layers
    (module docstring). `max_rank` is R, the global adapters' rank; `alpha` the scale's α
    (s = α / R for every client); `pretrained` the base's state dict (None: seed 0);
    `mergeable` gives every adapted layer a client's own merged updates (FLoRA)."""

    def __init__(
        self,
        base: ModelFamily,
        *,
        max_rank: int,
        alpha: float,
        pretrained: Mapping[str, torch.Tensor] | None = None,
        mergeable: bool = False,
    ) -> None:
        if max_rank < 1:
            raise ValueError(f"the LoRA rank must be at least 1, got {max_rank}")
        if not (math.isfinite(alpha) and alpha > 0):
            raise ValueError(f"the LoRA alpha must be a positive number, got {alpha}")
        self.base, self.max_rank, self.alpha = base, max_rank, float(alpha)
        self.mergeable = mergeable
        self.scale = self.alpha / max_rank
        self.base_spec = base.global_spec([])
        model = build_model(base, self.base_spec)
        if pretrained is None:
            initialize(model, torch.Generator().manual_seed(BASE_SEED))
        else:
            _load_checked(model, pretrained)
        _refuse_running_statistics(model)
        self._base_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.layers = lora_layers(model)
        if not self.layers:
            raise ValueError(f"LoRA needs linear layers; {self.base_spec} has none")
        #: (out, in) of every adapted layer, by module path.
        self.shapes: dict[str, tuple[int, int]] = {}
        for path in self.layers:
            weight = cast(torch.Tensor, model.get_submodule(path).weight)
            out_features, in_features = weight.shape
            self.shapes[path] = (int(out_features), int(in_features))

    def spec_at(self, rank: int) -> Spec:
        """The spec of a rank-`rank` client."""
        if not 1 <= rank <= self.max_rank:
            raise ValueError(f"LoRA rank {rank} is not in 1..{self.max_rank} (the global rank)")
        return self.base_spec.replace(**{RANK_KEY: int(rank)})

    def build(self, spec: Spec) -> nn.Module:
        rank = int(spec[RANK_KEY])
        model = self.base.build(Spec({k: v for k, v in spec.items() if k != RANK_KEY}))
        model.load_state_dict(self._base_state, strict=True)
        for path in self.layers:
            parent_path, _, name = path.rpartition(".")
            parent = model.get_submodule(parent_path)
            linear = getattr(parent, name)
            adapted = LoRALinear(
                linear.weight, linear.bias, rank, self.scale, mergeable=self.mergeable
            )
            setattr(parent, name, adapted)
        _freeze_into_buffers(model)
        return model

    def index_map(self, spec: Spec) -> IndexMap:
        """Rank r's adapters as the leading r rows of each global A and columns of each B."""
        r = int(spec[RANK_KEY])
        out: IndexMap = []
        for path in self.layers:
            out.append(MapEntry(f"{path}.lora_A", f"{path}.lora_A", prefix_index(r)))
            out.append(MapEntry(f"{path}.lora_B", f"{path}.lora_B", prefix_index(None, r)))
        return out

    def global_spec(self, specs: list[Spec]) -> Spec:
        return self.spec_at(self.max_rank)

    def modules(self, spec: Spec) -> list[str]:
        return self.base.modules(self.base_spec)

    def adapter_pairs(self) -> list[tuple[str, str]]:
        """(A's name, B's name) of every adapted layer, in the model's order."""
        return [(f"{p}.lora_A", f"{p}.lora_B") for p in self.layers]


def _load_checked(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Load a pretrained base, with an error that names what does not fit."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(set(expected) - set(state))
    unknown = sorted(set(state) - set(expected))
    misfit = sorted(k for k in set(expected) & set(state) if tuple(state[k].shape) != expected[k])
    if missing or unknown or misfit:
        raise ValueError(
            "pretrained: the state does not fit the configured base model "
            f"(missing {missing[:3]}, unexpected {unknown[:3]}, wrong shapes {misfit[:3]}); "
            "pretrain the same model.name and model options at width 1"
        )
    model.load_state_dict(dict(state), strict=True)
