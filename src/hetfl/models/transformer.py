"""A decoder-only Transformer language model as a scalable family: width by heads, depth
by layers.

FedFA (Park and Joe-Wong, "Federated Learning with Flexible Architectures", ECML-PKDD
2024, §5 and Table 3) trains "a language model with a Transformer" on WikiText-2 and
reports average local perplexities; its Table 4 (the architecture) and Table 5 (the width
and depth candidates) are images our copy of the paper lacks, so the layout below is a
HetFL choice, the pre-LN decoder of GPT-2 (Radford et al., "Language Models are
Unsupervised Multitask Learners", 2019, §2.3): a token embedding plus a learned position
embedding, `layers` blocks of

    x = x + Attention(LayerNorm(x))   (causal multi-head self-attention)
    x = x + MLP(LayerNorm(x))         (hidden -> mlp_ratio x hidden -> hidden, GELU)

a final LayerNorm and a linear head to the vocabulary (the classes), read at the last
position: a sample is a context of T tokens and its label the next token, as for LEAF's
character LSTM (`hetfl.models.char`), so the training loop, the losses and the metrics are
those of every classification task and the mean cross-entropy over samples is the mean
per-token cross-entropy whose exponential is the perplexity (`hetfl.engine.perplexity`).

- **Width** (one slot): a ratio p keeps ceil(p x heads) heads of a fixed head size, so the
  hidden size is heads x head size and the MLP's hidden size is ceil(p x mlp_ratio x
  hidden): the heads, the hidden size and the MLP scale together, as HeteroFL (Diao et al.,
  ICLR 2021, §3) scales every hidden layer of its Transformer. Every tensor of a sub-model
  is a leading slice of the global one (the query, key and value projections are separate
  so that leading rows are whole heads), and a ratio must keep whole heads (p x heads an
  integer).
- **Depth**: `blocks` = (layers,), one section; a sub-model keeps the first blocks. Every
  block adds its input to its output at one width, so every block is an identity block
  and FedFA's grafting (Algorithm 2: the section's last block fills its missing blocks,
  §4.2 and App. 0.B, on residual blocks that "share the same sequence of filter numbers")
  applies to the whole stack: a shallower client's last layer is grafted into the deeper
  layers it lacks, as FedFA's Transformer runs need for a complete aggregation.
- **Normalisation**: LayerNorm everywhere; it keeps no running statistics, so the `bn`
  kinds that differ only in those (`batch`, `static`, `per-width`) are all LayerNorm,
  `per-capacity` keeps its affine tensors per capacity (the index map), `none` drops it.
  HeteroFL's scaler, when on, divides the input of every LayerNorm by p in training.
- No dropout (CPU-sized runs, deterministic training).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from hetfl.core.spec import Spec
from hetfl.models.norms import NormFactory
from hetfl.models.scalable import ARCHITECTURES, Architecture, SpecError
from hetfl.models.slim import channels


@dataclass(frozen=True)
class Size:
    """A preset: heads and head size (hidden = heads x head_size), the MLP ratio and the
    number of layers of the global model at width 1."""

    heads: int
    head_size: int
    mlp_ratio: int
    layers: int

    @property
    def hidden(self) -> int:
        return self.heads * self.head_size


#: `transformer`: 8 heads of 32 (hidden 256), MLP 2 x 256, 4 layers; `transformer-tiny`,
#: for CPU tests and runs here: 4 heads of 8 (hidden 32), MLP 2 x 32, 2 layers.
SIZES = {
    "transformer": Size(heads=8, head_size=32, mlp_ratio=2, layers=4),
    "transformer-tiny": Size(heads=4, head_size=8, mlp_ratio=2, layers=2),
}


class FeatureLinear(nn.Linear):
    """A linear layer on the last (feature) axis that uses `weight[:out, :in]`, the input's
    own feature count `in` (`hetfl.models.slim.SlimLinear` reads channels from axis 1, which
    is the position axis of a (B, T, features) input); `base_out=None` keeps the output."""

    def __init__(self, in_features: int, out_features: int, *, base_out: int | None) -> None:
        super().__init__(in_features, out_features)
        self.base_out = base_out

    def forward(self, x: torch.Tensor, width: float | None = None) -> torch.Tensor:
        out = self.out_features
        if width is not None and self.base_out is not None:
            out = channels(width, self.base_out)
        cin = int(x.shape[-1])
        if out > self.out_features or cin > self.in_features:
            raise ValueError(
                f"FeatureLinear: width {width} needs {out} x {cin} weights, the layer holds "
                f"{self.out_features} x {self.in_features}; run a model at most at its width"
            )
        return F.linear(x, self.weight[:out, :cin], self.bias[:out])


class SlimLayerNorm(nn.LayerNorm):
    """LayerNorm over the input's own (leading) features, with the leading part of the
    affine tensors; HeteroFL's scaler (divide by the width ratio, training only) first."""

    def __init__(self, base: int, ratio: float, scaler: bool) -> None:
        super().__init__(channels(ratio, base))
        self.ratio, self.scaler = ratio, scaler

    def forward(self, x: torch.Tensor, width: float | None = None) -> torch.Tensor:  # type: ignore[override]
        if self.scaler and self.training:
            x = x / (self.ratio if width is None else width)
        c = int(x.shape[-1])
        return F.layer_norm(x, (c,), self.weight[:c], self.bias[:c], self.eps)


