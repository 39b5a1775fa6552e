"""Server programs: a two-module split strategy run by the simulator, against training the
joined model, with the channel's bytes and the server side's time counted by hand."""

from __future__ import annotations

import json
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hetfl.core.client.program import Programs
from hetfl.core.client.recipe import LocalRecipe
from hetfl.core.server.assign import one_spec
from hetfl.core.server_program import ServerProgram, ServerSession
from hetfl.core.spec import Spec, full_map
from hetfl.core.state import extract
from hetfl.core.training import LocalTraining
from hetfl.core.types import ClientData, PassRecord, ServerResult
from hetfl.engine.round_settings import RoundSettings
from hetfl.sim import Simulation
from hetfl.systems.profiles import DeviceProfile, SystemSettings
from strategies import fedavg

TRAIN = LocalTraining(lr=0.2, epochs=1, batch_size=4)
BODY = ["body.0.weight", "body.0.bias"]
HEAD = ["head.weight", "head.bias"]


class _Part(nn.Sequential):
    """Named children run one after the other, so a part's tensor names are the joined
    model's (`body.0.weight`, `head.bias`)."""


class _SplitFamily:
    """Joined model body (linear 4 -> 8, ReLU) | head (linear 8 -> 3); `side` builds one part."""

    def build(self, spec: Spec) -> nn.Module:
        parts = OrderedDict(
            body=nn.Sequential(nn.Linear(4, 8), nn.ReLU()),
            head=nn.Linear(8, 3),
        )
        side = spec.get("side")
        if side == "client":
            parts.pop("head")
        elif side == "server":
            parts.pop("body")
        return _Part(parts)

    def index_map(self, spec: Spec):
        return full_map(list(self.build(spec).state_dict()))

    def global_spec(self, specs):
        return Spec(model="split")

    def modules(self, spec: Spec) -> list[str]:
        return [name for name, _ in self.build(spec).named_children()]


CLIENT, SERVER_SIDE = Spec(model="split", side="client"), Spec(model="split", side="server")


class _Session:
    """A per-client copy of the head, trained by SGD on each batch of activations; it
    answers with the activations' gradient (SplitFed) unless `answer` is off (DTFL)."""

    def __init__(self, family, cid, payload, lr, answer):
        self.cid, self.answer = cid, answer
        self.model = family.build(SERVER_SIDE)
        self.model.load_state_dict(payload)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=lr)
        self.passes: list[PassRecord] = []
        self.seen = 0

    def batch(self, z, y):
        z.requires_grad_(True)
        loss = F.cross_entropy(self.model(z), y)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        kind = "train+input" if self.answer else "train"  # the answer is a gradient
        self.passes.append(PassRecord(SERVER_SIDE, kind, int(y.shape[0]), 1))
        self.seen += 1
        return z.grad if self.answer else None

    def close(self):
        tensors = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        seen = torch.tensor(float(self.seen))
        return ServerResult(self.cid, tensors, self.passes, (8,), private={"batches": seen})


class _Program:
    def __init__(self, family, parallel):
        self.family, self.parallel = family, parallel
        self.kept: dict[int, float] = {}
        self.state: dict[str, torch.Tensor] = {}

    def open(self, task, private) -> ServerSession:  # a protocol: no base class
        self.kept[task.cid] = float(private["batches"]) if private else 0.0
        payload = extract(self.state, full_map(HEAD))
        lr = task.config.lr
        return _Session(self.family, task.cid, payload, lr, answer=not self.parallel)


class _SplitSide:
    """SplitFed-style server side: the program opens each round on the round's global state;
    a session's head is reduced with its client's body, by sample counts, like FedAvg over
    the joined models."""

    def __init__(self, family, parallel):
        self.program_ = _Program(family, parallel)

    def program(self, round, state, tasks) -> ServerProgram:
        self.program_.state = state
        return self.program_

    def index_map(self, served):
        return full_map(HEAD)


def _split_strategy(family, *, parallel=False, clients_per_round, train):
    """The client trains the body, its server copy the head."""
    side = _SplitSide(family, parallel)
    return fedavg(
        family,
        clients_per_round=clients_per_round,
        train=train,
        assignment=one_spec(CLIENT),
        server_side=side,
    )


class _ClientSide:
    """The client's half of a split step: body forward (a forward part), exchange, and
    either backward with the server's gradient (SplitFed) or a local loss... here none, so
    DTFL-style clients only send (their own update would need an auxiliary head)."""

    def forward(self, model, x, y, ctx):
        z = model(x)
        ctx.scratch(self)["z"] = z
        return z, torch.zeros(y.shape[0])  # the loss is computed on the server

    def backward(self, total, ctx):
        z = ctx.scratch(self).pop("z")
        grad = ctx.send(z, ctx.batch[1])
        if grad is not None:
            z.backward(grad)


def _client_side() -> LocalRecipe:
    """The split client's recipe: `_ClientSide`'s forward and backward parts."""
    side = _ClientSide()
    return LocalRecipe(forward=side.forward, backward=side.backward)


