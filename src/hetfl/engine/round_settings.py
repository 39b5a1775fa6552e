"""How a run's rounds go (`RoundSettings`): the engine-independent settings both engines'
round loops (`hetfl.engine.rounds.RoundLoop`) read, validated once when built."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from hetfl.core.probe import Probe
from hetfl.engine.outputs import PROBE_METRICS, Target
from hetfl.systems.profiles import SystemSettings

LocalEval = Literal["sampled", "all", "none"]
#: Whether the models scored as `global_acc` or `pooled_acc` get their BatchNorm statistics
#: pass: as each method asks (`auto`), or forced on or off for every method
#: (`eval.global_stats_pass`, one protocol imposable on a comparison).
StatsPassRule = Literal["auto", "on", "off"]


@dataclass(frozen=True)
class RoundSettings:
    """How a run's rounds go, for either engine. `availability` and `system` drive the
    simulator only (the Flower adapter warns when they are set). `stats_samples` is the
    size of the static-BN statistics pass's subsample, None for every client's whole
    training set (`hetfl.engine.statistics`). `local_stats_pass` also scores every locally
    evaluated client after re-estimating its BatchNorm statistics on its own training data
    (`local_acc_stats`). `local_trained` adds `local_acc_trained` to
    evaluated rounds (`RoundLoop.trained_scores`). `malicious` are the clients of an attacked
    run that attack (`hetfl.attacks.malicious`), fixed for the run: the checkpoint records
    them and a resume with another set is refused. `probes` are what parts outside the engines
    registered to be scored with the global test set (`hetfl.core.probe`: a backdoor's
    `attack_success`), each under its own metric. `global_stats_pass` is the evaluation
    protocol's rule for the statistics pass of the scored global models (`StatsPassRule`);
    `require_global_test` refuses, at set-up, a method that scores nothing on the global
    test set. `pooled_global` scores a method without one global model whose clients share
    one (FedGKT: `Strategy.pooled_task`) on the global test set as `global_acc`, each
    client's joined model, unweighted over clients; `require_global_test` asks it too.
    `eval_every_sim_s` evaluates on the simulated clock instead of every `eval_every`
    rounds: after each step during which the clock passed a multiple of it, so that runs
    whose steps last different simulated times (a synchronous round, FedBuff's or FedAsync's
    step) are scored on one grid of the axis they are compared on. `config`
    is the resolved config's YAML, stored in every checkpoint so that `hetfl resume` can
    refuse a config edited since in what determines the results (`hetfl.config.resume`)."""

    rounds: int
    seed: int
    eval_every: int = 1
    checkpoint_every: int = 1
    local_eval: LocalEval = "sampled"
    availability: float = 1.0
    targets: tuple[Target, ...] = ()
    stats_samples: int | None = None
    system: SystemSettings | None = None
    local_stats_pass: bool = False
    local_trained: bool = False
    malicious: frozenset[int] = frozenset()
    probes: tuple[Probe, ...] = ()
    global_stats_pass: StatsPassRule = "auto"
    require_global_test: bool = False
    pooled_global: bool = False
    eval_every_sim_s: float | None = None
    config: str = ""

    def __post_init__(self) -> None:
        for name in ("rounds", "eval_every", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.eval_every_sim_s is not None and not (
            self.eval_every_sim_s > 0 and self.eval_every == 1 and not self.local_trained
        ):
            raise ValueError(
                "eval_every_sim_s must be > 0, with eval_every 1 and local_trained off, got "
                f"{self.eval_every_sim_s}, {self.eval_every}, {self.local_trained}"
            )
        if not 0 < self.availability <= 1:
            raise ValueError(f"availability must be in (0, 1], got {self.availability}")
        if self.stats_samples is not None and self.stats_samples < 1:
            raise ValueError(f"stats_samples must be >= 1 or None, got {self.stats_samples}")
        metrics = [p.metric for p in self.probes]
        wrong = [m for m in metrics if m not in PROBE_METRICS]
        if wrong or len(set(metrics)) != len(metrics):
            raise ValueError(
                f"probes must fill distinct metrics among {PROBE_METRICS}, got {metrics}"
            )

    def is_eval_round(self, rnd: int) -> bool:
        """Whether round `rnd` is scored, by rounds; on the simulated clock, the last round
        only until its clock is known (`is_eval_step`)."""
        if self.eval_every_sim_s is not None:
            return rnd == self.rounds
        return rnd % self.eval_every == 0 or rnd == self.rounds

    def is_eval_step(self, rnd: int, start_s: float | None, end_s: float | None) -> bool:
        """Whether round `rnd`, whose clock ran from `start_s` to `end_s`, is scored: by
        rounds, or on the simulated clock when the step passed a multiple of
        `eval_every_sim_s` (a pure function of the two times, so a resumed run scores the
        steps an uninterrupted one does)."""
        grid = self.eval_every_sim_s
        if grid is None:
            return self.is_eval_round(rnd)
        if rnd == self.rounds:
            return True
        if start_s is None or end_s is None:
            raise ValueError("eval_every_sim_s needs a simulated clock, and this run has none")
        return math.floor(end_s / grid) > math.floor(start_s / grid)

    def is_checkpoint_round(self, rnd: int) -> bool:
        return rnd % self.checkpoint_every == 0 or rnd == self.rounds
