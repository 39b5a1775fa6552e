"""The in-process simulator: one orchestration loop over the strategy protocol.

The engine owns availability, execution, failures, costs, evaluation, checkpoints and the
run outputs; the strategy owns sampling, payloads, aggregation and what to evaluate; the
client program owns local training. Clients run sequentially, each from generators derived
from (seed, round, client, purpose), and results reach `aggregate` sorted by client id, so a
round's outcome does not depend on execution order and a resumed run equals an
uninterrupted one.

Counting conventions: `bytes_down` counts every payload sent; `bytes_up` every result a
client returned (an invalid one included: it crossed the network); `macs` the training
passes of every client that trained. Evaluation traffic is measurement, not training, and is
not counted. Private tensors are never sent, so never counted.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from hetfl.core.client import ClientProgram
from hetfl.core.rng import SERVER, torch_generator
from hetfl.core.state import state_bytes
from hetfl.core.store import ClientStore
from hetfl.core.strategy import Strategy
from hetfl.core.types import ClientData, Failure
from hetfl.sim.checkpoint import load_checkpoint, save_checkpoint
from hetfl.sim.costs import MacCounter
from hetfl.sim.outputs import MetricsLog, Target, summarise, write_json
from hetfl.sim.progress import Progress
from hetfl.sim.steps import (
    Counters,
    RoundOutcome,
    charge_result,
    evaluate_global,
    mean_local_accuracy,
    metrics_row,
)

LocalEval = Literal["sampled", "all", "none"]


@dataclass(frozen=True)
class SimulationSettings:
    rounds: int
    seed: int
    eval_every: int = 1
    checkpoint_every: int = 1
    local_eval: LocalEval = "sampled"
    availability: float = 1.0
    targets: tuple[Target, ...] = ()
    stats_samples: int = 2000

    def __post_init__(self) -> None:
        for name in ("rounds", "eval_every", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.availability <= 1:
            raise ValueError(f"availability must be in (0, 1], got {self.availability}")

    def is_eval_round(self, rnd: int) -> bool:
        return rnd % self.eval_every == 0 or rnd == self.rounds

    def is_checkpoint_round(self, rnd: int) -> bool:
        return rnd % self.checkpoint_every == 0 or rnd == self.rounds


class Simulation:
    """Runs one configured experiment in process and writes the run-output contract."""

    def __init__(
        self,
        strategy: Strategy,
        program: ClientProgram,
        clients: Sequence[ClientData],
        test: tuple[torch.Tensor, torch.Tensor],
        settings: SimulationSettings,
        run_dir: Path,
        info: dict[str, Any] | None = None,
        progress: Progress | None = None,
        attrs: Mapping[int, Mapping[str, Any]] | None = None,
    ) -> None:
        """`attrs` holds what each client declares about itself (an architecture, a device
        capacity); the strategy sees it in `ClientInfo.attrs`."""
        self.strategy = strategy
        self.program = program
        self.clients = {c.cid: c for c in clients}
        declared = attrs or {}
        unknown = set(declared) - set(self.clients)
        if unknown:
            raise ValueError(f"attributes given for unknown clients {sorted(unknown)}")
        self.infos = {cid: c.info(declared.get(cid)) for cid, c in self.clients.items()}
        self.x_test, self.y_test = test
        self.settings = settings
        self.run_dir = Path(run_dir)
        self.info = dict(info or {})
        self.progress = progress or Progress(settings.rounds, enabled=False)
        self.store = ClientStore()
        self.counters = Counters()
        self.macs = MacCounter(program.family)
        self.metrics = MetricsLog(self.run_dir / "metrics.jsonl")
        self._stats_x: torch.Tensor | None = None
        self._ready = False

    def setup(self) -> None:
        """Assign specs and initialise the global state (once; `run` calls it if needed)."""
        if not self._ready:
            self.strategy.setup(
                list(self.infos.values()),
                torch_generator(self.settings.seed, 0, SERVER, "init"),
                rounds=self.settings.rounds,
            )
            self._ready = True

    # -- the loop -----------------------------------------------------------------------
    def run(self, resume: bool = False) -> dict[str, Any]:
        """Run (or continue) to `settings.rounds`; returns the summary."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.setup()
        first = self._restore() + 1 if resume else self._fresh_start()
        for rnd in range(first, self.settings.rounds + 1):
            started = time.perf_counter()
            # Step 1: plan -- whom to ask and what to send.
            available = self._available(rnd)
            tasks = self.strategy.plan(rnd, available, self._rng(rnd, SERVER, "sample"))
            # Step 2: local work -- every client in id order, results validated.
            outcome = self._run_clients(rnd, tasks)
            # Step 3: aggregate -- all valid results at once, sorted by client id.
            self.strategy.global_state = self.strategy.aggregate(
                rnd, outcome.results, outcome.failures
            )
            # Step 4: evaluate and record.
            row = self._evaluate(rnd, outcome) if self.settings.is_eval_round(rnd) else None
            self.counters.wall_time_s += time.perf_counter() - started
            if row is not None:
                row["wall_time_s"] = round(self.counters.wall_time_s, 3)
                self.metrics.append(row)
                self.strategy.observe(rnd, row)
            self.progress.round(rnd, row)
            # Step 5: checkpoint.
            if self.settings.is_checkpoint_round(rnd):
                self._checkpoint(rnd)
        self.progress.close()
        summary = summarise(self.metrics.read(), self.settings.targets, self.info)
        write_json(self.run_dir / "summary.json", summary)
        return summary

    # -- steps --------------------------------------------------------------------------
    def _rng(self, rnd: int, cid: int, purpose: str) -> torch.Generator:
        return torch_generator(self.settings.seed, rnd, cid, purpose)

    def _available(self, rnd: int) -> list:
        p = self.settings.availability
        out = []
        for cid in sorted(self.clients):
            if p >= 1.0 or float(torch.rand(1, generator=self._rng(rnd, cid, "availability"))) < p:
                out.append(self.infos[cid])
        return out

    def _run_clients(self, rnd: int, tasks: list) -> RoundOutcome:
        outcome = RoundOutcome()
        for task in sorted(tasks, key=lambda t: t.cid):
            data = self.clients[task.cid]
            self.counters.bytes_down += state_bytes(task.payload)
            try:
                out = self.program.fit(
                    task, data, self.store.get(task.cid), self._rng(rnd, task.cid, "train")
                )
            except Exception as exc:  # a failing client must not stop the run
                self._fail(outcome, task.cid, f"raised {type(exc).__name__}: {exc}")
                continue
            problem = charge_result(
                self.counters, self.macs, task, out.result, tuple(data.x_train.shape[1:])
            )
            if problem is not None:
                self._fail(outcome, task.cid, problem)
                continue
            self.store.put(task.cid, out.private)
            outcome.results.append(out.result)
        return outcome

    def _fail(self, outcome: RoundOutcome, cid: int, reason: str) -> None:
        outcome.failures.append(Failure(cid, reason))
        self.progress.message(f"warning: client {cid} excluded this round: {reason}")

    def _evaluate(self, rnd: int, outcome: RoundOutcome) -> dict[str, Any]:
        scores = evaluate_global(
            self.strategy, self.program, (self.x_test, self.y_test), self._stats_data
        )
        local_acc = self._local_eval(outcome, scores.groups)
        return metrics_row(rnd, outcome, scores, local_acc, self.counters)

    def _local_eval(
        self, outcome: RoundOutcome, groups: dict[str, dict[str, float | int]]
    ) -> float | None:
        mode = self.settings.local_eval
        if mode == "none":
            return None
        cids = [r.cid for r in outcome.results] if mode == "sampled" else list(self.store)
        evaluated: list[tuple[float, str | None]] = []
        for cid in cids:
            data = self.clients[cid]
            if data.y_test.numel() == 0:
                continue
            task = self.strategy.eval_task(self.infos[cid])
            correct, _, n = self.program.evaluate(task, data, self.store.get(cid))
            evaluated.append((correct / n, task.group))
        return mean_local_accuracy(evaluated, groups)

    def _stats_data(self) -> torch.Tensor:
        """A fixed, seeded subsample of all clients' training data for static-BN passes."""
        if self._stats_x is None:
            xs = torch.cat([self.clients[c].x_train for c in sorted(self.clients)])
            g = self._rng(0, SERVER, "stats-pass")
            idx = torch.randperm(xs.shape[0], generator=g)[: self.settings.stats_samples]
            self._stats_x = xs[idx.to(xs.device)]
        return self._stats_x

    # -- checkpoints --------------------------------------------------------------------
    def _fresh_start(self) -> int:
        if self.metrics.path.exists():
            self.metrics.path.unlink()
        return 1

    def _checkpoint(self, rnd: int) -> None:
        save_checkpoint(
            self.run_dir / "checkpoints",
            {
                "round": rnd,
                "seed": self.settings.seed,
                "strategy": self.strategy.state_dict(),
                "store": self.store.state_dict(),
                "counters": vars(self.counters).copy(),
            },
        )

    def _restore(self) -> int:
        ckpt = load_checkpoint(self.run_dir / "checkpoints")
        if ckpt["seed"] != self.settings.seed:
            raise ValueError(
                f"checkpoint was written with seed {ckpt['seed']}, config has {self.settings.seed}"
            )
        self.strategy.load_state_dict(ckpt["strategy"])
        self.store.load_state_dict(ckpt["store"])
        self.counters = Counters(**ckpt["counters"])
        self.metrics.truncate(ckpt["round"])
        self.progress.message(f"resuming after round {ckpt['round']}")
        return int(ckpt["round"])
