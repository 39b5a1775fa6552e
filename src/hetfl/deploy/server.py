"""The server side under Flower: the HetFL round loop on a Flower `Grid`.

This is the second engine, beside the simulator (docs/deploy.md): the same strategy verbs in
the same order, with clients reached through Flower messages instead of function calls.
Both engines run the round template `hetfl.engine.rounds.RoundLoop` (costs, result
checks, evaluation and metrics rows through `hetfl.engine.steps`), so both write the same
`metrics.jsonl` / `summary.json`; this module supplies the hooks that reach the clients.

What differs from the simulator, and why:

- Clients are Flower nodes. Before round 1 a registration exchange asks each node for its
  client id (partition), `ClientInfo` and data settings; nodes whose data settings differ
  from the server's config are refused (partition `i` would not be the same data). Nodes
  that connect later, or reconnect after a restart, are registered at the start of the
  next round. `available` is every registered client whose node is connected.
- A round's training exchange waits at most `deploy.round_timeout_s`; a client that did not
  answer by then, or whose node failed, becomes a `Failure` and the round aggregates the
  others. A client that stops answering is said when it first misses a round, is dropped
  from sampling (and from evaluation exchanges) after `deploy.max_missed_rounds` misses in
  a row or once its node leaves, and is said again when it rejoins (`deploy.silence`;
  `summary.json`'s `unresponsive` counts it all). Local evaluation is a second exchange
  with the same bound; with `eval.local_trained`, the trained clients' models are scored
  in one more (each node is sent the tensors it trained, and scores them with the private
  state it kept).
- Private state lives on the nodes, so checkpoints hold the global state, the strategy's
  extra state, the counters and which clients have participated, but no client store (see
  `node.PrivateState`).
- Static BatchNorm (HeteroFL, `EvalModel.stats_pass`): before global evaluation the
  server sends each such model to every connected registered client (`query.stats`) with
  the client's share of `RoundSettings.stats_samples` (its whole training size by
  default); each sums per-batch BN statistics over its data or its own draw of that share
  (`hetfl.engine.statistics.client_bn_statistics`, batches of 500) and the server adds
  the sums in client-id order and sets the cumulative average (`apply_bn_statistics`):
  the simulator's pass, split between nodes and server, so the accuracies are the
  simulator's. The bytes of this exchange are not counted, as evaluation traffic is not
  in the simulator. HeteroFL's local evaluation sends each client the full-rate model
  with these statistics already applied; the node only applies its label mask.
- Methods that declare themselves simulator-only (`Algorithm.simulator_only`: split
  learning's per-batch exchange, which this adapter does not have) are refused up front,
  as is any strategy with a server program.
- The per-client trace (`clients.jsonl`) has the simulator's rows, with `sim` null: rounds
  take real time here, and no simulated clock runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flwr.app import Message
from flwr.serverapp import Grid
from torch import nn

from hetfl.core.client.bn_statistics import BNStatistics, apply_bn_statistics
from hetfl.core.simulator_only import NEEDS_SERVER_PROGRAM, needs_setup_query, refuse_simulator_only
from hetfl.core.types import (
    ClientInfo,
    ClientResult,
    ClientTask,
    EvalModel,
    EvalSplit,
    EvalTask,
    Failure,
    Problem,
    State,
)
from hetfl.deploy.exchange import POLL_S, Exchange, answer_of, failure_kind
from hetfl.deploy.membership import Membership
from hetfl.deploy.records import EVALUATE, STATS, TRAIN, to_content
from hetfl.deploy.silence import Silence
from hetfl.engine.outputs import RowSink
from hetfl.engine.parts import Parts
from hetfl.engine.rounds import RoundLoop
from hetfl.engine.statistics import add_bn_statistics, bn_statistics_problem, stats_shares
from hetfl.engine.steps import (
    LocalScore,
    RoundOutcome,
    charge_result,
    local_task,
    pooled_validation,
    run_pixels,
    task_bytes,
)


@dataclass(frozen=True)
class Deployment:
    """What the Flower server needs besides a run's `Parts` (the face builds it from the
    config): the config text sent to every node, the data settings a node must match,
    how many clients to expect and the exchange bounds."""

    algorithm: str
    config_text: str
    fingerprint: dict[str, Any] = field(hash=False)
    num_clients: int
    min_clients: int | None
    registration_timeout_s: float
    round_timeout_s: float
    device_profiles: bool = False
    max_missed_rounds: int = 2
    simulator_only: str | None = None


class FlowerServer(RoundLoop):
    """Runs one experiment, given as explicit `Parts`, over a Flower `Grid` into `run_dir`."""

    def __init__(
        self,
        grid: Grid,
        parts: Parts,
        deployment: Deployment,
        run_dir: Path,
        *,
        poll_s: float = POLL_S,
        sinks: Sequence[RowSink] = (),
    ) -> None:
        """`parts` are built exactly as for the simulator; their clients' data is used here
        only for the pooled validation samples that a global model is scored on (as in the
        simulator). `poll_s` is how often replies are pulled from the SuperLink while
        waiting. `sinks` receive the metrics rows too (experiment tracking). A method that
        declares itself simulator-only (`deployment.simulator_only`, from its registry
        entry), or a strategy with a server program or a set-up query, is refused before
        anything starts."""
        why = deployment.simulator_only
        if why is None and parts.strategy.capabilities.needs_server_program:
            why = NEEDS_SERVER_PROGRAM
        query = parts.strategy.capabilities.setup_query
        if why is None and query is not None:
            why = needs_setup_query(query.instead)
        refuse_simulator_only(deployment.algorithm, why)
        super().__init__(
            parts.strategy,
            parts.programs,
            parts.test,
            parts.settings,
            run_dir,
            parts.info,
            parts.progress,
            pooled_validation(parts.clients),
            run_pixels(parts.clients),
            sinks,
        )
        self.info["engine"] = "flower"
        self.deploy = deployment
        self.config_text = deployment.config_text
        self.poll_s = poll_s
        self.exchange = Exchange(grid, poll_s)
        self.members = Membership(
            self.exchange,
            deployment.config_text,
            deployment.fingerprint,
            deployment.num_clients,
            self.progress.message,
        )
        self.participated: set[int] = set()
        self.silence = Silence(
            deployment.max_missed_rounds, deployment.round_timeout_s, self.progress.message
        )
        self.info["unresponsive"] = self.silence.summary()
        if self.settings.availability < 1:
            self.progress.message(
                f"warning: availability = {self.settings.availability} is a simulator setting; "
                "under Flower the available clients are the connected ones"
            )
        system = self.settings.system
        if system is not None and system.asynchronous is not None:
            raise ValueError(
                "system.asynchronous runs on the simulator's clock only; under Flower, "
                "remove it (rounds are synchronous)"
            )
        if self.settings.eval_every_sim_s is not None:
            raise ValueError(
                "eval.every_sim_s evaluates on the simulator's clock; under Flower rounds take "
                "real time and sim_time_s stays null: evaluate by rounds (eval.every)"
            )
        if deployment.device_profiles:
            self.progress.message(
                "warning: device profiles (system:) drive the simulator's clock; under Flower "
                "rounds take real time and sim_time_s stays null"
            )

    # -- the loop -----------------------------------------------------------------------
    def run(self, resume: bool = False) -> dict[str, Any]:
        """Register clients, run (or continue) to the configured rounds; returns the summary."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        need = self.deploy.min_clients or self.deploy.num_clients
        self.members.wait_for(need, self.deploy.registration_timeout_s, self.poll_s)
        return super().run(resume)

    # -- clients ------------------------------------------------------------------------

    def known_clients(self) -> list[ClientInfo]:
        return self.members.known()

    def available(self, rnd: int) -> list[ClientInfo]:
        """The registered clients whose node is connected, after registering new nodes,
        less those dropped for not answering (`hetfl.deploy.silence`)."""
        connected = self.members.available(self.deploy.round_timeout_s)
        allowed = self.silence.available(rnd, self.members.node_of, self.exchange.connected())
        self.info["unresponsive"] = self.silence.summary()
        return [info for info in connected if info.cid in allowed]

    def _reachable(self, cids: Iterable[int]) -> list[int]:
        """Those of `cids` whose node is connected and that are not dropped for silence,
        in id order: an evaluation exchange waits for no client that stopped answering."""
        return [c for c in self.members.connected_clients(cids) if c not in self.silence.dropped]

    # -- training -----------------------------------------------------------------------
    def train(self, rnd: int, tasks: list[ClientTask]) -> RoundOutcome:
        """Every task as a message; replies checked and charged, in client id order."""
        outcome = RoundOutcome()
        timeout = self.deploy.round_timeout_s
        messages: dict[int, Message] = {}
        by_cid = {t.cid: t for t in tasks}
        for task in sorted(tasks, key=lambda t: t.cid):
            outcome.charge(task.cid, bytes_down=task_bytes(task))
            request = {"config": self.config_text, "round": rnd, "task": task}
            messages[task.cid] = Message(
                to_content(request),
                self.members.node_of[task.cid],
                TRAIN,
                ttl=timeout,
                group_id=str(rnd),
            )
        replies = self.exchange(messages, timeout)
        self.silence.after_round(rnd, {cid: replies.get(cid) for cid in messages})
        self.info["unresponsive"] = self.silence.summary()
        for cid in sorted(messages):
            result = self._result_of(by_cid[cid], replies.get(cid), outcome)
            if isinstance(result, Problem):
                outcome.failures.append(Failure.of(cid, result))
                self.progress.message(f"warning: client {cid} excluded in round {rnd}: {result}")
                continue
            self.participated.add(cid)
            outcome.results.append(result)
        return outcome

    def _result_of(
        self, task: ClientTask, reply: Message | None, outcome: RoundOutcome
    ) -> ClientResult | Problem:
        """A reply's result, charged to `outcome` and checked like the simulator's, or why
        it is excluded."""
        timeout = self.deploy.round_timeout_s
        answer, problem = answer_of(
            reply, ("result",), missing=f"no reply within deploy.round_timeout_s = {timeout:g} s"
        )
        if problem is not None:
            return Problem(failure_kind(reply), problem)
        result = answer["result"]
        if not isinstance(result, ClientResult):
            return Problem("invalid", "malformed reply: no ClientResult")
        input_shape = self.members.infos[task.cid].input_shape
        invalid = charge_result(outcome, self.macs, task, result, input_shape)
        return result if invalid is None else invalid

    # -- evaluation ---------------------------------------------------------------------
    def stats_pass(self, rnd: int, model: nn.Module, em: EvalModel) -> None:
        """Static-BN statistics of `em` from every connected registered client's training
        data (`hetfl.engine.statistics`): each node is sent its share of
        `settings.stats_samples` (its whole training size by default), returns per-layer
        sums over its batches, and the server adds them in client-id order and sets the
        cumulative average. Clients that fail are left out (with a warning); with none left
        the round's evaluation fails. Bytes are not counted (evaluation traffic)."""
        asked = self._reachable(self.members.infos)
        sizes = {c: self.members.infos[c].n_train for c in asked}
        shares = stats_shares(sizes, self.settings.stats_samples)
        timeout = self.deploy.round_timeout_s
        request = {"config": self.config_text, "spec": em.spec, "tensors": em.tensors}
        messages = {
            c: Message(
                to_content({**request, "share": n}),
                self.members.node_of[c],
                STATS,
                ttl=timeout,
                group_id=str(rnd),
            )
            for c, n in shares.items()
            if n
        }
        replies = self.exchange(messages, timeout)
        total: BNStatistics = {}
        for c in sorted(messages):
            answer, problem = answer_of(replies.get(c), ("stats",))
            if problem is None:
                problem = bn_statistics_problem(total, answer["stats"])
            if problem is None:
                add_bn_statistics(total, answer["stats"])
            else:
                self.progress.message(
                    f"warning: client {c} gave no BatchNorm statistics for {em.name!r} in "
                    f"round {rnd}: {problem}"
                )
        if not total:
            raise RuntimeError(
                f"no client returned BatchNorm statistics for {em.name!r} in round {rnd}"
            )
        apply_bn_statistics(model, total)

    def local_tasks(
        self,
        rnd: int,
        outcome: RoundOutcome,
        evaluated: Mapping[str, State],
        split: EvalSplit = "test",
        stats_pass: bool = False,
    ) -> list[EvalTask]:
        """Each sampled (or each participating) client on its own `split` with its private
        state, which `score_clients` asks for in an exchange of its own."""
        mode = self.settings.local_eval
        cids = [r.cid for r in outcome.results] if mode == "sampled" else sorted(self.participated)
        infos = self.members.infos
        return [
            local_task(self.strategy, infos[c], self.state, evaluated, split, stats_pass)
            for c in cids
        ]

    def score_clients(self, rnd: int, tasks: Sequence[EvalTask]) -> list[LocalScore]:
        """An `evaluate` exchange: each connected task's node scores its client on the
        task's split with its private state (the latest it kept); clients that do not
        answer are left out (with a warning), as are empty splits."""
        timeout = self.deploy.round_timeout_s
        by_cid = {task.cid: task for task in tasks}
        messages = {
            c: Message(
                to_content({"config": self.config_text, "task": by_cid[c]}),
                self.members.node_of[c],
                EVALUATE,
                ttl=timeout,
                group_id=str(rnd),
            )
            for c in self._reachable(by_cid)
        }
        replies = self.exchange(messages, timeout)
        scores: list[LocalScore] = []
        for c in sorted(messages):
            answer, problem = answer_of(replies.get(c), ("correct", "loss", "n"))
            if problem is not None:
                self.progress.message(
                    f"warning: client {c} not evaluated on its {by_cid[c].split} split in "
                    f"round {rnd}: {problem}"
                )
            elif answer["n"] > 0:
                n = answer["n"]
                acc, loss = answer["correct"] / n, answer["loss"] / n
                scores.append(LocalScore(c, acc, loss, by_cid[c].group))
        return scores

    # -- checkpoints (server state only: private state stays on the nodes) ---------------
    def checkpoint_extras(self) -> dict[str, Any]:
        return {
            "engine": "flower",
            "participated": sorted(self.participated),
            "silence": self.silence.state_dict(),
        }

    def check_checkpoint(self, ckpt: dict[str, Any]) -> None:
        if ckpt.get("engine") != "flower":
            raise ValueError(
                f"the checkpoint in {self.run_dir} was written by the simulator, whose client "
                "store holds private state the nodes do not have; continue it with "
                f"`hetfl resume {self.run_dir}`"
            )

    def restore_extras(self, ckpt: dict[str, Any]) -> None:
        self.participated = set(ckpt["participated"])
        self.silence.load_state_dict(ckpt["silence"])
        self.info["unresponsive"] = self.silence.summary()
