"""The `pfl` side of workload A: the FedAvg floor written for pfl-research's simulator
(`pip install pfl`, Apple's "pfl-research: simulation framework for accelerating research
in Private Federated Learning", 2024) and run as pfl runs on several cores: one process per
worker under `torchrun`, each running the whole algorithm, the cohort split between them
and their statistics summed by `torch.distributed` (gloo on a CPU).

It is written as pfl's own PyTorch examples write one: a `torch.nn.Module` with `loss` and
`metrics`, `PyTorchModel` with a local `torch.optim.SGD` per user and a central SGD of
learning rate 1 (so the averaged model difference is the update), `FederatedAveraging`
over a `FederatedDataset` on the `SimulatedBackend`, and pfl's `CentralEvaluationCallback`
testing the global model every round, its batches split between the workers.

What it computes is the floor's (`bench_floor_fedavg`): the same client tensors, the same
initial weights, plain SGD, the same batch order: pfl slices a user's data in order, so a
user's dataset is made with its rows in HetFL's permutation of that round (each user is
made once a round in A, so the number of times a user has been made is the round).
pfl weights every user alike (A's clients hold 3,000 samples each, so that is the floor's
sample weighting) and averages in float32 where the floor sums in float64: rounding,
within the benchmark's across-threads weight check.

Its clock, on worker 0: `start_rounds` just before `FederatedAveraging.run` (both workers'
data loaded and the process group up), a row after each round's test and checkpoint; pfl's
evaluation before training (`on_train_begin`) is not asked for, as no other side makes one.
Where pfl cannot go: workload H (HeteroFL), see benchmarks/README.md.

Run by the driver through `torchrun` in the interpreter that has pfl:
  python -m torch.distributed.run --standalone --nproc_per_node 2 bench_pfl_sim.py ARGS
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from bench_floor_fedavg import Clients, initial_model, load_clients, load_test
from bench_side import SideClock, save_atomically
from bench_workloads import BATCH, EVAL_BATCH, LR, SEED, WORKLOADS, Workload
from torch import nn

from hetfl.core.pixels import PixelNorm
from hetfl.core.rng import torch_generator


class PflModule(nn.Module):
    """The small CNN with pfl's two hooks: `loss` on a training batch, `metrics` on an
    evaluation batch; both standardise the uint8 pixels as HetFL does."""

    def __init__(self, net: nn.Module, pixels: PixelNorm) -> None:
        super().__init__()
        self.net, self.pixels = net, pixels

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.train()
        return F.cross_entropy(self.net(self.pixels(x)), y)

    @torch.no_grad()
    def metrics(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
        from pfl.metrics import Weighted

        self.eval()
        correct = int((self.net(self.pixels(x)).argmax(dim=1) == y).sum())
        return {"accuracy": Weighted(correct, int(y.shape[0]))}


class RoundUsers:
    """pfl's `make_dataset_fn`: a user's data in HetFL's batch order of the round it is
    made for (its `made`-th making is round `made`)."""

    def __init__(self, data: Clients) -> None:
        self.data = data
        self.made: dict[int, int] = {}

    def __call__(self, user: int) -> Any:
        from pfl.data.dataset import Dataset

        rnd = self.made[user] = self.made.get(user, 0) + 1
        x, y = self.data.xs[user], self.data.ys[user]
        perm = torch.randperm(int(y.shape[0]), generator=torch_generator(SEED, rnd, user, "train"))
        return Dataset((x[perm], y[perm]), user_id=str(user))


def round_callback(test: Any, workdir: Path, clock: SideClock, accs: list[float]) -> Any:
    """pfl's central evaluation every round, then (worker 0) the metrics row, the clock's
    mark and the checkpoint, as the floor writes them."""
    from pfl.callback.base import TrainingProcessCallback
    from pfl.callback.central_evaluation import CentralEvaluationCallback
    from pfl.hyperparam import NNEvalHyperParams
    from pfl.internal.ops.selector import get_default_framework_module as ops

    evaluation = CentralEvaluationCallback(
        test, model_eval_params=NNEvalHyperParams(local_batch_size=EVAL_BATCH)
    )
    rank = ops().distributed.global_rank

    class EveryRound(TrainingProcessCallback):  # type: ignore[misc]
        def after_central_iteration(
            self, aggregate_metrics: Any, model: Any, *, central_iteration: int
        ) -> tuple[bool, Any]:
            # pfl numbers rounds from 0 and skips evaluation at 0: ask it for round + 1.
            stop, metrics = evaluation.after_central_iteration(
                aggregate_metrics, model, central_iteration=central_iteration + 1
            )
            acc = next(v.overall_value for k, v in metrics if "accuracy" in str(k))
            accs.append(acc)
            if rank == 0:
                with open(workdir / "metrics.jsonl", "a") as fh:
                    fh.write(json.dumps({"round": central_iteration + 1, "global_acc": acc}) + "\n")
                clock.row()
                save_atomically(model.pytorch_model.net.state_dict(), workdir / "checkpoint.pt")
            return stop, metrics

    return EveryRound()


def run_pfl_sim(w: Workload, rounds: int, workdir: Path, weights: Path, out: Path) -> None:
    """Worker `RANK` of the pfl side (under torchrun); worker 0 writes the report."""
    torch.set_num_threads(1)
    clock = SideClock()
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.sampling import get_user_sampler
    from pfl.hyperparam import NNTrainHyperParams
    from pfl.internal.ops.selector import get_default_framework_module as ops
    from pfl.model.pytorch import PyTorchModel

    data, test = load_clients(w), load_test(w)
    net, _ = initial_model()
    module = PflModule(net, data.pixels)
    model = PyTorchModel(
        module,
        local_optimizer_create=torch.optim.SGD,
        central_optimizer=torch.optim.SGD(module.parameters(), lr=1.0),
    )
    users = FederatedDataset(RoundUsers(data), get_user_sampler("minimize_reuse", range(w.clients)))
    accs: list[float] = []
    callback = round_callback(Dataset((test.x, test.y)), workdir, clock, accs)
    ops().distributed.all_reduce([torch.zeros(1)])  # both workers ready: the clock starts
    clock.start_rounds()
    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(
            central_num_iterations=rounds,
            evaluation_frequency=rounds + 1,  # no per-user evaluation
            train_cohort_size=w.per_round,
            val_cohort_size=0,
        ),
        backend=SimulatedBackend(training_data=users, val_data=None),
        model=model,
        model_train_params=NNTrainHyperParams(
            local_num_epochs=1, local_learning_rate=LR, local_batch_size=BATCH
        ),
        callbacks=[callback],
        send_metrics_to_platform=False,
    )
    clock.end()
    if ops().distributed.global_rank == 0:
        state = {k: v.detach().clone() for k, v in net.state_dict().items()}
        torch.save(state, weights)
        report = {**clock.report(), "n_params": sum(v.numel() for v in state.values()), "acc": accs}
        out.write_text(json.dumps(report))


def main() -> None:
    p = argparse.ArgumentParser(description="one pfl worker of the benchmark's pfl side")
    p.add_argument("--workload", required=True)
    p.add_argument("--rounds", type=int, required=True)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", required=True)
    p.add_argument("--weights", required=True)
    p.add_argument("--workdir", required=True)
    args = p.parse_args()
    w = WORKLOADS[args.workload]
    run_pfl_sim(
        w.smoke() if args.smoke else w,
        args.rounds,
        Path(args.workdir),
        Path(args.weights),
        Path(args.out),
    )


if __name__ == "__main__":
    main()
