"""SplitFed (SFLV1, `hetfl.algorithms.splitfed`): the per-batch exchange trains what the
uncut model trained whole would, the channel's bytes and the server's compute counted by
hand, and the options a config can give it."""

from __future__ import annotations

import pytest
import torch

from hetfl.algorithms import ALGORITHMS
from hetfl.config import validate
from hetfl.core.client.program import Programs
from hetfl.core.state import state_bytes
from hetfl.core.training import LocalTraining
from hetfl.core.types import ClientData, PassRecord
from hetfl.engine.round_settings import RoundSettings
from hetfl.models import make_family
from hetfl.sim import Simulation
from hetfl.systems.costs import MacCounter
from hetfl.systems.profiles import DeviceProfile, SystemSettings

SHAPE, K, N, BATCH = (1, 8, 8), 3, 20, 8  # batches of 8, 8 and 4
SGD = LocalTraining(lr=0.05, batch_size=BATCH)
AMSGRAD = LocalTraining(lr=1e-3, optimizer="amsgrad", weight_decay=5e-4, batch_size=BATCH)


def _client() -> tuple[list[ClientData], tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)  # the test's own data
    x, y = torch.randn(N, *SHAPE, generator=g), torch.randint(0, K, (N,), generator=g)
    test = torch.randn(12, *SHAPE, generator=g), torch.randint(0, K, (12,), generator=g)
    return [ClientData(0, x, y, x[:4], y[:4], K)], test


def _run(tmp_path, algorithm, train, rounds=2, system=None):
    family = make_family("resnet-cifar", SHAPE, K, blocks=1)
    strategy, recipe = ALGORITHMS.get(algorithm).build(family, {}, clients_per_round=1, train=train)
    clients, test = _client()
    settings = RoundSettings(rounds=rounds, seed=0, system=system)
    sim = Simulation(strategy, Programs(family, recipe, seed=0), clients, test, settings, tmp_path)
    sim.run()
    return sim, sim.metrics.read()


@pytest.mark.parametrize("train", [SGD, AMSGRAD], ids=["sgd", "amsgrad"])
def test_the_exchange_equals_training_the_uncut_model_on_one_client(tmp_path, train):
    """Plain SGD makes the two sides' steps the whole model's step exactly; AMSGrad and
    its weight decay are per element, so per-side AMSGrad is whole-model AMSGrad too."""
    split, split_rows = _run(tmp_path / "split", "splitfed", train)
    whole, whole_rows = _run(tmp_path / "whole", "fedavg", train)
    assert list(split.state) == list(whole.state)
    for name, value in whole.state.items():
        torch.testing.assert_close(split.state[name], value, rtol=1e-6, atol=1e-6, msg=name)
    assert not torch.equal(whole.state["md1.conv.weight"], _initial(tmp_path, train))
    for s, w in zip(split_rows, whole_rows, strict=True):
        assert s["loss"] == pytest.approx(w["loss"], rel=1e-6)  # the server's loss, reported
        assert s["global_acc"] == w["global_acc"] and s["local_acc"] == w["local_acc"]


def _initial(tmp_path, train):
    family = make_family("resnet-cifar", SHAPE, K, blocks=1)
    strategy, _ = ALGORITHMS.get("fedavg").build(family, {}, clients_per_round=1, train=train)
    return strategy.setup([_client()[0][0].info()], torch.Generator().manual_seed(0))[
        "md1.conv.weight"
    ]


def test_activations_and_gradients_cross_the_channel_and_are_counted_by_hand(tmp_path):
    profile = DeviceProfile("p", rate=1e9, down_mbps=10.0, up_mbps=5.0)
    system = SystemSettings((profile,), server_rate=4e9)
    sim, rows = _run(tmp_path, "splitfed", SGD, rounds=1, system=system)
    family = sim.strategy.family
    client_side = family.build(family.side_spec("client", 2)).state_dict()
    weights = state_bytes(client_side)  # md1 and md2, sent down and back up
    z = 64 * 8 * 8 * 4  # md2's float32 output per sample: what goes up, and its gradient down
    assert rows[0]["bytes_up"] == weights + N * (z + 8)  # + int64 labels
    assert rows[0]["bytes_down"] == weights + N * z
    times = sim.infos[0].history
    server = family.side_spec("server", 2)
    counter = MacCounter(family)
    server_macs = sum(  # forward, weight and activation gradients of md3..md8, per batch
        counter.pass_macs(PassRecord(server, "train+input", b, 1), (64, 8, 8)) for b in (8, 8, 4)
    )
    assert times.server_macs == server_macs > 0 and not times.parallel
    assert times.total_s == pytest.approx(
        times.down_s + times.up_s + times.compute_s + server_macs / 4e9
    )  # the client waits for every answer: the sides add up


def test_options_and_the_model_it_needs_are_checked_at_the_config():
    base = {"algorithm": "splitfed", "data": {"dataset": "digits"}}
    split = {"model": {"name": "resnet-cifar", "blocks": 1}}
    assert validate({**base, **split}).algorithm == "splitfed"
    with pytest.raises(ValueError, match=r"needs a split model \(model.name one of resnet-cifar"):
        validate({**base, "model": {"name": "mlp"}})
    with pytest.raises(ValueError, match=r"options\.splitfed\.cut: .*less than or equal to 7"):
        validate({**base, **split, "options": {"splitfed": {"cut": 8}}})
    family = make_family("resnet-cifar", SHAPE, K, blocks=1)
    strategy, _ = ALGORITHMS.get("splitfed").build(
        family, {"cut": 5}, clients_per_round=1, train=SGD
    )
    assert strategy.assignment.spec_of(_client()[0][0].info()) == family.side_spec("client", 5)
    with pytest.raises(ValueError, match="splitfed cuts a split model"):
        ALGORITHMS.get("splitfed").build(
            make_family("mlp", SHAPE, K), {}, clients_per_round=1, train=SGD
        )
