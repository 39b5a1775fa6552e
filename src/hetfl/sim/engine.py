"""One job: the in-process simulator, the round loop of `hetfl.engine.rounds` with clients
run in process.

The engine owns availability, execution, failures, costs, evaluation, checkpoints and the
run outputs; the strategy owns sampling, payloads, aggregation and what to evaluate; the
client program owns local training. An executor (`hetfl.sim.executor`; sequentially in
process by default) runs a round's clients, each from generators derived from (seed, round,
client, purpose); the engine then charges, checks, clocks and stores their outcomes once
each, in client-id order, and results reach `aggregate` sorted by client id, so a round's
outcome does not depend on execution order and a resumed run equals an uninterrupted one.

Counting conventions: `bytes_down` counts every payload sent; `bytes_up` every result a
client returned (an invalid one included: it crossed the network); in split learning both
also count what crossed the per-batch channel (activations and labels up, gradients down);
`macs` the training passes of every client that trained (a server side is priced for time
only). Evaluation traffic is measurement, not training, and is not counted. Private tensors
are never sent, so never counted.

With device profiles (`RoundSettings.system`), the clock (`hetfl.systems.clock`) turns each
client's MACs and bytes into seconds, drops clients past the deadline, adds the round's time
to `sim_time_s` and gives each client's times to the next `plan` in `ClientInfo.history`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hetfl.core.client.bn_statistics import BNStatistics, apply_bn_statistics
from hetfl.core.client.program import Programs
from hetfl.core.server.strategy import Strategy
from hetfl.core.server_program import ChannelCounts, ServerProgram, server_result_problem
from hetfl.core.spec import Spec
from hetfl.core.types import (
    ClientData,
    ClientInfo,
    ClientOutput,
    ClientTask,
    ClientTimes,
    DeviceRates,
    EvalModel,
    EvalSplit,
    EvalTask,
    Failure,
    PassRecord,
    Problem,
    State,
)
from hetfl.engine.global_eval import Score, Scoring, as_tested
from hetfl.engine.heap import trim_heap
from hetfl.engine.outputs import RowSink
from hetfl.engine.progress import Progress
from hetfl.engine.round_settings import RoundSettings
from hetfl.engine.rounds import RoundLoop, init_generator
from hetfl.engine.statistics import stats_shares
from hetfl.engine.steps import (
    Charge,
    LocalScore,
    RoundOutcome,
    charge_result,
    local_task,
    pooled_validation,
    run_pixels,
    task_bytes,
)
from hetfl.engine.store import ClientStore, StoreSettings
from hetfl.sim.eval_exchange import scoring_exchange, statistics_exchange
from hetfl.sim.executor import Executor, SequentialExecutor
from hetfl.sim.setup_queries import SetupAsk, ask_clients
from hetfl.sim.tasks import ClientJob, LocalScoreItem, TaskOutcome
from hetfl.systems.clock import Clock, Usage
from hetfl.systems.profiles import DeviceProfile, ProfileSchedule


class Simulation(RoundLoop):
    """Runs one configured experiment in process and writes the run-output contract."""

    def __init__(
        self,
        strategy: Strategy,
        programs: Programs,
        clients: Sequence[ClientData],
        test: tuple[torch.Tensor, torch.Tensor],
        settings: RoundSettings,
        run_dir: Path,
        info: dict[str, Any] | None = None,
        progress: Progress | None = None,
        attrs: Mapping[int, Mapping[str, Any]] | None = None,
        executor: Executor | None = None,
        store: StoreSettings | None = None,
        sinks: Sequence[RowSink] = (),
        setup_cache: Path | None = None,
    ) -> None:
        """`attrs` holds what each client declares about itself (an architecture, a device
        capacity); the strategy sees it in `ClientInfo.attrs`. `executor` runs each round's
        client trainings (`hetfl.sim.executor`; default: sequentially, in process).
        `store` bounds the client store's memory; entries over its budget spill into
        `run_dir/spill`, removed when `run` returns or raises (`hetfl.engine.store`).
        `sinks` receive the metrics rows too (experiment tracking); set-up answers are
        kept across runs in `setup_cache` (`hetfl.sim.setup_queries`; None: not kept)."""
        super().__init__(
            strategy,
            programs,
            test,
            settings,
            run_dir,
            info,
            progress,
            pooled_validation(clients),
            run_pixels(clients),
            sinks,
        )
        self.clients = {c.cid: c for c in clients}
        self.executor: Executor = executor or SequentialExecutor()
        declared = attrs or {}
        unknown = set(declared) - set(self.clients)
        if unknown:
            raise ValueError(f"attributes given for unknown clients {sorted(unknown)}")
        self.infos = {cid: c.info(declared.get(cid)) for cid, c in self.clients.items()}
        self._asked = False  # the strategy's set-up query (`known_clients`)
        self.setup_cache = setup_cache
        store = store or StoreSettings()
        spill_dir = None if store.memory_budget is None else self.run_dir / "spill"
        # One budget for everything held per client: a method with a server phase (FedGKT)
        # gives half of it to its pending downloads, so the two stores stay within it.
        private, pending = store, store
        if strategy.capabilities.server_phase and store.memory_budget is not None:
            half = store.memory_budget // 2
            private = StoreSettings(store.memory_budget - half)
            pending = StoreSettings(half)
        self.store = ClientStore(private, spill_dir)
        pending_dir = None if spill_dir is None else spill_dir / "downloads"
        self.downloads = ClientStore(pending, pending_dir)
        self.server_store = ClientStore()  # what server programs keep per client
        system = settings.system
        self.schedule = (
            None if system is None else ProfileSchedule(system, settings.seed, [*self.clients])
        )
        self.clock = None if system is None else Clock(system)
        #: Each client's times of the last round it trained (device profiles), checkpointed.
        self.history: dict[int, ClientTimes] = {}

    def setup(self) -> None:
        """The run's data to the executor (`Executor.share`), then the set-up, which asks."""
        if not self._ready:
            self.clients, test, self.validation = self.executor.share(
                (self.clients, (self.x_test, self.y_test), self.validation)
            )
            self.x_test, self.y_test = test
        super().setup()

    def run(self, resume: bool = False) -> dict[str, Any]:
        """Run (or continue) the experiment (set up first, `setup`); the client store's
        spill files are removed when it returns or raises (Ctrl-C included)."""
        try:
            return super().run(resume)
        finally:
            self.downloads.close()
            self.store.close()

    # -- the engine's hooks -------------------------------------------------------------
    def known_clients(self) -> list[ClientInfo]:
        """Every client, with its answer to the strategy's set-up query from its own data
        and a (seed, 0, client, "setup-query") generator, asked once, as units of the
        executor, kept in `setup_cache` (`hetfl.sim.setup_queries`); what it declared wins.
        Only the clients whose answers set-up reads are asked
        (`Capabilities.setup_query_clients`)."""
        caps = self.strategy.capabilities
        if caps.setup_query is not None and not self._asked:
            told = caps.setup_query_clients(
                list(self.infos.values()), init_generator(self.settings)
            )
            generators = {cid: self._rng(0, "setup-query", cid) for cid in sorted(told)}
            asked = SetupAsk(caps.setup_query, generators, self.setup_cache, told)
            self.infos = ask_clients(
                self.executor, self.programs, asked, self.infos, self.clients, self.progress
            )
        self._asked = True
        return list(self.infos.values())

    def available(self, rnd: int) -> list[ClientInfo]:
        """Each client is reachable with probability `availability` times its device
        profile's availability (one draw per client and round), and, with behaviour traces,
        only while its device's trace says so at the round's start on the simulated clock
        (when no device is reachable then, the clock moves on to the first that is). Under
        device profiles each reachable client's info carries its device this round."""
        profiles = {} if self.schedule is None else self.schedule.at(rnd)
        behaviours = None if self.settings.system is None else self.settings.system.behaviours
        now = self.counters.sim_time_s
        if behaviours is not None:  # nobody reachable: the server waits for the first one
            devices = [behaviours[profiles[cid].name] for cid in self.clients]
            now = self.counters.sim_time_s = min(b.next_available(now) for b in devices)
        out = []
        for cid in sorted(self.clients):
            if behaviours is not None and not behaviours[profiles[cid].name].available(now):
                continue
            p = self.settings.availability * (profiles[cid].availability if profiles else 1.0)
            if p >= 1.0 or float(torch.rand(1, generator=self._rng(rnd, "availability", cid))) < p:
                info = self.infos[cid]
                out.append(info if not profiles else replace(info, device=_rates(profiles[cid])))
        return out

    def train(self, rnd: int, tasks: list[ClientTask]) -> RoundOutcome:
        """Every client in id order through the executor; then, once per outcome and in
        the same order, the charges, checks, clock and store updates."""
        server = self.strategy.server_program(rnd, self.state, tasks) if tasks else None
        jobs = [self._job(rnd, task) for task in sorted(tasks, key=lambda t: t.cid)]
        done = self.executor.run(self.programs, jobs, self.clients, server)
        _check_outcomes(jobs, done)
        outcome = RoundOutcome(server_results=None if server is None else [])
        profiles = {} if self.schedule is None else self.schedule.at(rnd)
        settled = [(ran, self._settle(rnd, ran, server, profiles, outcome)) for ran in done]
        late = self._beyond_cohort(outcome, settled)
        for ran, output in settled:
            problem = output if isinstance(output, Problem) else late.get(ran.task.cid)
            if problem is not None:
                self._fail(outcome, ran.task.cid, problem)
            else:
                assert not isinstance(output, Problem)
                self._keep(ran, output, outcome)
        return outcome

    def _beyond_cohort(
        self, outcome: RoundOutcome, settled: Sequence[tuple[TaskOutcome, ClientOutput | Problem]]
    ) -> dict[int, Problem]:
        """Over-commitment (FedScale): of the valid results, the first `keep_first` to
        finish are kept (ties by client id); the later ones are dropped, the server having
        stopped waiting."""
        system = self.settings.system
        if system is None or system.keep_first is None:
            return {}
        done = sorted(
            (outcome.times[ran.task.cid].total_s, ran.task.cid)
            for ran, output in settled
            if not isinstance(output, Problem)
        )
        return {
            cid: Problem(
                "overcommitted", f"finished after the first {system.keep_first}: {t:.4g} s"
            )
            for t, cid in done[system.keep_first :]
        }

    def _keep(self, ran: TaskOutcome, out: ClientOutput, outcome: RoundOutcome) -> None:
        """Keep a valid result and the private state its client and server side return."""
        self.store.put(ran.task.cid, out.private)
        outcome.results.append(out.result)
        if ran.served is not None and outcome.server_results is not None:
            self.server_store.put(ran.task.cid, ran.served.private)
            outcome.server_results.append(ran.served)

    def _job(self, rnd: int, task: ClientTask) -> ClientJob:
        """What the executor needs to train `task`'s client: plain values, no engine."""
        data = self.clients[task.cid]
        batch = task.config.batch_size  # a batch the model trains on (BatchNorm needs two)
        step = self.macs.pass_macs(
            PassRecord(task.spec, "train", batch, 1), self._input_shape(task.cid)
        )
        return ClientJob(
            task,
            self.infos[task.cid],
            self.store.get(task.cid),
            self._rng(rnd, "train", task.cid),
            self.server_store.get(task.cid),
            cost=data.n_train * step / batch,
        )

    def _settle(
        self,
        rnd: int,
        ran: TaskOutcome,
        server: ServerProgram | None,
        profiles: Mapping[int, DeviceProfile],
        outcome: RoundOutcome,
    ) -> ClientOutput | Problem:
        """Charge one client's traffic and compute, check its result and clock it; returns
        its output (the loss its server side reported in it) or why it is excluded."""
        task = ran.task
        outcome.charge(task.cid, bytes_down=task_bytes(task))
        if ran.channel is not None:  # it crossed, whether the client failed or not
            channel = ran.channel
            outcome.charge(task.cid, bytes_down=channel.bytes_down, bytes_up=channel.bytes_up)
        if isinstance(ran.output, Problem):
            return ran.output
        out, served = ran.output, ran.served
        if served is not None and "loss" in served.metrics:  # the loss lives on the server
            out = replace(out, result=replace(out.result, loss=served.metrics["loss"]))
        problem = charge_result(outcome, self.macs, task, out.result, self._input_shape(task.cid))
        if served is not None:
            problem = problem or server_result_problem(served, task.cid)
        if self.clock is not None:
            usage = self._usage(ran, outcome.charges[task.cid], server)
            times = self.clock.client_times(rnd, task.spec, profiles[task.cid], usage)
            outcome.times[task.cid] = times
            lost = self.clock.lost_problem(times, self.counters.sim_time_s)
            problem = lost or self.clock.deadline_problem(times) or problem
        return out if problem is None else problem

    def _input_shape(self, cid: int) -> tuple[int, ...]:
        return tuple(self.clients[cid].x_train.shape[1:])

    def _usage(self, ran: TaskOutcome, charged: Charge, server: ServerProgram | None) -> Usage:
        """What one client consumed this round, for the clock: what it was charged (its
        payload, result and channel bytes, its training MACs) and its server side's MACs."""
        channel, served = ran.channel or ChannelCounts(), ran.served
        return Usage(
            macs=charged.macs,
            bytes_down=charged.bytes_down,
            bytes_up=charged.bytes_up,
            server_macs=0 if served is None else self.macs.price(served.passes, served.input_shape),
            parallel=server is not None and server.parallel,
            wall_s=ran.wall_s,
            server_wall_s=channel.server_wall_s,
        )

    def after_training(self, outcome: RoundOutcome) -> None:
        """Give the round's freed heap back (`hetfl.engine.heap`); advance the clock: add the
        round's time, and give each client's times to the next `plan`."""
        trim_heap()
        if self.clock is None:
            return
        # the server does not wait for a client that left or that it stopped waiting for
        gone = {f.cid for f in outcome.failures if f.kind in ("lost", "overcommitted")}
        waited = [t for cid, t in outcome.times.items() if cid not in gone]
        self.counters.sim_time_s += self.clock.round_time(waited)
        self.counters.sim_time_s += self.clock.phase_s(outcome.phase_macs, outcome.phase_wall_s)
        lost = {f.cid for f in outcome.failures if f.kind == "lost"}
        for cid, times in outcome.times.items():
            if cid not in lost:  # a client that left before finishing reports no times
                self._set_history(cid, times)

    def _set_history(self, cid: int, times: ClientTimes) -> None:
        self.history[cid] = times
        self.infos[cid] = replace(self.infos[cid], history=times)

    def _fail(self, outcome: RoundOutcome, cid: int, problem: Problem) -> None:
        outcome.failures.append(Failure.of(cid, problem))
        self.progress.message(f"warning: client {cid} excluded this round: {problem}")

    def sim_time_s(self) -> float | None:
        return None if self.clock is None else self.counters.sim_time_s

    def local_tasks(
        self,
        rnd: int,
        outcome: RoundOutcome,
        evaluated: Mapping[str, State],
        split: EvalSplit = "test",
        stats_pass: bool = False,
    ) -> list[EvalTask]:
        """Each sampled (or each ever trained) client on its own `split`, with its own
        private state."""
        mode = self.settings.local_eval
        cids = [r.cid for r in outcome.results] if mode == "sampled" else list(self.store)
        return [
            local_task(self.strategy, self.infos[cid], self.state, evaluated, split, stats_pass)
            for cid in cids
        ]

    def pooled_tasks(self, rnd: int, split: EvalSplit) -> list[EvalTask]:
        """Every client that has trained (it holds private state), by the strategy's
        pooled task, on its own `split` (or, "global", on the run's global test set)."""
        tasks = [self.strategy.pooled_task(self.infos[cid], self.state) for cid in self.store]
        return [replace(t, split=split) for t in tasks if t is not None]

    def score_clients(self, rnd: int, tasks: Sequence[EvalTask]) -> list[LocalScore]:
        """Each task through the executor (`score_client`), with its client's data and
        private state as the store holds it; clients whose split is empty are left out."""
        return self.score_round(rnd, [], [tasks])[1][0]

    def score_round(
        self, rnd: int, scorings: Sequence[Scoring], task_lists: Sequence[Sequence[EvalTask]]
    ) -> tuple[list[Score], list[list[LocalScore]]]:
        """The round's evaluation as one exchange of the executor
        (`hetfl.sim.eval_exchange`): each scoring in fixed batches, and each task's client
        with its data and private state as the store holds it (clients whose split is
        empty are left out)."""
        asked = [self._local_items(tasks) for tasks in task_lists]
        return scoring_exchange(self.executor, self.programs, scorings, asked, self.pixels)

    def _local_items(self, tasks: Sequence[EvalTask]) -> list[LocalScoreItem]:
        """The units of `tasks` whose client's split is not empty; a task on the global
        test set carries it with its client's data (`_scored_data`)."""
        items = [
            LocalScoreItem(task, self._scored_data(task), self.store.get(task.cid))
            for task in tasks
        ]
        return [item for item in items if item.data.split(item.task.split)[1].numel()]

    def _scored_data(self, task: EvalTask) -> ClientData:
        """`task`'s client's data, with the run's global test set attached when the task
        scores it (`ClientData.global_test`): views of the data the executor shares
        (`setup`), so a worker process receives references, not samples. A client whose
        inputs a view resized cannot take the global test images, and is refused by name."""
        data = self.clients[task.cid]
        if task.split != "global":
            return data
        own, shared = tuple(data.x_test.shape[1:]), tuple(self.x_test.shape[1:])
        if own != shared:
            raise ValueError(
                f"client {task.cid} takes inputs of shape {own}, but the global test set's "
                f"are {shared}: its model cannot be scored on the global test set "
                "(eval.pooled_global); drop the client view's resize or the option"
            )
        return replace(data, global_test=(self.x_test, self.y_test))

    def stats_passes(self, rnd: int, models: Sequence[EvalModel]) -> list[State]:
        """Every model's statistics pass in one exchange of the executor; see `stats_pass`."""
        totals = self._statistics([(em.name, em.spec, em.tensors) for em in models])
        passed = []
        for em, total in zip(models, totals, strict=True):
            model = self._loaded(em)
            apply_bn_statistics(model, total)
            passed.append(as_tested(model))
        return passed

    def stats_pass(self, rnd: int, model: nn.Module, em: EvalModel) -> None:
        """Static-BN statistics from every client's training data (or its share of
        `settings.stats_samples`), as `hetfl.engine.statistics` defines the pass: each
        client's part through the executor, the parts added in client-id order."""
        apply_bn_statistics(model, self._statistics([(em.name, em.spec, model.state_dict())])[0])

    def _statistics(self, models: Sequence[tuple[str, Spec, State]]) -> list[BNStatistics]:
        """The summed statistics of each (name, spec, tensors) model over every client's
        share, as one exchange of the executor (`hetfl.sim.eval_exchange`)."""
        sizes = {cid: data.n_train for cid, data in self.clients.items()}
        shares = {c: n for c, n in stats_shares(sizes, self.settings.stats_samples).items() if n}
        return statistics_exchange(
            self.executor,
            self.programs,
            models,
            self.clients,
            shares,
            self.settings.seed,
            self.pixels,
        )

    # -- checkpoints --------------------------------------------------------------------
    def checkpoint_extras(self) -> dict[str, Any]:
        """The stores as views, which the checkpoint streams one client at a time."""
        return {
            "store": self.store.entries(),
            "server_store": self.server_store.entries(),
            "downloads": self.downloads.entries(),
            "sim_times": dict(self.history),  # the entry's name in checkpoint format 3
        }

    def restore_extras(self, ckpt: dict[str, Any]) -> None:
        self.store.load_entries(ckpt["store"])
        self.server_store.load_entries(ckpt["server_store"])
        self.downloads.load_entries(ckpt.get("downloads", {}))
        for cid, times in ckpt.get("sim_times", {}).items():
            self._set_history(cid, times)


def _rates(profile: DeviceProfile) -> DeviceRates:
    """A device profile as the strategy sees it in `ClientInfo.device`."""
    return DeviceRates(profile.name, profile.rate, profile.down_mbps, profile.up_mbps)


def _check_outcomes(jobs: Sequence[ClientJob], done: Sequence[TaskOutcome]) -> None:
    """An executor must answer every job, in the jobs' (client-id) order: the engine
    charges and stores by position, and results reach `aggregate` in that order."""
    asked = [job.task.cid for job in jobs]
    answered = [ran.task.cid for ran in done]
    if answered != asked:
        raise RuntimeError(
            f"the executor returned outcomes for clients {answered}, but was asked for "
            f"clients {asked}: an Executor must return one TaskOutcome per job, in order"
        )