def _clients(n_clients=3, n=10):
    g = torch.Generator().manual_seed(0)  # the test's own data
    out = []
    for cid in range(n_clients):
        x = torch.randn(n + cid, 4, generator=g)
        y = torch.randint(0, 3, (n + cid,), generator=g)
        out.append(ClientData(cid, x, y, x[:4], y[:4], 3))
    xt, yt = torch.randn(30, 4, generator=g), torch.randint(0, 3, (30,), generator=g)
    return out, (xt, yt)


def _run(tmp_path, strategy, recipe, rounds=2, system=None):
    family = strategy.family
    clients, test = _clients()
    settings = RoundSettings(rounds=rounds, seed=0, system=system)
    sim = Simulation(strategy, Programs(family, recipe, seed=0), clients, test, settings, tmp_path)
    sim.run()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return sim, rows


def test_split_training_equals_training_the_joined_model(tmp_path):
    family = _SplitFamily()
    split = _split_strategy(family, clients_per_round=3, train=TRAIN)
    sim, rows = _run(tmp_path / "split", split, _client_side())
    joined = fedavg(family, clients_per_round=3, train=TRAIN)
    ref, ref_rows = _run(tmp_path / "joined", joined, LocalRecipe())
    assert rows[-1]["clients"] == 3 and rows[-1]["failed"] == 0
    for name in BODY + HEAD:
        torch.testing.assert_close(sim.state[name], ref.state[name], rtol=1e-6, atol=1e-7)
    assert rows[-1]["global_acc"] == ref_rows[-1]["global_acc"]
    # the server kept each client's batch count across rounds (per-client server state)
    assert split.extras.server_side.program_.kept == {0: 3.0, 1: 3.0, 2: 3.0}
    assert sorted(sim.server_store) == [0, 1, 2]


def test_channel_bytes_are_counted_both_ways(tmp_path):
    split = _split_strategy(_SplitFamily(), clients_per_round=3, train=TRAIN)
    _, rows = _run(tmp_path, split, _client_side(), rounds=1)
    samples = 10 + 11 + 12
    body = (8 * 4 + 8) * 4  # float32 body weights and biases, down and up
    activations = samples * 8 * 4  # one float32 row of 8 per sample
    labels = samples * 8  # int64
    assert rows[0]["bytes_up"] == 3 * body + activations + labels
    assert rows[0]["bytes_down"] == 3 * body + activations  # the gradients come back
    # DTFL-style: activations go up, nothing comes back
    quiet = _split_strategy(_SplitFamily(), parallel=True, clients_per_round=3, train=TRAIN)
    _, rows = _run(tmp_path / "quiet", quiet, _client_side(), rounds=1)
    assert rows[0]["bytes_up"] == 3 * body + activations + labels
    assert rows[0]["bytes_down"] == 3 * body


@pytest.mark.parametrize("parallel", [False, True])
def test_server_side_is_timed_and_declared_parallel_parts_overlap(tmp_path, parallel):
    profile = DeviceProfile("p", rate=1e3, down_mbps=1.0, up_mbps=2.0)
    system = SystemSettings((profile,), server_rate=500.0)
    split = _split_strategy(_SplitFamily(), parallel=parallel, clients_per_round=3, train=TRAIN)
    sim, rows = _run(tmp_path, split, _client_side(), rounds=1, system=system)
    body_fwd, head_fwd = 4 * 8, 8 * 3  # MACs per sample
    totals = []
    for cid, n in ((0, 10), (1, 11), (2, 12)):
        t = sim.infos[cid].history
        # client: body forward + weight gradient (its input needs none); server: head
        # forward + weight gradient, + the activations' gradient when it answers
        server = n * (2 if parallel else 3) * head_fwd
        assert t.macs == n * 2 * body_fwd and t.server_macs == server
        assert t.compute_s == pytest.approx(n * 2 * body_fwd / 1e3)
        assert t.server_s == pytest.approx(server / 500.0)
        comm = t.bytes_down * 8 / 1e6 + t.bytes_up * 8 / 2e6
        sides = max(t.compute_s, t.server_s) if parallel else t.compute_s + t.server_s
        assert t.total_s == pytest.approx(comm + sides) and t.parallel == parallel
        totals.append(t.total_s)
    assert rows[0]["sim_time_s"] == pytest.approx(max(totals))


def test_strategies_declare_whether_they_need_a_server_program():
    family = _SplitFamily()
    assert _split_strategy(
        family, clients_per_round=1, train=TRAIN
    ).capabilities.needs_server_program
    assert not fedavg(family, clients_per_round=1, train=TRAIN).capabilities.needs_server_program


def test_split_hooks_without_a_channel_fail_clearly():
    family = _SplitFamily()
    clients, _ = _clients(1)
    strategy = _split_strategy(family, clients_per_round=1, train=TRAIN)
    state = strategy.setup([c.info() for c in clients], torch.Generator().manual_seed(0))
    task = strategy.plan(1, state, [clients[0].info()], torch.Generator().manual_seed(0))[0]
    program = Programs(family, _client_side(), seed=0).program_for(0)
    with pytest.raises(RuntimeError, match="gave no channel"):
        program.fit(task, clients[0], {}, torch.Generator().manual_seed(0), info=clients[0].info())
