"""FedGKT and the round-level server phase: the KD loss by hand, logits aligned by sample
index, typed uploads and pending downloads counted by hand, the phase's view of a round and
its place on the clock, the pooled evaluation, and the settings' errors."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from hetfl.algorithms import ALGORITHMS
from hetfl.algorithms.parts.gkt_distill import ServerLogitsKD, kd_loss
from hetfl.algorithms.parts.gkt_server import GKTServer
from hetfl.core.client.loop import train_local
from hetfl.core.client.program import Program, Programs
from hetfl.core.client.recipe import LocalRecipe, TrainContext
from hetfl.core.simulator_only import SimulatorOnlyError, refuse_simulator_only
from hetfl.core.spec import Spec
from hetfl.core.training import LocalTraining
from hetfl.core.types import ClientOutput, ClientResult, ClientTask, PassRecord
from hetfl.engine.checkpoint import load_checkpoint
from hetfl.engine.round_settings import RoundSettings
from hetfl.engine.store import StoreSettings
from hetfl.engine.validate import upload_problem
from hetfl.models import make_family
from hetfl.sim import Simulation
from hetfl.systems.costs import MacCounter
from hetfl.systems.profiles import SystemSettings, dtfl_profiles

TRAIN = LocalTraining(lr=1e-3, optimizer="amsgrad", weight_decay=1e-4, epochs=2, batch_size=32)


def _family():
    return make_family("resnet-cifar", (1, 8, 8), 10, blocks=1)


# -- the loss -------------------------------------------------------------------------------
def _kd_by_hand(student: list[list[float]], teacher: list[list[float]], t: float) -> float:
    """T² · mean over rows of Σ_c q_c (log q_c - log p_c), q = softmax(teacher/T) + 1e-7,
    p = softmax(student/T): FedML's KL_Loss, written out."""
    total = 0.0
    for s_row, t_row in zip(student, teacher, strict=True):
        zs = sum(math.exp(v / t) for v in s_row)
        zt = sum(math.exp(v / t) for v in t_row)
        for s_v, t_v in zip(s_row, t_row, strict=True):
            q = math.exp(t_v / t) / zt + 1e-7
            total += q * (math.log(q) - (s_v / t - math.log(zs)))
    return t * t * total / len(student)


def test_kd_loss_and_its_temperature_by_hand():
    student = [[1.0, 2.0, 0.5], [0.0, -1.0, 3.0]]
    teacher = [[0.5, 0.0, 1.0], [12.0, 1.0, -9.0]]  # row 2: a confident teacher
    values = {}
    for t in (1.0, 3.0):  # float64, so that the 1e-7 floor on the teacher is seen too
        got = kd_loss(torch.tensor(student).double(), torch.tensor(teacher).double(), t)
        assert float(got) == pytest.approx(_kd_by_hand(student, teacher, t), rel=1e-12)
        values[t] = float(got)
    assert values[1.0] != pytest.approx(values[3.0], rel=1e-2)


def _ctx(download: dict, indices: torch.Tensor | None) -> TrainContext:
    task = ClientTask(0, Spec({}), {}, [], download=download)
    return TrainContext(task=task, received={}, generator=torch.Generator(), settings=TRAIN,
                        indices=indices)  # fmt: skip


def test_the_client_learns_from_the_server_logits_of_its_batch_samples():
    server = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    outputs = torch.randn(3, 4, generator=torch.Generator().manual_seed(2))
    indices = torch.tensor([4, 0, 2])  # not a prefix: a lookup by position would differ
    term = ServerLogitsKD(alpha=0.5, temperature=3.0)
    got = term(outputs, torch.zeros(3), torch.zeros(3), _ctx({"logits": server}, indices))
    assert torch.equal(got, 0.5 * kd_loss(outputs, server[indices], 3.0))
    assert term(outputs, torch.zeros(3), torch.zeros(3), _ctx({}, indices)) is None  # round 1


@dataclass
class _BatchLog:
    """A tracker recording each step's sample indices and labels."""

    seen: list

    def after_step(self, ctx: TrainContext) -> None:
        self.seen.append((ctx.indices.clone(), ctx.batch[1].clone()))

    def finish(self, ctx: TrainContext) -> dict:
        return {}