class NoLayerNorm(nn.Identity):
    """`bn: none`: no normalisation (the scaler still acts, as `hetfl.models.slim.NoNorm`)."""

    def __init__(self, base: int, ratio: float, scaler: bool) -> None:
        super().__init__()
        self.ratio, self.scaler = ratio, scaler

    def forward(self, x: torch.Tensor, width: float | None = None) -> torch.Tensor:
        if self.scaler and self.training:
            return x / (self.ratio if width is None else width)
        return x


#: The norm layer of each `bn` kind: a Transformer normalises each token over its features
#: (LayerNorm), whatever kind of batch statistics a method asks for, since a token has none
#: to keep; `none` drops the normalisation (the scaler still acts).
LAYER_NORMS: dict[str, type[SlimLayerNorm] | type[NoLayerNorm]] = {"none": NoLayerNorm}


class SlimEmbedding(nn.Embedding):
    """An embedding that uses `weight[:, :hidden]`: the leading features of each row,
    N(0, 1) from a given generator as `nn.Embedding`'s default."""

    def __init__(self, rows: int, base: int, ratio: float) -> None:
        super().__init__(rows, channels(ratio, base))
        self.base = base

    def forward(self, x: torch.Tensor, width: float | None = None) -> torch.Tensor:  # type: ignore[override]
        c = self.embedding_dim if width is None else channels(width, self.base)
        return F.embedding(x, self.weight[:, :c])

    def reset_parameters_with(self, generator: torch.Generator) -> None:
        self.weight.normal_(generator=generator)


class Embed(nn.Module):
    """Token plus learned position embedding: the pipeline's first module."""

    def __init__(self, vocabulary: int, context: int, base: int, ratio: float) -> None:
        super().__init__()
        self.tokens = SlimEmbedding(vocabulary, base, ratio)
        self.positions = SlimEmbedding(context, base, ratio)

    def forward(self, x: torch.Tensor, width: float | None = None) -> torch.Tensor:
        place = torch.arange(x.shape[1], device=x.device)
        return self.tokens(x, width) + self.positions(place, width)  # (B, T, hidden)


class CausalSelfAttention(nn.Module):
    """Multi-head attention of each position over itself and the earlier ones; heads of
    `head_size` features, as many as the query projection's output holds."""

    def __init__(self, size: Size, ratio: float) -> None:
        super().__init__()
        hidden = channels(ratio, size.heads) * size.head_size
        self.head_size = size.head_size
        self.query, self.key, self.value, self.out = (
            FeatureLinear(hidden, hidden, base_out=size.hidden) for _ in range(4)
        )

    def forward(self, x: torch.Tensor, width: float | None = None) -> torch.Tensor:
        b, t, _ = x.shape

        def heads(h: torch.Tensor) -> torch.Tensor:  # (B, T, H hd) -> (B, H, T, hd)
            return h.view(b, t, -1, self.head_size).transpose(1, 2)

        q, k, v = (heads(layer(x, width)) for layer in (self.query, self.key, self.value))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_size)  # (B, H, T, T)
        future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        mixed = (weights @ v).transpose(1, 2).reshape(b, t, -1)  # (B, T, H hd)
        return self.out(mixed, width)


