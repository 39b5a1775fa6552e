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
  others. Local evaluation is a second exchange with the same bound.
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
- Methods with a server program (split learning) need a per-batch exchange this adapter
  does not have: they are refused up front.
- The per-client trace (`clients.jsonl`) has the simulator's rows, with `sim` null: rounds
  take real time here, and no simulated clock runs.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from flwr.app import Message
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from torch import nn

from hetfl.core.bn_statistics import BNStatistics, apply_bn_statistics
from hetfl.core.state import state_bytes
from hetfl.core.strategy import Strategy
from hetfl.core.types import (
    ClientInfo,
    ClientResult,
    ClientTask,
    EvalModel,
    EvalSplit,
    Failure,
    FailureKind,
    Problem,
    State,
)
from hetfl.deploy.codec import CodecError
from hetfl.deploy.records import EVALUATE, REGISTER, STATS, TRAIN, from_content, to_content
from hetfl.engine.outputs import RowSink
from hetfl.engine.parts import Parts
from hetfl.engine.rounds import RoundLoop
from hetfl.engine.statistics import add_bn_statistics, bn_statistics_problem, stats_shares
from hetfl.engine.steps import (
    LocalScore,
    RoundOutcome,
    charge_result,
    pooled_validation,
    run_pixels,
)

K = TypeVar("K", bound=Hashable)

#: Flower error codes that say nothing about the node's answer (a message expired or could
#: not be delivered, the node is offline or its process died): worth asking again.
_TRANSIENT = frozenset(
    {
        ErrorCode.UNKNOWN,
        ErrorCode.MESSAGE_UNAVAILABLE,
        ErrorCode.REPLY_MESSAGE_UNAVAILABLE,
        ErrorCode.NODE_UNAVAILABLE,
        ErrorCode.CLIENT_APP_CRASHED,
    }
)


class SimulatorOnlyError(ValueError):
    """A method this engine cannot run yet."""


