"""The cost model's MACs (`MacCounter`, priced from shapes by `MacTally`) against torch's
own counter (`flop_oracle`: `FlopCounterMode` over a real forward and backward pass), on a
named set: every registered family's default spec, every width level of HeteroFL's
default levels, FjORD's widths, `train`, `train+input` and `forward` passes, whole and
per module of the pipeline (MACs, split MACs and input bytes). All must agree exactly.
And a run that prices passes never imports `torch._dynamo`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flop_oracle import oracle_cost
from hetfl.algorithms.fjord import FjORDOptions
from hetfl.algorithms.heterofl import HeteroFLOptions
from hetfl.algorithms.parts.width_norms import level_norm
from hetfl.algorithms.parts.widths import full_width_base
from hetfl.core.spec import Spec
from hetfl.core.types import ModelFamily, PassRecord
from hetfl.models import model_names
from hetfl.models.factory import make_family
from hetfl.systems.costs import MacCounter, PassCost

#: Small inputs each model accepts (the token models take sequences).
SHAPES = {
    "vgg11": (3, 32, 32),
    "lenet5": (1, 16, 16),
    "stage-cnn": (3, 16, 16),
    "ssd-stage-cnn": (3, 64, 64),  # its default 6 stages need sides of at least 64
    "char-lstm": (6,),
    "composed-rnn": (6,),
    "transformer": (6,),
    "transformer-tiny": (6,),
}
SMALL = (3, 8, 8)
TOKENS = ("char-lstm", "composed-rnn", "transformer", "transformer-tiny")
#: Families whose head reads several modules' outputs (SSD's heads on several stages).
MULTI_INPUT_HEADS = ("ssd-stage-cnn",)


def _family(name: str) -> ModelFamily:
    return make_family(name, SHAPES.get(name, SMALL), 12 if name in TOKENS else 10)


def _agree(family: ModelFamily, record: PassRecord, shape: tuple[int, ...]) -> PassCost:
    cost = MacCounter(family).pass_cost(record, shape)
    expected = oracle_cost(family, record, shape)
    assert cost == expected
    for point in range(1, len(cost.modules)):
        assert cost.split_macs(point) == expected.split_macs(point)
    return cost


@pytest.mark.parametrize("name", model_names())
def test_every_family_default_spec_agrees_with_torch_counter(name: str) -> None:
    family = _family(name)
    spec, shape = family.global_spec([]), SHAPES.get(name, SMALL)
    kinds = ("train", "forward") if name in TOKENS else ("train", "train+input", "forward")
    for kind in kinds:
        record = PassRecord(spec, kind, 2, 1)
        if name in MULTI_INPUT_HEADS and kind != "forward":
            # The oracle charges a backward product to every module running when it is
            # called; the detector's head reads two stages' maps, so the last stage's
            # backward is charged to it as well (the oracle's per-module sum exceeds its
            # own total by that stage's backward). The totals and the forward split are
            # compared; per module, ours is the hand count (forward, weight and input
            # gradients of the module's own convolutions).
            assert MacCounter(family).pass_cost(record, shape).total == (
                oracle_cost(family, record, shape).total
            )
            continue
        cost = _agree(family, record, shape)
        assert cost.total > 0


def test_heterofl_levels_and_fjord_widths_agree_with_torch_counter() -> None:
    family, shape = _family("stage-cnn"), SHAPES["stage-cnn"]
    hetero = HeteroFLOptions()
    levels = level_norm(
        full_width_base(family, "heterofl"), hetero.norm, hetero.levels, scaler=hetero.scaler
    )
    totals = [
        _agree(family, PassRecord(levels.train(r), "train", 2, 1), shape).total
        for r in hetero.levels
    ]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == len(totals)
    fjord = FjORDOptions()
    tiers = level_norm(full_width_base(family, "fjord"), fjord.norm, fjord.levels, scaler=False)
    widest = tiers.train(max(fjord.levels))
    for p in fjord.levels:
        for kind in ("train", "train+input"):
            _agree(family, PassRecord(widest, kind, 2, 1, width=p), shape)


class _Convs(nn.Module):
    """A 1-d convolution, then a grouped 3-d one: (B=2, 2, 8) -> (2, 4, 1, 1, 2)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(2, 4, 3)
        self.conv3 = nn.Conv3d(4, 4, (1, 2, 2), groups=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv3(self.conv1(x).reshape(2, 4, 1, 2, 3))


class _Zoo(nn.Module):
    """Every product `MacTally` prices beyond the registered families' own: 1-d and
    grouped 3-d convolutions, a broadcast batched matmul, `mm`, `@` and `Tensor.mm`, a
    bidirectional sequence-first LSTM from a learnt initial state, an unbatched
    convolution and linear map."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = _Convs()
        self.mix = nn.Parameter(torch.ones(3, 6, 5))
        self.square = nn.Parameter(torch.ones(5, 5))
        self.lstm = nn.LSTM(5, 3, num_layers=2, bidirectional=True)
        self.h0 = nn.Parameter(torch.zeros(4, 2, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B=2, 2, 8)
        y = self.convs(x).reshape(2, 1, 1, 8)[..., :6]  # (2, 1, 1, 6)
        z = torch.matmul(y, self.mix)  # (2, 3, 1, 5)
        z = torch.mm(z.reshape(6, 5), self.square)  # (6, 5)
        z = (z @ self.square).mm(self.square)
        seq = z.reshape(3, 2, 5)  # (T=3, B=2, 5)
        out, _ = self.lstm(seq, (self.h0, self.h0 + 1))
        unbatched = torch.conv1d(x[0], self.convs.conv1.weight)  # (2, 8) -> (4, 6)
        return out + unbatched.sum() + F.linear(x[0, 0, :5], self.square[:1]).sum()


class _ZooFamily:
    """Watched modules that nest (`convs` holds `convs.conv1`): each is charged the
    products it runs, its submodules' included."""

    def build(self, spec: Spec) -> nn.Module:
        return _Zoo()

    def modules(self, spec: Spec) -> list[str]:
        return ["convs", "convs.conv1", "lstm"]


def test_every_priced_product_agrees_with_torch_counter() -> None:
    for kind in ("train", "train+input", "forward"):
        cost = _agree(_ZooFamily(), PassRecord(Spec(), kind, 2, 1), (2, 8))  # type: ignore[arg-type]
        assert cost.total > 0


class _Batched(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.bmm(x, x)


class _BatchedFamily:
    def build(self, spec: Spec) -> nn.Module:
        return _Batched()


def test_products_it_does_not_price_are_refused() -> None:
    with pytest.raises(NotImplementedError, match="bmm is a product the cost model does not"):
        MacCounter(_BatchedFamily()).pass_cost(PassRecord(Spec(), "train", 2, 1), (3, 3))  # type: ignore[arg-type]


_NO_DYNAMO = """
import sys
from hetfl.core.types import PassRecord
from hetfl.models.factory import make_family
from hetfl.systems.costs import MacCounter
from hetfl.systems.split_pricing import SplitPricer
for name, shape in (("small-cnn", (3, 8, 8)), ("char-lstm", (4,))):
    family = make_family(name, shape, 10)
    MacCounter(family).pass_cost(PassRecord(family.global_spec([]), "train", 2, 1), shape)
split = make_family("resnet-cifar", (3, 8, 8), 10)
SplitPricer(split, (3, 8, 8), 1e9).cut_cost(
    split.side_spec("client", 1, aux=True), split.side_spec("server", 1), 2
)
print("torch._dynamo" in sys.modules)
"""


def test_pricing_imports_no_dynamo() -> None:
    src = Path(__file__).resolve().parents[1] / "src"
    done = subprocess.run(
        [sys.executable, "-c", _NO_DYNAMO],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(src)},
    )
    assert done.stdout.strip() == "False"
