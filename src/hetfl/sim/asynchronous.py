"""One job: the simulator with asynchronous aggregation (FedAsync, FedBuff) on the simulated
clock, `system.asynchronous` (`hetfl.systems.asynchrony`).

The round loop's "round" is a server step. `concurrency` clients are in flight: whenever a
slot is free, the strategy's `plan` is asked for the reachable idle clients at that moment
(with behaviour traces, reachable on the simulated clock) and the slots are filled from its
tasks, each carrying the model as it is then. A dispatched client trains at once, through
the executor (its result depends only on its task, its private state and its generator);
the clock prices its own sub-model's MACs and bytes on its device, so the moment the server
hears of it is known: when it finishes, or when its behaviour trace makes it unreachable
first (it is then lost, a `Failure` of kind "lost"), or at the deadline. These events are
taken in order of simulated time (ties by client id). FedAsync steps at every valid update,
FedBuff once `buffer_size` of them arrived; the step's outcome holds those updates and the
failures heard of since the last step, and `sim_time_s` is the moment of its last event.

Choices where the papers are silent: a client whose update (or loss) was heard of in a
server step is offered again only after that step, so a step holds one update per client;
when nothing is in flight and no idle client can be reached, the server waits for the
first device to become reachable, and when no client is idle at all it steps with the
updates it has. Each dispatch draws from its own generators, keyed by a dispatch count
(`"async-sample"`, `"async-dispatch"`, `"availability"`, `"train"`), so a run is a function
of the seed; the clients in flight are checkpointed with their results, so a resumed run
equals an uninterrupted one. Staleness (server steps between a client's download and the
step its update enters) is each trained client's `staleness` field in `clients.jsonl`.
Costs are counted at the step that hears of the client; the clients still in flight when
the run ends are not counted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hetfl.core.server.asynchronous import delta_uploads, moved
from hetfl.core.server.strategy import Aggregated
from hetfl.core.types import (
    ClientInfo,
    ClientOutput,
    ClientTask,
    ClientTimes,
    Problem,
    TrainedRound,
)
from hetfl.engine.heap import trim_heap
from hetfl.engine.steps import Charge, RoundOutcome
from hetfl.engine.trace import Scalar
from hetfl.sim.engine import Simulation
from hetfl.systems.asynchrony import AsyncSettings


@dataclass(frozen=True)
class InFlight:
    """A dispatched client: its task, the server step it was dispatched in, when it
    started, when the server hears of it (`event_s`), and what it will then deliver, as
    the engine settled it (its output or why it is excluded, its charge, its times)."""

    task: ClientTask
    step: int
    start_s: float
    event_s: float
    output: ClientOutput | Problem
    charge: Charge
    times: ClientTimes | None

    @property
    def order(self) -> tuple[float, int]:
        return (self.event_s, self.task.cid)


class AsyncSimulation(Simulation):
    """The simulator whose server steps as updates arrive (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        system = self.settings.system
        if system is None or system.asynchronous is None:
            raise ValueError(
                "AsyncSimulation needs system.asynchronous (and device profiles for its clock)"
            )
        if self.strategy.capabilities.needs_server_program:
            raise ValueError(
                "asynchronous aggregation cannot run a split-learning method (a server "
                "program or phase): it needs one update per client, aggregated elementwise"
            )
        self.rule: AsyncSettings = system.asynchronous
        if self.rule.concurrency > len(self.clients):
            raise ValueError(
                f"system.asynchronous.concurrency ({self.rule.concurrency}) exceeds the "
                f"{len(self.clients)} clients"
            )
        self.in_flight: list[InFlight] = []
        #: Dispatches so far: the key of each dispatch's generators.
        self.dispatches = 0
        #: Staleness of each client heard of in the current step.
        self._staleness: dict[int, int] = {}

    # -- a server step's updates --------------------------------------------------------
    def collect(self, rnd: int) -> tuple[list[ClientTask], RoundOutcome]:
        """Events in order of simulated time until the rule steps; refilled after each."""
        heard: list[InFlight] = []
        valid = 0
        with self.progress.phase("train", rnd):
            while not self.rule.steps_after(valid):
                self._fill(rnd, {e.task.cid for e in heard})
                if not self.in_flight:
                    break  # every client heard of in this step: step with what arrived
                event = min(self.in_flight, key=lambda e: e.order)
                self.in_flight.remove(event)
                self.counters.sim_time_s = max(self.counters.sim_time_s, event.event_s)
                heard.append(event)
                valid += not isinstance(event.output, Problem)
        return self._outcome(rnd, heard)

    def _outcome(
        self, rnd: int, heard: Sequence[InFlight]
    ) -> tuple[list[ClientTask], RoundOutcome]:
        """The step's outcome: updates kept (private state stored, times to the next plan),
        failures recorded, charges; and each client's staleness."""
        outcome = RoundOutcome()
        heard = sorted(heard, key=lambda e: e.task.cid)
        for event in heard:
            cid = event.task.cid
            outcome.charges[cid] = event.charge
            if event.times is not None:
                outcome.times[cid] = event.times
            if isinstance(event.output, Problem):
                self._fail(outcome, cid, event.output)
            else:
                self.store.put(cid, event.output.private)
                outcome.results.append(event.output.result)
            lost = isinstance(event.output, Problem) and event.output.kind == "lost"
            if event.times is not None and not lost:
                self._set_history(cid, event.times)
        self._staleness = {e.task.cid: rnd - e.step for e in heard}
        return [e.task for e in heard], outcome

    def _fill(self, rnd: int, heard: set[int]) -> None:
        """Dispatch reachable idle clients into the free slots, at the current moment."""
        while len(self.in_flight) < self.rule.concurrency:
            busy = heard | {e.task.cid for e in self.in_flight}
            idle = [cid for cid in sorted(self.clients) if cid not in busy]
            if not idle:
                return
            self.dispatches += 1
            reachable = self._reachable(rnd, idle)
            if reachable:
                if not self._dispatch(rnd, reachable):
                    return  # the strategy planned for nobody: wait for the next event
            elif self.in_flight:
                return  # the next event frees the clock
            else:
                self._wait_for(rnd, idle)

    def _reachable(self, rnd: int, idle: Sequence[int]) -> list[ClientInfo]:
        """The idle clients reachable now: by their behaviour trace, then by one draw of
        the run's availability (times their profile's) for this dispatch."""
        profiles = self.schedule.at(rnd) if self.schedule is not None else {}
        assert self.settings.system is not None
        behaviours = self.settings.system.behaviours
        now = self.counters.sim_time_s
        out = []
        for cid in idle:
            if behaviours is not None and not behaviours[profiles[cid].name].available(now):
                continue
            p = self.settings.availability * profiles[cid].availability
            draw = self._rng(self.dispatches, "availability", cid)
            if p >= 1.0 or float(torch.rand(1, generator=draw)) < p:
                out.append(self.infos[cid])
        return out

    def _wait_for(self, rnd: int, idle: Sequence[int]) -> None:
        """Nothing in flight and nobody reachable: the clock moves to the first moment an
        idle client's device is reachable (unchanged when one is, and only the draw of
        availability failed: the next dispatch draws again)."""
        assert self.settings.system is not None
        behaviours = self.settings.system.behaviours
        if behaviours is None:
            return
        profiles = self.schedule.at(rnd) if self.schedule is not None else {}
        now = self.counters.sim_time_s
        self.counters.sim_time_s = min(
            behaviours[profiles[cid].name].next_available(now) for cid in idle
        )

    def _dispatch(self, rnd: int, reachable: Sequence[ClientInfo]) -> int:
        """Plan for the reachable clients, keep as many tasks as slots are free (a seeded
        choice), train them and settle each into the clients in flight; how many."""
        key = self.dispatches
        tasks = self.strategy.plan(rnd, self.state, reachable, self._rng(key, "async-sample"))
        free = self.rule.concurrency - len(self.in_flight)
        if len(tasks) > free:
            order = torch.randperm(len(tasks), generator=self._rng(key, "async-dispatch"))
            tasks = [tasks[int(i)] for i in order[:free]]
        tasks = self._deliver(sorted(tasks, key=lambda t: t.cid))
        if not tasks:
            return 0
        jobs = [self._job(key, task) for task in tasks]
        done = self.executor.run(self.programs, jobs, self.clients, None)
        profiles = self.schedule.at(rnd) if self.schedule is not None else {}
        settled = RoundOutcome()
        now = self.counters.sim_time_s
        for ran in done:
            output = self._settle(rnd, ran, None, profiles, settled)
            cid = ran.task.cid
            times = settled.times.get(cid)
            heard_at = self._heard_at(now, output, times)
            charge = settled.charges[cid]
            self.in_flight.append(InFlight(ran.task, rnd, now, heard_at, output, charge, times))
        return len(done)

    def _heard_at(
        self, now: float, output: ClientOutput | Problem, times: ClientTimes | None
    ) -> float:
        """When the server hears of a client dispatched at `now`: when its device left (lost),
        at the deadline (missed it), when it finished, or at once (it raised: no time)."""
        if times is None:
            return now
        system = self.settings.system
        assert system is not None
        if isinstance(output, Problem) and output.kind == "lost":
            assert system.behaviours is not None
            until = system.behaviours[times.profile].available_until(now)
            return now if until is None else until
        if isinstance(output, Problem) and output.kind == "deadline":
            assert system.deadline_s is not None
            return now + system.deadline_s
        return now + times.total_s

    # -- the server step ----------------------------------------------------------------
    def combine(self, rnd: int, trained: TrainedRound) -> Aggregated:
        """FedAsync: the state mixed toward the method's aggregate of the one update with
        a * s(staleness); FedBuff: moved by server_lr toward the aggregate of the
        staleness-weighted deltas (`hetfl.core.server.asynchronous`)."""
        if not trained.trained:
            return Aggregated(dict(self.state), None)
        weights = [self.rule.weight(self._staleness[t.task.cid]) for t in trained.trained]
        if self.rule.mode == "fedasync":
            done = self.strategy.aggregate(rnd, self.state, trained)
            return done._replace(state=moved(self.state, done.state, weights[0]))
        uploads = delta_uploads(trained, self.state, weights)
        done = self.strategy.aggregate(rnd, self.state, uploads)
        return done._replace(state=moved(self.state, done.state, self.rule.server_lr))

    def after_training(self, outcome: RoundOutcome) -> None:
        """The clock moved with the events (`collect`); only the heap is given back."""
        trim_heap()

    def _fields_of(self) -> Callable[[int, ClientTask | None], dict[str, Scalar]]:
        """The declared fields, with each heard-of client's `staleness`."""
        declared = super()._fields_of()
        staleness = dict(self._staleness)

        def fields_of(cid: int, task: ClientTask | None) -> dict[str, Scalar]:
            fields = declared(cid, task)
            if task is not None and cid in staleness:
                fields["staleness"] = staleness[cid]
            return fields

        return fields_of

    # -- checkpoints --------------------------------------------------------------------
    def checkpoint_extras(self) -> dict[str, Any]:
        """The clients in flight with their settled results, and the dispatch count."""
        return {
            **super().checkpoint_extras(),
            "asynchronous": {"in_flight": list(self.in_flight), "dispatches": self.dispatches},
        }

    def restore_extras(self, ckpt: dict[str, Any]) -> None:
        super().restore_extras(ckpt)
        saved = ckpt.get("asynchronous")
        if saved is None:
            raise ValueError(
                "the checkpoint was written by a synchronous run; it cannot be resumed with "
                "system.asynchronous"
            )
        self.in_flight = list(saved["in_flight"])
        self.dispatches = int(saved["dispatches"])