def refuse_server_program(strategy: Strategy, algorithm: str) -> None:
    """Split learning exchanges with the server every batch; this adapter has no such
    channel yet, so such methods are refused before anything starts."""
    if strategy.needs_server_program:
        raise SimulatorOnlyError(
            f"algorithm {algorithm!r} needs a server program (split learning), which the "
            "Flower adapter does not run yet: it is simulator-only for now (use `hetfl run`)"
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


class FlowerServer(RoundLoop):
    """Runs one experiment, given as explicit `Parts`, over a Flower `Grid` into `run_dir`."""

    def __init__(
        self,
        grid: Grid,
        parts: Parts,
        deployment: Deployment,
        run_dir: Path,
        *,
        poll_s: float = 0.5,
        sinks: Sequence[RowSink] = (),
    ) -> None:
        """`parts` are built exactly as for the simulator; their clients' data is used here
        only for the pooled validation samples that a global model is scored on (as in the
        simulator). `poll_s` is how often replies are pulled from the SuperLink while
        waiting. `sinks` receive the metrics rows too (experiment tracking)."""
        refuse_server_program(parts.strategy, deployment.algorithm)
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
        self.grid = grid
        self.deploy = deployment
        self.config_text = deployment.config_text
        self.fingerprint = deployment.fingerprint
        self.expected = deployment.num_clients
        self.poll_s = poll_s
        self.infos: dict[int, ClientInfo] = {}
        self.node_of: dict[int, int] = {}
        self.refused: set[int] = set()
        self.participated: set[int] = set()
        if self.settings.availability < 1:
            self.progress.message(
                f"warning: availability = {self.settings.availability} is a simulator setting; "
                "under Flower the available clients are the connected ones"
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
        self._wait_for_clients()
        return super().run(resume)

    # -- clients ------------------------------------------------------------------------
    def _wait_for_clients(self) -> None:
        """Register nodes until `min_clients` (default: all) clients are known, or fail
        after `registration_timeout_s` naming the partitions still missing."""
        need = self.deploy.min_clients or self.expected
        deadline = time.monotonic() + self.deploy.registration_timeout_s
        self.progress.message(f"waiting for {need} of {self.expected} clients to register")
        while len(self.infos) < need:
            if time.monotonic() >= deadline:
                missing = sorted(set(range(self.expected)) - set(self.infos))
                raise TimeoutError(
                    f"only {len(self.infos)} of the {need} clients needed registered within "
                    f"deploy.registration_timeout_s = {self.deploy.registration_timeout_s:g} s; "
                    f"missing partitions: {missing}. Start them with "
                    "`hetfl client --partition-id I --config CONFIG`, or lower deploy.min_clients"
                )
            unknown = self._unknown_nodes()
            if unknown:
                self._register(unknown, timeout=deadline - time.monotonic())
            else:
                time.sleep(self.poll_s)
        self.progress.message(f"{len(self.infos)} clients registered: {sorted(self.infos)}")

    def _unknown_nodes(self) -> list[int]:
        known = set(self.node_of.values()) | self.refused
        return sorted(n for n in self.grid.get_node_ids() if n not in known)

    def _register(self, node_ids: Iterable[int], timeout: float) -> None:
        """Ask nodes who they are; admit them, or refuse them for good when their answer
        (or their ClientApp failing) rules them out. A node that did not answer, or whose
        message Flower could not deliver in time, is asked again later."""
        request = to_content({"config": self.config_text})
        messages = {
            nid: Message(request, nid, REGISTER, ttl=timeout, group_id="register")
            for nid in node_ids
        }
        replies = self._exchange(messages, timeout)
        connected = set(self.grid.get_node_ids())
        for nid in sorted(replies):
            reply = replies[nid]
            answer, problem = self._answer(reply, ("partition_id", "info", "data"))
            if problem is not None and reply.has_error() and reply.error.code in _TRANSIENT:
                self.progress.message(f"warning: node {nid} not registered yet: {problem}")
                continue
            if problem is None:
                problem = self._admit(nid, answer, connected)
            if problem is not None:
                self.refused.add(nid)
                self.progress.message(f"warning: node {nid} refused: {problem}")

    def _admit(self, nid: int, answer: Mapping[str, Any], connected: set[int]) -> str | None:
        cid, info = answer["partition_id"], answer["info"]
        if not isinstance(info, ClientInfo) or info.cid != cid:
            return f"malformed registration (partition {cid!r}, info {info!r:.80})"
        if answer["data"] != self.fingerprint:
            diff = {
                k: (answer["data"].get(k), v)
                for k, v in self.fingerprint.items()
                if answer["data"].get(k) != v
            }
            return (
                f"its data settings differ from the server's, so partition {cid} would not be "
                f"the same data; (node, server): {diff}"
            )
        if not 0 <= cid < self.expected:
            return f"partition {cid} is outside 0..{self.expected - 1}"
        holder = self.node_of.get(cid)
        if holder is not None and holder != nid and holder in connected:
            return f"partition {cid} is already served by node {holder}"
        if holder is not None and info != self.infos[cid]:
            return f"it serves partition {cid} with other data than its previous node"
        self.node_of[cid] = nid
        self.infos[cid] = info
        return None

    def known_clients(self) -> list[ClientInfo]:
        return [self.infos[c] for c in sorted(self.infos)]

    def available(self, rnd: int) -> list[ClientInfo]:
        """The registered clients whose node is connected, after registering new nodes."""
        self._register(self._unknown_nodes(), timeout=self.deploy.round_timeout_s)
        connected = set(self.grid.get_node_ids())
        return [self.infos[c] for c in sorted(self.infos) if self.node_of[c] in connected]

    # -- exchanges ----------------------------------------------------------------------
    def _exchange(self, messages: Mapping[K, Message], timeout: float) -> dict[K, Message]:
        """Push all messages, then pull replies until each is answered or `timeout` passes.

        Replies are matched to requests by message id (an error reply for an unreachable
        node comes from the SuperLink, not from the node).
        """
        if not messages:
            return {}
        keys = list(messages)
        ids = list(self.grid.push_messages([messages[k] for k in keys]))
        pending = {mid: k for k, mid in zip(keys, ids, strict=False) if mid}
        replies: dict[K, Message] = {}
        deadline = time.monotonic() + timeout
        while pending:
            for reply in self.grid.pull_messages(list(pending)):
                key = pending.pop(reply.metadata.reply_to_message_id, None)
                if key is not None:
                    replies[key] = reply
            if not pending or time.monotonic() >= deadline:
                break
            time.sleep(self.poll_s)
        return replies

    @staticmethod
    def _answer(
        reply: Message | None, keys: tuple[str, ...], missing: str = "no reply in time"
    ) -> tuple[dict[str, Any], str | None]:
        """The decoded reply, or why there is none usable (`missing` when none came)."""
        if reply is None:
            return {}, missing
        if reply.has_error():
            return {}, f"client error: {(reply.error.reason or '').strip()}"
        try:
            answer = from_content(reply.content)
        except CodecError as exc:
            return {}, f"malformed reply: {exc}"
        if not isinstance(answer, dict) or any(k not in answer for k in keys):
            return {}, f"malformed reply: expected fields {list(keys)}"
        return answer, None

    def train(self, rnd: int, tasks: list[ClientTask]) -> RoundOutcome:
        """Every task as a message; replies checked and charged, in client id order."""
        outcome = RoundOutcome()
        timeout = self.deploy.round_timeout_s
        messages: dict[int, Message] = {}
        by_cid = {t.cid: t for t in tasks}
        for task in sorted(tasks, key=lambda t: t.cid):
            outcome.charge(task.cid, bytes_down=state_bytes(task.payload))
            request = {"config": self.config_text, "round": rnd, "task": task}
            messages[task.cid] = Message(
                to_content(request), self.node_of[task.cid], TRAIN, ttl=timeout, group_id=str(rnd)
            )
        replies = self._exchange(messages, timeout)
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
        answer, problem = self._answer(
            reply, ("result",), missing=f"no reply within deploy.round_timeout_s = {timeout:g} s"
        )
        if problem is not None:
            return Problem(self._failure_kind(reply), problem)
        result = answer["result"]
        if not isinstance(result, ClientResult):
            return Problem("invalid", "malformed reply: no ClientResult")
        input_shape = self.infos[task.cid].input_shape
        invalid = charge_result(outcome, self.macs, task, result, input_shape)
        return result if invalid is None else invalid

    @staticmethod
    def _failure_kind(reply: Message | None) -> FailureKind:
        """The kind of a reply `_answer` found unusable: none came, an error came, or what
        came did not decode."""
        if reply is None:
            return "timeout"
        return "client-error" if reply.has_error() else "invalid"

    # -- evaluation ---------------------------------------------------------------------
    def stats_pass(self, rnd: int, model: nn.Module, em: EvalModel) -> None:
        """Static-BN statistics of `em` from every connected registered client's training
        data (`hetfl.engine.statistics`): each node is sent its share of
        `settings.stats_samples` (its whole training size by default), returns per-layer
        sums over its batches, and the server adds them in client-id order and sets the
        cumulative average. Clients that fail are left out (with a warning); with none left
        the round's evaluation fails. Bytes are not counted (evaluation traffic)."""
        connected = set(self.grid.get_node_ids())
        asked = [c for c in sorted(self.infos) if self.node_of[c] in connected]
        sizes = {c: self.infos[c].n_train for c in asked}
        shares = stats_shares(sizes, self.settings.stats_samples)
        timeout = self.deploy.round_timeout_s
        request = {"config": self.config_text, "spec": em.spec, "tensors": em.tensors}
        messages = {
            c: Message(
                to_content({**request, "share": n}),
                self.node_of[c],
                STATS,
                ttl=timeout,
                group_id=str(rnd),
            )
            for c, n in shares.items()
            if n
        }
        replies = self._exchange(messages, timeout)
        total: BNStatistics = {}
        for c in sorted(messages):
            answer, problem = self._answer(replies.get(c), ("stats",))
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

    def local_scores(
        self,
        rnd: int,
        outcome: RoundOutcome,
        evaluated: Mapping[str, State],
        split: EvalSplit = "test",
    ) -> list[LocalScore]:
        """A second exchange: each client evaluates on its own `split` with its private
        state; clients that do not answer are left out (with a warning)."""
        mode = self.settings.local_eval
        cids = [r.cid for r in outcome.results] if mode == "sampled" else sorted(self.participated)
        connected = set(self.grid.get_node_ids())
        timeout = self.deploy.round_timeout_s
        tasks = {
            c: replace(self.strategy.eval_task(self.infos[c], self.state, evaluated), split=split)
            for c in cids
        }
        messages = {
            c: Message(
                to_content({"config": self.config_text, "task": task}),
                self.node_of[c],
                EVALUATE,
                ttl=timeout,
                group_id=str(rnd),
            )
            for c, task in tasks.items()
            if self.node_of[c] in connected
        }
        replies = self._exchange(messages, timeout)
        scores: list[LocalScore] = []
        for c in sorted(messages):
            answer, problem = self._answer(replies.get(c), ("correct", "loss", "n"))
            if problem is not None:
                self.progress.message(
                    f"warning: client {c} not evaluated on its {split} split in round {rnd}: "
                    f"{problem}"
                )
            elif answer["n"] > 0:
                n = answer["n"]
                acc, loss = answer["correct"] / n, answer["loss"] / n
                scores.append(LocalScore(c, acc, loss, tasks[c].group))
        return scores

    # -- checkpoints (server state only: private state stays on the nodes) ---------------
    def checkpoint_extras(self) -> dict[str, Any]:
        return {"engine": "flower", "participated": sorted(self.participated)}

    def check_checkpoint(self, ckpt: dict[str, Any]) -> None:
        if ckpt.get("engine") != "flower":
            raise ValueError(
                f"the checkpoint in {self.run_dir} was written by the simulator, whose client "
                "store holds private state the nodes do not have; continue it with "
                f"`hetfl resume {self.run_dir}`"
            )

    def restore_extras(self, ckpt: dict[str, Any]) -> None:
        self.participated = set(ckpt["participated"])
