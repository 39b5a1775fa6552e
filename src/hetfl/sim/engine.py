"""The in-process simulator: one orchestration loop over the strategy protocol.

The engine owns availability, execution, failures, costs, evaluation, checkpoints and the
run outputs; the strategy owns sampling, payloads, aggregation and what to evaluate; the
client program owns local training. Clients run sequentially, each from generators derived
from (seed, round, client, purpose), and results reach `aggregate` sorted by client id, so a
round's outcome does not depend on execution order and a resumed run equals an
uninterrupted one.

Counting conventions: `bytes_down` counts every payload sent; `bytes_up` every result a
client returned (an invalid one included: it crossed the network); in split learning both
also count what crossed the per-batch channel (activations and labels up, gradients down);
`macs` the training passes of every client that trained (a server side is priced for time
only). Evaluation traffic is measurement, not training, and is not counted. Private tensors
are never sent, so never counted.

With device profiles (`SimulationSettings.system`), the clock (`hetfl.systems.clock`) turns each
client's MACs and bytes into seconds, drops clients past the deadline, adds the round's time
to `sim_time_s` and gives each client's times to the next `plan` in
`ClientInfo.attrs["sim_times"]`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from hetfl.core.client import ClientProgram, recompute_bn_statistics
from hetfl.core.rng import SERVER, torch_generator
from hetfl.core.server_program import Channel, ServerProgram, ServerResult, server_result_problem
from hetfl.core.state import state_bytes
from hetfl.core.store import ClientStore
from hetfl.core.strategy import Strategy
from hetfl.core.types import (
    ClientData,
    ClientResult,
    ClientTask,
    ClientTimes,
    EvalModel,
    Failure,
)
from hetfl.sim.checkpoint import load_checkpoint, save_checkpoint
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
from hetfl.systems.clock import Clock, Usage
from hetfl.systems.costs import MacCounter
from hetfl.systems.profiles import ProfileSchedule, SystemSettings

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
    system: SystemSettings | None = None

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
        self.server_store = ClientStore()  # what server programs keep per client
        self.counters = Counters()
        self.macs = MacCounter(program.family)
        system = settings.system
        self.schedule = (
            None if system is None else ProfileSchedule(system, settings.seed, [*self.clients])
        )
        self.clock = None if system is None else Clock(system)
        self.sim_times: dict[int, ClientTimes] = {}
        if system is not None:
            self.info["sim_clock"] = {"mode": system.clock, "reproducible": system.reproducible}
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
            split = (
                {} if outcome.server_results is None else {"server_results": outcome.server_results}
            )
            self.strategy.global_state = self.strategy.aggregate(
                rnd, outcome.results, outcome.failures, **split
            )
            self._advance_clock(outcome)
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
        """Each client is reachable with probability `availability` times its device
        profile's availability (one draw per client and round)."""
        profiles = {} if self.schedule is None else self.schedule.at(rnd)
        out = []
        for cid in sorted(self.clients):
            p = self.settings.availability * (profiles[cid].availability if profiles else 1.0)
            if p >= 1.0 or float(torch.rand(1, generator=self._rng(rnd, cid, "availability"))) < p:
                out.append(self.infos[cid])
        return out

    def _run_clients(self, rnd: int, tasks: list) -> RoundOutcome:
        outcome = RoundOutcome()
        server = self.strategy.server_program(rnd, tasks) if tasks else None
        if server is not None:
            outcome.server_results = []
        profiles = {} if self.schedule is None else self.schedule.at(rnd)
        for task in sorted(tasks, key=lambda t: t.cid):
            data = self.clients[task.cid]
            self.counters.bytes_down += state_bytes(task.payload)
            session = None if server is None else server.open(task, self.server_store.get(task.cid))
            channel = None if session is None else Channel(session)
            linked = {} if channel is None else {"channel": channel}
            started = time.perf_counter()
            try:
                out = self.program.fit(
                    task,
                    data,
                    self.store.get(task.cid),
                    self._rng(rnd, task.cid, "train"),
                    **linked,
                )
            except Exception as exc:  # a failing client must not stop the run
                self._charge_channel(channel)
                self._fail(outcome, task.cid, f"raised {type(exc).__name__}: {exc}")
                continue
            wall_s = time.perf_counter() - started
            served = None if session is None else session.close()
            self._charge_channel(channel)
            problem = charge_result(
                self.counters, self.macs, task, out.result, tuple(data.x_train.shape[1:])
            )
            if served is not None:
                problem = problem or server_result_problem(served, task.cid)
            if self.clock is not None:
                usage = self._usage(task, out.result, channel, served, server, wall_s)
                times = self.clock.client_times(rnd, task.spec, profiles[task.cid], usage)
                outcome.times[task.cid] = times
                problem = self.clock.deadline_problem(times) or problem
            if problem is not None:
                self._fail(outcome, task.cid, problem)
                continue
            self.store.put(task.cid, out.private)
            outcome.results.append(out.result)
            if served is not None and outcome.server_results is not None:
                self.server_store.put(task.cid, served.private)
                outcome.server_results.append(served)
        return outcome

    def _charge_channel(self, channel: Channel | None) -> None:
        """Count what crossed a split-learning channel (it crossed even if the client failed)."""
        if channel is not None:
            self.counters.bytes_up += channel.bytes_up
            self.counters.bytes_down += channel.bytes_down

    def _usage(
        self,
        task: ClientTask,
        result: ClientResult,
        channel: Channel | None,
        served: ServerResult | None,
        server: ServerProgram | None,
        wall_s: float,
    ) -> Usage:
        """What one client consumed this round, for the clock."""
        shape = tuple(self.clients[task.cid].x_train.shape[1:])
        return Usage(
            macs=self.macs.price(result.passes, shape),
            bytes_down=state_bytes(task.payload) + (channel.bytes_down if channel else 0),
            bytes_up=state_bytes(result.tensors) + (channel.bytes_up if channel else 0),
            server_macs=0 if served is None else self.macs.price(served.passes, served.input_shape),
            parallel=server is not None and server.parallel,
            wall_s=wall_s,
            server_wall_s=channel.server_wall_s if channel else 0.0,
        )

    def _advance_clock(self, outcome: RoundOutcome) -> None:
        """Add the round's time, and give each client's times to the next `plan`."""
        if self.clock is None:
            return
        self.counters.sim_time_s += self.clock.round_time(outcome.times.values())
        for cid, times in outcome.times.items():
            self._set_times(cid, times)

    def _set_times(self, cid: int, times: ClientTimes) -> None:
        self.sim_times[cid] = times
        info = self.infos[cid]
        self.infos[cid] = replace(info, attrs={**info.attrs, "sim_times": times})

    def _fail(self, outcome: RoundOutcome, cid: int, reason: str) -> None:
        outcome.failures.append(Failure(cid, reason))
        self.progress.message(f"warning: client {cid} excluded this round: {reason}")

    def _evaluate(self, rnd: int, outcome: RoundOutcome) -> dict[str, Any]:
        scores = evaluate_global(
            self.strategy, self.program, (self.x_test, self.y_test), self._stats_pass
        )
        local_acc = self._local_eval(outcome, scores.groups)
        sim_time_s = None if self.clock is None else self.counters.sim_time_s
        return metrics_row(rnd, outcome, scores, local_acc, self.counters, sim_time_s)

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

    def _stats_pass(self, model: nn.Module, em: EvalModel) -> None:
        """Static-BN statistics over a fixed subsample of all clients' training data."""
        recompute_bn_statistics(model, self._stats_data())

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
                "server_store": self.server_store.state_dict(),
                "sim_times": dict(self.sim_times),
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
        self.server_store.load_state_dict(ckpt.get("server_store", {}))
        for cid, times in ckpt.get("sim_times", {}).items():
            self._set_times(cid, times)
        self.counters = Counters(**ckpt["counters"])
        self.metrics.truncate(ckpt["round"])
        self.progress.message(f"resuming after round {ckpt['round']}")
        return int(ckpt["round"])
