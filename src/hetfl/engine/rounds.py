"""One job: the round loop both engines run, one template with hooks for how clients are
reached.

`RoundLoop.run` is the orchestration loop of one round (docs/contracts.md §1.1), written
once. An engine (the simulator `hetfl.sim.Simulation`, the Flower adapter
`hetfl.deploy.server.FlowerServer`) subclasses it and supplies only what is really its own:

- `known_clients()`: the clients the strategy is set up with;
- `collect(rnd)` / `combine(rnd, trained)`: a round's tasks and outcome, and its
  aggregation (by default `available`, `plan`, `train`, and the strategy's `aggregate`;
  the asynchronous simulator, `hetfl.sim.asynchronous`, replaces both);
- `available(rnd)`: whom the strategy may plan for this round;
- `train(rnd, tasks)`: send the tasks, collect checked results and failures, charge each
  client its costs;
- `after_training(outcome)`: anything due once the round's results are aggregated and its
  server phase has run (the simulator advances its clock here);
- `stats_pass(rnd, model, em)`: static BatchNorm statistics for a model that needs them
  (`stats_passes`: those of every tested model of the round, one after the other unless
  the engine does them together);
- `local_tasks(rnd, outcome, evaluated, split, stats_pass)`: the task of each locally
  evaluated client on its local test split (or its validation split), after a statistics
  pass over its own training data when asked (`eval.stats_pass`);
- `score_clients(rnd, tasks)`: run given evaluation tasks on their clients (with
  `eval.local_trained`, each trained client's model of this round, `trained_eval_task`);
- `score_round(rnd, scorings, task_lists)`: a round's evaluation at once, the global
  models' scorings (`hetfl.engine.global_eval`) and the clients' evaluation tasks (the
  simulator in one exchange of its executor; by default one after the other);
- `pooled_tasks(rnd, split)`: every trained client's task on its own split (or, split
  "global", on the global test set) by the strategy's pooled task, for methods without a
  single global model whose clients share one (FedGKT's `pooled_acc`, and its `global_acc`
  with `eval.pooled_global`; only the simulator has it);
- `sim_time_s()`: the simulated time for the metrics row (None without a clock);
- `checkpoint_extras()` / `restore_extras(ckpt)` / `check_checkpoint(ckpt)`: the engine's
  own checkpoint entries, and whether it can continue a given checkpoint.

Everything else (plan, pending downloads delivered with the tasks, aggregate, the
strategy's server phase, evaluate, record, observe, progress, checkpoint, resume) is here,
in one order, so both engines write the same `metrics.jsonl`, `clients.jsonl` (the
per-client trace, `hetfl.engine.trace`) and `summary.json`.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hetfl.core.client.program import Programs
from hetfl.core.client.scoring import evaluate_model
from hetfl.core.model_cache import ModelCache
from hetfl.core.pixels import PixelNorm
from hetfl.core.rng import SERVER, torch_generator
from hetfl.core.server.strategy import Aggregated, Strategy
from hetfl.core.types import (
    ClientInfo,
    ClientTask,
    EvalModel,
    EvalSplit,
    EvalTask,
    State,
    TrainedRound,
)
from hetfl.engine.breakdown import add_round as count_beyond
from hetfl.engine.breakdown import breakdown_summary
from hetfl.engine.checkpoint import load_checkpoint, save_checkpoint
from hetfl.engine.decisions import add_round, defence_row, defence_summary
from hetfl.engine.evaluation_plan import EvaluationPlan, build_plan, run_plan
from hetfl.engine.global_eval import Score, Scoring, as_tested
from hetfl.engine.outputs import JsonLines, MetricsLog, RowSink, summarise, write_json
from hetfl.engine.progress import Progress
from hetfl.engine.round_settings import RoundSettings, StatsPassRule
from hetfl.engine.steps import (
    Counters,
    LanguageScores,
    LocalScore,
    Pooled,
    RoundOutcome,
    every_client_failed,
    mean_local_scores,
    metrics_row,
    trained_eval_task,
)
from hetfl.engine.store import ClientStore
from hetfl.engine.trace import Scalar, TracedProgram, checked_fields, trace_rows
from hetfl.systems.costs import MacCounter


def init_generator(settings: RoundSettings) -> torch.Generator:
    """The run's "init" generator, the one `Strategy.setup` draws the assignment and the
    initial state from."""
    return torch_generator(settings.seed, 0, SERVER, "init")


def setup_strategy(strategy: Strategy, clients: list[ClientInfo], settings: RoundSettings) -> State:
    """Assign specs; the initial global state, from the run's "init" generator."""
    return strategy.setup(clients, init_generator(settings), rounds=settings.rounds)