def test_a_batch_s_indices_name_its_samples_over_two_epochs(synthetic_federation):
    family, clients, _ = synthetic_federation
    data = clients[0]
    template = family.build(family.global_spec([]))
    params = {k: v.detach().clone().requires_grad_(True) for k, v in template.named_parameters()}
    log = _BatchLog([])
    settings = replace(TRAIN, optimizer="sgd", epochs=2)
    ctx = TrainContext(task=ClientTask(0, family.global_spec([]), {}, []), received={},
                       generator=torch.Generator().manual_seed(0), settings=settings,
                       params=params)  # fmt: skip
    train_local(template, data, LocalRecipe(trackers=(log,)), ctx)
    for indices, y in log.seen:
        assert torch.equal(data.y_train[indices], y)
    per_epoch = -(-data.n_train // settings.batch_size)
    epochs = [
        torch.cat([i for i, _ in log.seen[e * per_epoch : (e + 1) * per_epoch]]) for e in (0, 1)
    ]
    for order in epochs:
        assert torch.equal(order.sort().values, torch.arange(data.n_train))
    assert not torch.equal(epochs[0], epochs[1])  # each epoch its own seeded order


# -- the model ------------------------------------------------------------------------------
def test_the_edge_model_is_private_and_the_server_model_global():
    family = _family()
    edge = family.side_spec("edge", 1)
    assert family.index_map(edge) == []
    assert family.global_spec([edge]) == family.side_spec("server", 1)
    z, logits = family.build(edge)(torch.zeros(2, 1, 8, 8), activations=True)
    assert z.shape == (2, 16, 8, 8) and logits.shape == (2, 10)


# -- a run ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class NaNFeatures:
    """A wrapper whose client `cid` uploads non-finite features."""

    cid: int

    def __call__(self, program: Program) -> Program:
        return _Spoiled(program) if program.cid == self.cid else program


class _Spoiled:
    def __init__(self, program: Program) -> None:
        self.program, self.cid, self.device = program, program.cid, program.device

    def fit(self, *args, **kwargs) -> ClientOutput:
        out = self.program.fit(*args, **kwargs)
        uploads = {**out.result.uploads, "features": out.result.uploads["features"] * math.nan}
        return replace(out, result=replace(out.result, uploads=uploads))

    def evaluate(self, *args, **kwargs):
        return self.program.evaluate(*args, **kwargs)


def _small(clients, n=40):
    """Clients cut to their first `n` training samples: two batches an epoch."""
    return [replace(c, x_train=c.x_train[:n], y_train=c.y_train[:n]) for c in clients]


def _run(tmp_path, clients, test, rounds, *, wrappers=(), system=None, opts=None, store=None):
    family = _family()
    strategy, recipe = ALGORITHMS.get("fedgkt").build(
        family, {"server_epochs": 1, **(opts or {})}, clients_per_round=len(clients), train=TRAIN
    )
    programs = Programs(family, recipe, seed=0, wrappers=wrappers)
    settings = RoundSettings(rounds=rounds, seed=0, system=system, local_eval="all")
    return Simulation(strategy, programs, clients, test, settings, tmp_path, store=store)


def test_the_phase_sees_the_round_s_valid_uploads_in_client_order(
    synthetic_federation, tmp_path, monkeypatch
):
    _, clients, test = synthetic_federation
    sim = _run(tmp_path, _small(clients[:3]), test, 1, wrappers=(NaNFeatures(1),))
    seen, run = [], GKTServer.run

    def recorded(self, round, state, uploads, generator):
        seen.append([u.cid for u in uploads])
        return run(self, round, state, uploads, generator)

    monkeypatch.setattr(GKTServer, "run", recorded)
    summary = sim.run()
    assert seen == [[0, 2]]  # client 1's bad upload failed it, not the run
    assert summary["failures"] == {"non-finite": 1}
    assert sorted(sim.downloads) == [0, 2]


def test_pending_downloads_share_the_store_budget_and_spill_under_it(
    synthetic_federation, tmp_path
):
    """`store.memory_budget` bounds everything held per client: FedGKT's pending downloads
    take half of it beside the private models. Under a budget too small for any entry both
    stores spill, and the run ends with the same state and downloads as without one."""
    _, clients, test = synthetic_federation
    clients = _small(clients[:3])
    free = _run(tmp_path / "free", clients, test, 2)
    free.run()
    tight = _run(tmp_path / "tight", clients, test, 2, store=StoreSettings(1001))
    assert (tight.store.memory_budget, tight.downloads.memory_budget) == (501, 500)
    spilled = []
    put = tight.downloads.put

    def counting(cid, entry):
        put(cid, entry)
        spilled.append(tight.downloads.spilled_count())

    tight.downloads.put = counting  # type: ignore[method-assign]
    tight.run()
    assert spilled and max(spilled) == 3  # every pending download on disk
    assert all(torch.equal(v, tight.state[k]) for k, v in free.state.items())
    mine = load_checkpoint(tmp_path / "free" / "checkpoints")["downloads"]
    theirs = load_checkpoint(tmp_path / "tight" / "checkpoints")["downloads"]
    assert sorted(mine) == sorted(theirs) == [0, 1, 2]
    for cid, entry in mine.items():
        assert all(torch.equal(v, theirs[cid][k]) for k, v in entry.items())


def test_uploads_are_checked_against_what_the_task_declared():
    task = ClientTask(0, Spec({}), {}, [], uploads={"f": (2, 3), "y": (2,)})
    good = {"f": torch.zeros(2, 3), "y": torch.zeros(2, dtype=torch.long)}
    result = ClientResult(0, {}, 2, 1, 0.0, uploads=good)
    assert upload_problem(result, task) is None
    assert upload_problem(replace(result, uploads={"f": good["f"]}), task).kind == "invalid"
    wrong = {**good, "f": torch.zeros(3, 3)}
    assert "shape (3, 3), expected (2, 3)" in str(
        upload_problem(replace(result, uploads=wrong), task)
    )


def test_a_run_counts_transfers_clocks_the_phase_and_pools_its_clients_splits(
    synthetic_federation, tmp_path
):
    _, clients, test = synthetic_federation
    clients = _small(clients[:3])
    system = SystemSettings(dtfl_profiles())
    sim = _run(tmp_path, clients, test, 2, system=system)
    round_times = []
    clock_round = sim.clock.round_time
    sim.clock.round_time = lambda times: round_times.append(clock_round(times)) or round_times[-1]
    sim.run()
    rows = sim.metrics.read()
    family = _family()
    server = family.side_spec("server", 1)

    # Client models never enter the global state: it is the server model, md2..md8.
    assert list(sim.state) == list(family.build(server).state_dict())

    # Uploads in the round they are sent; the server's logits in the round they arrive.
    def up(data):
        n = data.n_train
        return n * 16 * 8 * 8 * 4 + n * 10 * 4 + n * data.y_train.element_size() + n * 8

    assert rows[0]["bytes_up"] == sum(up(c) for c in clients)
    assert rows[0]["bytes_down"] == 0  # nothing of the edge model is sent down
    assert rows[1]["bytes_up"] == 2 * rows[0]["bytes_up"]
    assert rows[1]["bytes_down"] == sum(c.n_train * 10 * 4 for c in clients)
    assert {cid: sim.downloads.get(cid)["logits"].shape for cid in sim.downloads} == {
        c.cid: (c.n_train, 10) for c in clients
    }

    # The phase's MACs at the server rate, after the slowest client (one server epoch).
    macs = MacCounter(family)
    phase = sum(
        macs.pass_macs(PassRecord(server, "train", min(32, c.n_train - s), 1), (16, 8, 8))
        for c in clients
        for s in range(0, c.n_train, 32)
    )
    assert rows[0]["sim_time_s"] == pytest.approx(round_times[0] + phase / system.server_rate)
    assert rows[1]["sim_time_s"] == pytest.approx(sum(round_times) + 2 * phase / system.server_rate)

    # pooled_acc: each client's extractor joined to the server model on its own test split,
    # its BatchNorm statistics those of the client's training data (one batch: <= 500).
    whole = family.build(family.side_spec("whole"))
    norms = [m for m in whole.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    correct = n = 0
    for c in clients:
        mine = sim.store.get(c.cid)
        whole.load_state_dict({**{k: mine[k] for k in mine if k.startswith("md1.")}, **sim.state})
        for m in norms:
            m.reset_running_stats()
            m.momentum = None
        with torch.no_grad():
            whole.train()(c.x_train)
            correct += int((whole.eval()(c.x_test).argmax(1) == c.y_test).sum())
        n += int(c.y_test.numel())
    assert rows[1]["pooled_acc"] == pytest.approx(correct / n, abs=1e-12)
    # global_acc is the global test set's, which no one model of FedGKT's is scored on
    assert [r["global_acc"] for r in rows] == [None, None]


def test_settings_out_of_range_are_refused_naming_them():
    options = ALGORITHMS.get("fedgkt").options
    for field, value, allowed in [
        ("temperature", 0.0, "greater than 0"),
        ("alpha", -0.5, "greater than or equal to 0"),
        ("server_epochs", 0, "greater than or equal to 1"),
    ]:
        with pytest.raises(ValidationError, match=allowed) as err:
            options(**{field: value})
        assert err.value.errors()[0]["loc"] == (field,)


def test_fedgkt_is_simulator_only():
    with pytest.raises(SimulatorOnlyError, match="round-level server phase"):
        refuse_simulator_only("fedgkt", ALGORITHMS.get("fedgkt").simulator_only)
    strategy, _ = ALGORITHMS.get("fedgkt").build(_family(), {}, clients_per_round=1, train=TRAIN)
    assert (
        strategy.capabilities.needs_server_program
    )  # the Flower server refuses it outside the registry


def test_a_target_on_the_global_test_set_is_refused_naming_pooled_acc():
    """FedGKT has no global model: a global_acc target would never be met, silently."""
    from golden.harness import BY_NAME
    from hetfl.assembly import build_parts
    from hetfl.config import ConfigError, validate

    raw = {**BY_NAME["fedgkt"].config, "targets": [{"metric": "global_acc", "value": 0.5}]}
    with pytest.raises(ConfigError, match=r"global_acc is never reported by fedgkt.*pooled_acc"):
        build_parts(validate(raw), show_progress=False)
    raw["targets"] = [{"metric": "pooled_acc", "value": 0.5}]
    (target,) = build_parts(validate(raw), show_progress=False).settings.targets
    assert target.metric == "pooled_acc"
