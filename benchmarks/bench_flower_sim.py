"""The `flower` side of workload A: the FedAvg floor written as a Flower app and run on
Flower's simulation engine (Ray backend), what researchers use today for a simulation.

It is written as Flower's own examples write one (Flower 1.41's Message API): a `ServerApp`
running the built-in `FedAvg` strategy (`flwr.serverapp.strategy.FedAvg`) with a central
`evaluate_fn`, and a `ClientApp` whose `train` handler trains its node's partition for one
epoch and replies with its weights and `num-examples`. Each virtual node is one client
(`partition-id`); Ray runs `WORKERS` actors of one CPU each, one thread each, so the side
uses the same two cores as HetFL's process executor and floor2.

What it computes is the floor's (`bench_floor_fedavg`): the same client tensors, the same
initial weights, the same batch order (each client's generator from (seed, round, client)),
plain SGD; an actor loads the clients once and keeps them (a module-level cache, as
Flower's examples cache their `FederatedDataset`). The strategy averages in float32 NumPy,
weighted by `num-examples`, where the floor sums in float64: a difference of float
rounding, well inside the benchmark's weight check. The global model is tested and
checkpointed every round in the server app, as the floor does (`evaluate_fn`).

Its clock: `start_rounds` when the strategy makes its initial evaluation call (round 0: the
simulation engine, its actors and the nodes are up by then), a row after each round's
test and checkpoint; the total includes Ray's start and shut-down.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from bench_floor_fedavg import (
    Clients,
    _finish_round,
    _sgd,
    initial_model,
    load_clients,
    load_test,
    test_accuracy,
    train_clients,
)
from bench_side import Profile, SideClock
from bench_worker_pair import WORKERS
from bench_workloads import WORKLOADS, Workload

#: Each actor's clients, by workload name and smoke flag: loaded on an actor's first message.
_CLIENTS: dict[tuple[str, bool], Clients] = {}


def _client_app() -> Any:
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        torch.set_num_threads(1)
        config, arrays = msg.content.config_records["config"], msg.content.array_records["arrays"]
        key = (str(config["workload"]), bool(config["smoke"]))
        if key not in _CLIENTS:
            w = WORKLOADS[key[0]]
            _CLIENTS[key] = load_clients(w.smoke() if key[1] else w)
        cid = int(context.node_config["partition-id"])
        state = arrays.to_torch_state_dict()
        model, _ = initial_model()
        sums, n = train_clients(
            model, _sgd(model), state, [cid], _CLIENTS[key], int(str(config["server-round"]))
        )
        trained = {k: (s / n).to(state[k].dtype) for k, s in sums.items()}
        content = RecordDict(
            {"arrays": ArrayRecord(trained), "metrics": MetricRecord({"num-examples": n})}
        )
        return Message(content=content, reply_to=msg)

    return app


def run_flower_sim(
    w: Workload, rounds: int, workdir: Path, weights: Path, profile: str | None, *, smoke: bool
) -> dict[str, Any]:
    """Workload `w` on Flower's simulation engine; the side's report as every side's."""
    from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation

    if w.per_round != w.clients:
        raise ValueError(
            f"the flower side runs workloads whose every client trains each round (A), not "
            f"{w.name}: Flower's FedAvg samples its own clients, so the sides would differ"
        )
    clock = SideClock()
    torch.set_num_threads(1)
    # Ray's workers unpickle the client app by module name: they need this folder's modules.
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    test = load_test(w)
    model, state = initial_model()
    accs: list[float] = []
    final: dict[str, torch.Tensor] = {}

    def evaluate(rnd: int, arrays: ArrayRecord) -> MetricRecord | None:
        if rnd == 0:
            clock.start_rounds()
            return None
        global_state = arrays.to_torch_state_dict()
        model.load_state_dict(global_state)
        accs.append(test_accuracy(model, test))
        _finish_round(global_state, accs[-1], rnd, workdir, clock)
        final.update(global_state)
        return MetricRecord({"accuracy": accs[-1]})

    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        FedAvg(
            fraction_train=w.per_round / w.clients,
            fraction_evaluate=0.0,
            min_train_nodes=w.per_round,
            min_available_nodes=w.clients,
        ).start(
            grid,
            ArrayRecord(state),
            num_rounds=rounds,
            train_config=ConfigRecord({"workload": w.name, "smoke": smoke}),
            evaluate_fn=evaluate,
        )

    with Profile(profile):
        run_simulation(
            server,
            _client_app(),
            num_supernodes=w.clients,
            backend_name="ray",
            backend_config={
                "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                # "local": a Ray of its own, never a cluster some other work started; its
                # workers at niceness 0, as HetFL's Ray executor runs them (Ray's default, 15,
                # changes nothing on a quiet machine and starves them on a busy one)
                "init_args": {
                    "address": "local",
                    "num_cpus": WORKERS,
                    "include_dashboard": False,
                    "_system_config": {"worker_niceness": 0},  # type: ignore[dict-item]
                },
            },
        )
        clock.end()
    if len(accs) != rounds:
        raise RuntimeError(f"Flower's simulation ended after {len(accs)} of {rounds} rounds")
    torch.save(final, weights)
    return {**clock.report(), "n_params": sum(v.numel() for v in final.values()), "acc": accs}