class RoundLoop(ABC):
    """One run of `settings.rounds` rounds into `run_dir`; an engine supplies the hooks."""

    def __init__(
        self,
        strategy: Strategy,
        programs: Programs,
        test: tuple[torch.Tensor, torch.Tensor],
        settings: RoundSettings,
        run_dir: Path,
        info: dict[str, Any] | None = None,
        progress: Progress | None = None,
        validation: Pooled = (),
        pixels: PixelNorm | None = None,
        sinks: Sequence[RowSink] = (),
    ) -> None:
        """`validation` holds all clients' validation samples (`pooled_validation`; empty
        without `data.validation`). `pixels` standardises the test and validation inputs
        when they are stored pixels (`run_pixels`). `sinks` receive every metrics row as
        `metrics.jsonl` does (experiment tracking, `hetfl.engine.tracking`)."""
        self.strategy = strategy
        self.programs = programs
        self.eval_models = ModelCache(programs.family, programs.device)
        self.x_test, self.y_test = test
        #: A language model's task (token inputs): its rows carry perplexities.
        self._tokens = self.x_test.dtype == torch.int64
        #: A detector's task (its recipe scores mAP): its rows carry mAPs.
        self._detects = programs.recipe.scoring is not None
        #: Each registered probe's samples (`hetfl.core.probe`: a backdoor's triggered test
        #: images for `attack_success`), by its metric.
        self.probe_samples = {p.metric: p.samples(*test) for p in settings.probes}
        self.validation = validation
        self.pixels = pixels
        self.settings = settings
        self.run_dir = Path(run_dir)
        self.info = dict(info or {})
        self.progress = progress or Progress(settings.rounds, enabled=False)
        self.counters = Counters()
        self.macs = MacCounter(programs.family)
        self.metrics = MetricsLog(self.run_dir / "metrics.jsonl", sinks)
        self.trace = JsonLines(self.run_dir / "clients.jsonl")
        #: The global state: the engine holds it and passes it through the strategy's verbs.
        self.state: State = {}
        #: What every evaluated round scores, built at set-up (`setup`).
        self.plan: EvaluationPlan
        #: Pending downloads: what a server phase answered each client, until its next task
        #: (`hetfl.core.server.phase`; an engine may give it a memory budget).
        self.downloads = ClientStore()
        system = settings.system
        if system is not None:
            self.info["sim_clock"] = {"mode": system.clock, "reproducible": system.reproducible}
        self._ready = False

    def setup(self) -> None:
        """Assign specs and initialise the global state (once; `run` calls it if needed)."""
        if not self._ready:
            with self.progress.phase("setup", about="the strategy's set-up"):
                self.state = setup_strategy(self.strategy, self.known_clients(), self.settings)
            tested = self.strategy.eval_models(self.state)
            self.plan = build_plan(
                self.settings,
                has_global=bool(tested),
                pooled=self.strategy.capabilities.scores_pooled,
                split_model=self.strategy.capabilities.needs_server_program,
                validation=bool(self.validation),
                static_bn=any(em.stats_pass for em in tested)
                and not any(n.endswith("running_mean") for n in self.state),
                method=str(self.info.get("algorithm", "this method")),
            )
            self.info["evaluation"] = {
                "global_stats_pass": self.settings.global_stats_pass,
                "require_global_test": self.settings.require_global_test,
                "plan": self.plan.names(),
            }
            described = self.strategy.describe()
            if described:
                self.info["strategy"] = described
            self._ready = True

    # -- the loop -----------------------------------------------------------------------
    def run(self, resume: bool = False) -> dict[str, Any]:
        """Run (or continue) to `settings.rounds`; returns the summary."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.setup()
        try:
            first = self._restore() + 1 if resume else self._fresh_start()
            for rnd in range(first, self.settings.rounds + 1):
                started, start_s = time.perf_counter(), self.sim_time_s()
                # Steps 1-2: plan, then local work -- results validated, in client id order.
                tasks, outcome = self.collect(rnd)
                self.counters.count_round(outcome)
                if outcome.failures and not outcome.results:
                    self.progress.message(every_client_failed(rnd, outcome))
                trained = outcome.trained_round(tasks)
                evaluating = self.settings.is_eval_round(rnd)
                before: list[LocalScore] = []
                if evaluating and self.plan.scores_trained:
                    with self.progress.phase("eval", rnd):
                        before = self.trained_scores(rnd, trained)
                # Step 3: aggregate -- all valid results at once with their tasks, by client id.
                aggregated = self.combine(rnd, trained)
                self.state, outcome.defence = aggregated.state, aggregated.defence
                add_round(self.counters.defence, outcome.defence, self.settings.malicious)
                count_beyond(self.counters.breakdown, aggregated.beyond)
                # Step 3b: the strategy's server phase, on every valid upload of the round.
                with self.progress.phase("server_phase", rnd):
                    self._server_phase(rnd, trained, outcome)
                self.after_training(outcome)
                # Step 4: evaluate and record (on the simulated clock: now that it has moved).
                evaluating = self.settings.is_eval_step(rnd, start_s, self.sim_time_s())
                row: dict[str, Any] | None = None
                local: list[LocalScore] = []
                if evaluating:
                    with self.progress.phase("eval", rnd):
                        row, local = self.evaluate(rnd, outcome, before)
                self.counters.wall_time_s += time.perf_counter() - started
                if row is not None:
                    row["wall_time_s"] = round(self.counters.wall_time_s, 3)
                    self.metrics.append(row)
                    self.strategy.observe(rnd, row)
                fields = self._fields_of()
                self.trace.append(trace_rows(rnd, tasks, outcome, local, fields, before))
                self.progress.round(rnd, row)
                # Step 5: checkpoint.
                if self.settings.is_checkpoint_round(rnd):
                    self._checkpoint(rnd)
        finally:
            # An interrupt too: the bar gives the terminal back, the sinks flush.
            self.progress.close()
            self.metrics.close()
        summary = summarise(
            self.metrics.read(),
            self.settings.targets,
            self.info,
            failures=self.counters.failures,
            rounds_aggregated=self.counters.rounds_aggregated,
            defence=defence_summary(self.counters.defence, bool(self.settings.malicious)),
            breakdown=breakdown_summary(self.counters.breakdown),
            phases=self.progress.phases.record(),
        )
        write_json(self.run_dir / "summary.json", summary)
        return summary

    def evaluate(
        self, rnd: int, outcome: RoundOutcome, trained: Sequence[LocalScore] = ()
    ) -> tuple[dict[str, Any], list[LocalScore]]:
        """The round's metrics row (without `wall_time_s`) by the run's evaluation plan
        (`hetfl.engine.evaluation_plan`), with the mean of the `trained` clients' scores
        (`trained_scores`) as `local_acc_trained`; and each locally evaluated client's score
        on its test split, for the trace."""
        done = run_plan(self.plan, self, rnd, outcome)
        row = metrics_row(
            rnd,
            outcome,
            done.scores,
            done.local_acc,
            self.counters,
            self.sim_time_s(),
            local_acc_stats=done.local_acc_stats,
            local_acc_trained=mean_local_scores(trained)[0],
            defence=defence_row(outcome.defence, self.settings.malicious),
            language=LanguageScores(done.local, trained) if self._tokens else None,
            detection=self._detects,
        )
        return row, done.local

    def trained_scores(self, rnd: int, trained: TrainedRound) -> list[LocalScore]:
        """Each trained client's model of this round, before aggregation, on its local test
        split (`eval.local_trained`): the task `trained_eval_task` gives, the same for every
        method, run by the engine's `score_clients`. Not counted in `macs`."""
        infos = {info.cid: info for info in self.known_clients()}
        tasks = [
            trained_eval_task(t.task, t.result, infos[t.task.cid], self.eval_models)
            for t in trained.trained
        ]
        return self.score_clients(rnd, tasks)

    def _fields_of(self) -> Callable[[int, ClientTask | None], dict[str, Scalar]]:
        """A client's declared trace fields: the strategy's (`Strategy.trace_fields`), then
        its client program's (`TracedProgram`); a name declared by both is an error."""
        infos = {info.cid: info for info in self.known_clients()}

        def fields_of(cid: int, task: ClientTask | None) -> dict[str, Scalar]:
            fields = checked_fields(self.strategy.trace_fields(infos[cid], task), "the strategy")
            program = self.programs.program_for(cid)
            if isinstance(program, TracedProgram):
                own = checked_fields(program.trace_fields(), f"client {cid}'s program")
                clash = sorted(own.keys() & fields.keys())
                if clash:
                    raise ValueError(
                        f"trace fields {clash} of client {cid} are declared by both the "
                        "strategy and its client program; rename one"
                    )
                fields.update(own)
            return fields

        return fields_of

    # -- the engine's hooks -------------------------------------------------------------
    def collect(self, rnd: int) -> tuple[list[ClientTask], RoundOutcome]:
        """A round's tasks and their outcome: whom to ask and what to send (`available`,
        the strategy's `plan`, pending downloads), then the local work (`train`). An
        engine that aggregates asynchronously (`hetfl.sim.asynchronous`) answers with the
        updates that arrived for this server step instead."""
        available = self.available(rnd)
        tasks = self.strategy.plan(rnd, self.state, available, self._rng(rnd, "sample"))
        tasks = self._deliver(tasks)
        with self.progress.phase("train", rnd):
            return tasks, self.train(rnd, tasks)

    def combine(self, rnd: int, trained: TrainedRound) -> Aggregated:
        """The new global state from the round's valid results: the strategy's
        `aggregate` (an asynchronous engine applies its server step through it)."""
        return self.strategy.aggregate(rnd, self.state, trained)

    @abstractmethod
    def known_clients(self) -> list[ClientInfo]:
        """The clients the strategy is set up with."""

    @abstractmethod
    def available(self, rnd: int) -> list[ClientInfo]:
        """The clients the strategy may plan for in round `rnd`."""

    @abstractmethod
    def train(self, rnd: int, tasks: list[ClientTask]) -> RoundOutcome:
        """Run the tasks; every valid result in client id order, each asked client's
        costs charged to it (`RoundOutcome.charge`; the loop adds them to the counters)."""

    @abstractmethod
    def stats_pass(self, rnd: int, model: nn.Module, em: EvalModel) -> None:
        """Set `model`'s BatchNorm statistics from clients' training data."""

    def stats_passes(self, rnd: int, models: Sequence[EvalModel]) -> list[State]:
        """Each model's tensors after its statistics pass (`stats_pass`), in order; an
        engine may run the passes of the round's models together."""
        passed = []
        for em in models:
            model = self._loaded(em)
            self.stats_pass(rnd, model, em)
            passed.append(as_tested(model))
        return passed

    def tested_models(self, rnd: int, stats_pass: StatsPassRule = "auto") -> list[EvalModel]:
        """The strategy's models to test this round (`Strategy.eval_models`), each with its
        tensors as the model of its spec holds them, after its statistics pass when it has
        one (every such model's pass first, `stats_passes`); `stats_pass` "on" or "off"
        gives every model one, or none, whatever the method asks (the protocol's rule)."""
        models = self.strategy.eval_models(self.state)
        if stats_pass != "auto":
            models = [replace(em, stats_pass=stats_pass == "on") for em in models]
        passed = iter(self.stats_passes(rnd, [em for em in models if em.stats_pass]))
        return [
            replace(em, tensors=next(passed) if em.stats_pass else as_tested(self._loaded(em)))
            for em in models
        ]

    def score_round(
        self, rnd: int, scorings: Sequence[Scoring], task_lists: Sequence[Sequence[EvalTask]]
    ) -> tuple[list[Score], list[list[LocalScore]]]:
        """A round's evaluation: each scoring's (correct, summed loss, count), and each list
        of client tasks scored (`score_clients`), in order. Here: the scorings in this
        process (`evaluate_model`), then each list; an engine may run them all at once."""
        answers = [
            evaluate_model(self._loaded(s.model), s.x, s.y, pixels=self.pixels) for s in scorings
        ]
        return answers, [self.score_clients(rnd, tasks) for tasks in task_lists]

    def _loaded(self, em: EvalModel) -> nn.Module:
        """The evaluation cache's model of `em.spec`, holding `em.tensors`."""
        model = self.eval_models.model_for(em.spec)
        model.load_state_dict(em.tensors, strict=True)
        return model

    @abstractmethod
    def local_tasks(
        self,
        rnd: int,
        outcome: RoundOutcome,
        evaluated: Mapping[str, State],
        split: EvalSplit = "test",
        stats_pass: bool = False,
    ) -> list[EvalTask]:
        """The task of each client evaluated on its own `split` (its local test split or
        its validation split), as `settings.local_eval` ("sampled" or "all") asks, each the
        one `local_task(...)` gives (`strategy.eval_task`; `evaluated`: the round's
        globally evaluated models, as tested, by name; `stats_pass`: the client's statistics
        pass first)."""

    @abstractmethod
    def score_clients(self, rnd: int, tasks: Sequence[EvalTask]) -> list[LocalScore]:
        """Each task's client scored on the split its task names, with its private state
        (clients with an empty split, or that do not answer, left out), in the tasks'
        order."""

    def pooled_tasks(self, rnd: int, split: EvalSplit) -> list[EvalTask]:
        """The task of each client that has trained, judged on its own `split` by the
        strategy's pooled task (`Strategy.pooled_task`); an engine that cannot says so."""
        raise RuntimeError(
            f"{type(self).__name__} cannot evaluate a method judged by its pooled task "
            "(Capabilities.scores_pooled: on its clients' own splits, or with "
            "eval.pooled_global on the global test set, which this engine's clients do not "
            "hold); run it in the simulator"
        )

    def after_training(self, outcome: RoundOutcome) -> None:  # noqa: B027 (optional hook)
        """Called once the round's results are aggregated and its server phase has run,
        before evaluation."""

    def sim_time_s(self) -> float | None:
        """The simulated time for the metrics row; None where there is no clock."""
        return None

    def checkpoint_extras(self) -> dict[str, Any]:
        """The engine's own checkpoint entries."""
        return {}

    def check_checkpoint(self, ckpt: dict[str, Any]) -> None:  # noqa: B027 (optional hook)
        """Raise if this engine cannot continue `ckpt` (before anything is restored)."""

    def restore_extras(self, ckpt: dict[str, Any]) -> None:  # noqa: B027 (optional hook)
        """Restore what `checkpoint_extras` saved."""

    # -- shared steps -------------------------------------------------------------------
    def _rng(self, rnd: int, purpose: str, cid: int = SERVER) -> torch.Generator:
        return torch_generator(self.settings.seed, rnd, cid, purpose)

    def _deliver(self, tasks: list[ClientTask]) -> list[ClientTask]:
        """Each task with its client's pending download, which leaves the store: it is
        counted in `bytes_down` in this round, whether the client then succeeds or not."""
        return [
            replace(task, download=self.downloads.pop(task.cid))
            if task.cid in self.downloads
            else task
            for task in tasks
        ]

    def _server_phase(self, rnd: int, trained: TrainedRound, outcome: RoundOutcome) -> None:
        """Run the strategy's server phase (here, in the engine's process, at the run's
        thread count, whatever the executor), keep its downloads pending and price its
        passes for the clock."""
        started = time.perf_counter()
        done = self.strategy.run_phase(rnd, self.state, trained, self._rng(rnd, "server-phase"))
        if done is None:
            return
        self.state = done.state
        for cid, download in sorted(done.downloads.items()):
            self.downloads.put(cid, download)
        outcome.phase_macs = self.macs.price(done.passes, done.input_shape)
        outcome.phase_wall_s = time.perf_counter() - started

    def _fresh_start(self) -> int:
        self.metrics.clear()
        self.trace.clear()
        return 1

    def _checkpoint(self, rnd: int) -> None:
        save_checkpoint(
            self.run_dir / "checkpoints",
            {
                "round": rnd,
                "seed": self.settings.seed,
                "config": self.settings.config,
                "global": self.state,
                "strategy": self.strategy.extra_state(),
                **self.checkpoint_extras(),
                "malicious": sorted(self.settings.malicious),
                "counters": vars(self.counters).copy(),
            },
        )

    def _restore(self) -> int:
        ckpt = load_checkpoint(self.run_dir / "checkpoints")
        self.check_checkpoint(ckpt)
        if ckpt["seed"] != self.settings.seed:
            raise ValueError(
                f"checkpoint was written with seed {ckpt['seed']}, config has {self.settings.seed}"
            )
        saved = set(ckpt.get("malicious", []))
        if saved != set(self.settings.malicious):
            raise ValueError(
                f"the checkpoint's malicious clients {sorted(saved)} differ from the ones drawn "
                f"again {sorted(self.settings.malicious)} (a changed attack.fraction, seed or "
                "number of clients?); resume with the run's config"
            )
        self.state = dict(ckpt["global"])
        self.strategy.load_extra_state(ckpt["strategy"])
        self.restore_extras(ckpt)
        self.counters = Counters(**ckpt["counters"])
        self.metrics.truncate(ckpt["round"])
        self.trace.truncate(ckpt["round"])
        self.progress.message(f"resuming after round {ckpt['round']}")
        return int(ckpt["round"])
