"""The one trainable step (`hetfl.core.client.trainable`): a `Trainable` stepped on a loss
equals `torch.optim` training of the same module (zero_grad(set_to_none=False), backward,
clip_grad_norm_, step) bit for bit, and leaves the tensors it was built from untouched."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hetfl.core.client.trainable import Trainable
from hetfl.core.init import build_model
from hetfl.core.training import LocalTraining
from hetfl.models.base import PlainFamily

FAMILY = PlainFamily("linear", (4,), 3)


@pytest.mark.parametrize(
    "settings",
    [
        LocalTraining(lr=0.1, momentum=0.9, weight_decay=1e-3, clip_grad_norm=0.05),
        LocalTraining(lr=0.01, optimizer="amsgrad", weight_decay=1e-4),
    ],
    ids=["sgd-clipped", "amsgrad"],
)
def test_a_trainable_steps_as_torch_optim_does(settings: LocalTraining) -> None:
    spec = FAMILY.global_spec([])
    torch.manual_seed(0)
    reference = build_model(FAMILY, spec)
    start = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    kind = torch.optim.SGD if settings.optimizer == "sgd" else torch.optim.Adam
    extra = {"momentum": settings.momentum} if settings.optimizer == "sgd" else {"amsgrad": True}
    optim = kind(
        reference.parameters(), lr=settings.lr, weight_decay=settings.weight_decay, **extra
    )
    trainable = Trainable.of(FAMILY, spec, start, settings, kept={})
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(8, 4, generator=generator), torch.randint(3, (8,), generator=generator)
        optim.zero_grad(set_to_none=False)
        F.cross_entropy(reference(x), y).backward()
        if settings.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(reference.parameters(), settings.clip_grad_norm)
        optim.step()
        trainable.train(F.cross_entropy(trainable.model(x), y))
    trained = trainable.tensors()
    for name, want in reference.state_dict().items():
        assert torch.equal(trained[name], want), name
        assert not torch.equal(start[name], want)  # it moved; the start is a copy
    assert set(trainable.kept()) == set(trainable.state) and trainable.state