class DecoderBlock(nn.Module):
    """A pre-LN decoder block; an identity block (its output is its input plus a branch,
    at one width), so FedFA's grafting may copy it into missing layers."""

    identity = True

    def __init__(self, size: Size, ratio: float, norm: type[SlimLayerNorm | NoLayerNorm],
                 scaler: bool) -> None:  # fmt: skip
        super().__init__()
        hidden = channels(ratio, size.heads) * size.head_size
        mlp_base = size.mlp_ratio * size.hidden
        self.norm1 = norm(size.hidden, ratio, scaler)
        self.attention = CausalSelfAttention(size, ratio)
        self.norm2 = norm(size.hidden, ratio, scaler)
        self.up = FeatureLinear(hidden, channels(ratio, mlp_base), base_out=mlp_base)
        self.down = FeatureLinear(channels(ratio, mlp_base), hidden, base_out=size.hidden)

    def forward(self, x: torch.Tensor, width: float | None = None) -> torch.Tensor:
        x = x + self.attention(self.norm1(x, width), width)
        return x + self.down(F.gelu(self.up(self.norm2(x, width), width)), width)


class Transformer(nn.Module):
    """The network of the module docstring for a checked spec of a `SIZES` preset:
    (B, T) int64 tokens in, (B, vocabulary) logits of the next token out."""

    input_dtype = torch.int64

    def __init__(self, spec: Spec, size: Size) -> None:
        super().__init__()
        ratio = spec["widths"][0]
        context = spec["input_shape"][0]
        norm = LAYER_NORMS.get(spec["bn"], SlimLayerNorm)
        self.embed = Embed(spec["num_classes"], context, size.hidden, ratio)
        blocks = [DecoderBlock(size, ratio, norm, spec["scaler"]) for _ in range(spec["blocks"][0])]
        self.stages = nn.ModuleList([nn.ModuleList(blocks)])
        self.norm = norm(size.hidden, ratio, spec["scaler"])
        hidden = self.embed.tokens.embedding_dim
        self.head = FeatureLinear(hidden, spec["num_classes"], base_out=None)
        self.pipeline = ["embed", *(f"stages.0.{b}" for b in range(len(blocks))), "norm", "head"]

    def forward(self, x: torch.Tensor, width: float | None = None) -> torch.Tensor:
        h = self.embed(x, width)  # (B, T, hidden)
        for block in cast(nn.ModuleList, self.stages[0]):
            h = block(h, width)
        return self.head(self.norm(h[:, -1], width), width)  # (B, vocabulary)


@dataclass(frozen=True)
class Preset:
    """Builds a preset's model from a checked spec. The normalisation factory the scalable
    machinery passes makes image norms; the Transformer picks its LayerNorm from `bn`."""

    size: Size

    def __call__(self, spec: Spec, norm: NormFactory) -> nn.Module:
        return Transformer(spec, self.size)


def check_heads(size: Size) -> Callable[[Spec], None]:
    """The preset's own checks: a width keeps whole heads."""

    def check(spec: Spec) -> None:
        p = spec["widths"][0]
        if not math.isclose(p * size.heads, round(p * size.heads)):
            raise SpecError(
                f"{spec['family']}: width {p:g} keeps {p * size.heads:g} of {size.heads} heads; "
                f"a width must keep whole heads (a multiple of 1/{size.heads})"
            )

    return check


for _name, _size in SIZES.items():
    ARCHITECTURES.register(
        _name,
        Architecture(
            Preset(_size),
            (_size.hidden,),
            1,
            (_size.layers,),
            lambda s: 1,
            f"Transformer LM, {_size.heads} heads x {_size.head_size}, MLP {_size.mlp_ratio}x, "
            f"{_size.layers} layers: width by heads, depth by layers (FedFA Table 3)",
            check=check_heads(_size),
            input_rank=1,
        ),
    )
