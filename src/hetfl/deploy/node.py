"""The client side under Flower: a node serves one data partition, that is one HetFL client.

A node is configured by Flower's node config (`hetfl client` sets it):

- `partition-id`: its client id (Flower's simulation engine sets it for each virtual node);
- `hetfl-config` (optional): a local YAML config whose `data`, `device` and `threads` it
  uses, so each machine names its own dataset path; without it the server's are used;
- `hetfl-state-dir` (optional): a node-local directory for its private state (overrides the
  config's `deploy.state_dir`);
- `hetfl-attrs` (optional): JSON of the attributes it declares (`ClientInfo.attrs`).

Everything else (method, model, local training, seed) comes from the server's config, sent
with every request. The node is built by a `NodeBuilder` that the face injects
(`hetfl.flower.build_node`, with the builder the simulator uses), so both engines train
the same client on the same data by construction; it trains with the generator the
simulator would use: (seed, round, client id, "train").

Private state (`ClientOutput.private`) never leaves the node. The latest is kept in Flower's
per-node `context.state`, which lasts for one Flower run; with a state directory, each
round's private state is also written atomically to disk, so a restarted node, or a resumed
run, picks up where the node left off (see docs/deploy.md).
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from logging import INFO
from pathlib import Path
from typing import Any, cast

from flwr.app import ArrayRecord, ConfigRecord, Context, Message
from flwr.clientapp import ClientApp
from flwr.common.logger import log

from hetfl.core.client.program import Program
from hetfl.core.model_cache import ModelCache
from hetfl.core.rng import torch_generator
from hetfl.core.types import ClientData, ClientTask, EvalTask, State
from hetfl.deploy import profile
from hetfl.deploy.records import from_content, record_tensors, tensors_record, to_content
from hetfl.engine.checkpoint import load_checkpoint, save_checkpoint
from hetfl.engine.statistics import client_bn_statistics
from hetfl.engine.validate import result_problem

_PRIVATE = "hetfl.private"
_PRIVATE_ROUND = "hetfl.private-round"


@dataclass
class Node:
    """One node's client: its id, seed, data, program and evaluation cache `models`,
    built by the face from the server's config and the node's own
    (`hetfl.flower.build_node`).

    `fingerprint` is the node's data settings, which must equal the server's; `keep` is
    how many per-round private states its state directory keeps."""

    cid: int
    seed: int
    fingerprint: dict[str, Any]
    data: ClientData
    program: Program
    models: ModelCache
    attrs: dict[str, Any]
    state_dir: Path | None
    keep: int


#: Builds a node from Flower's node config and the server's config text (the face does:
#: this engine does not read configs).
NodeBuilder = Callable[[Mapping[str, Any], str], Node]

#: A message handler of the ClientApp, given the node builder.
Handler = Callable[[Message, Context, NodeBuilder], Message]

#: Built nodes of this process, by (run id, server config, node id, node config). A
#: `hetfl client` node serves every message of a run from one process
#: (`hetfl.launch.supernode`), and Flower's simulation engine re-uses worker processes for
#: many virtual nodes, so a node's partition and client program are built once per run.
_NODES: dict[tuple[int, str, int, str], Node] = {}


def node_for(context: Context, server_config: str, build: NodeBuilder) -> Node:
    """The node `build` makes from this context and the server's config, built on the
    first message of a run. A message of another run, or with another server config,
    drops the nodes built for the previous one (a node serves one run at a time; its
    data and program follow the config)."""
    own = json.dumps(dict(context.node_config), sort_keys=True, default=str)
    key = (context.run_id, server_config, context.node_id, own)
    node = _NODES.get(key)
    if node is None:
        for old in [k for k in _NODES if k[:2] != key[:2]]:
            del _NODES[old]
        node = build(context.node_config, server_config)
        _NODES[key] = node
        log(INFO, "client %d: partition and client program built (run %d)", node.cid, key[0])
    return node


class PrivateState:
    """A node's private tensors across rounds.

    `context.state` holds the latest (and the round it was trained in); the state directory
    holds one atomic checkpoint per participation, the last `keep` of them, so that a run
    resumed from an older server checkpoint finds the state the node had at that round.
    """

    def __init__(self, context: Context, node: Node) -> None:
        self.context = context
        self.node = node
        self.keep = node.keep

    def get(self, before_round: int | None = None) -> State:
        """The latest private state trained before `before_round` (None: the latest)."""
        state = self.context.state
        if _PRIVATE in state and _PRIVATE_ROUND in state:
            trained = int(cast(int, state[_PRIVATE_ROUND]["round"]))  # `put` stores an int
            if before_round is None or trained < before_round:
                return self._to_device(record_tensors(cast(ArrayRecord, state[_PRIVATE])))
        rounds = [r for r in self._saved_rounds() if before_round is None or r < before_round]
        if not rounds:
            return {}
        ckpt = load_checkpoint(self._round_dir(max(rounds)))
        if ckpt["cid"] != self.node.cid:
            raise ValueError(
                f"state directory {self.node.state_dir} holds client {ckpt['cid']}'s state, "
                f"not client {self.node.cid}'s"
            )
        return self._to_device(ckpt["private"])

    def put(self, rnd: int, private: State) -> None:
        self.context.state[_PRIVATE] = tensors_record(private)
        self.context.state[_PRIVATE_ROUND] = ConfigRecord({"round": rnd})
        if self.node.state_dir is None:
            return
        save_checkpoint(
            self._round_dir(rnd),
            {
                "cid": self.node.cid,
                "round": rnd,
                "private": {k: v.cpu() for k, v in private.items()},
            },
        )
        for old in sorted(self._saved_rounds())[: -self.keep]:
            shutil.rmtree(self._round_dir(old), ignore_errors=True)

    def _round_dir(self, rnd: int) -> Path:
        assert self.node.state_dir is not None
        return self.node.state_dir / f"round-{rnd}"

    def _saved_rounds(self) -> list[int]:
        if self.node.state_dir is None or not self.node.state_dir.is_dir():
            return []
        return [
            int(p.name.removeprefix("round-"))
            for p in self.node.state_dir.glob("round-*")
            if (p / "latest.pt").exists()
        ]

    def _to_device(self, state: State) -> State:
        return {k: v.to(self.node.program.device) for k, v in state.items()}


# -- the ClientApp's handlers ---------------------------------------------------------------
def make_client_app(build: NodeBuilder) -> ClientApp:
    """The ClientApp whose handlers serve the node that `build` makes."""
    app = ClientApp()
    app.query("register")(partial(timed, register, build=build))
    app.query("stats")(partial(timed, stats, build=build))
    app.train()(partial(timed, train, build=build))
    app.evaluate()(partial(timed, evaluate, build=build))
    return app


def timed(handler: Handler, msg: Message, context: Context, build: NodeBuilder) -> Message:
    """`handler`'s reply; with `HETFL_DEPLOY_PROFILE` set, its times are logged
    (`hetfl.deploy.profile`): message created, process started, handler entered, node
    built, reply ready."""
    if not profile.enabled():
        return handler(msg, context, build)
    entered = time.time()
    built = [entered]

    def build_timed(node_config: Mapping[str, Any], server_config: str) -> Node:
        node = build(node_config, server_config)
        built[0] = time.time()
        return node

    reply = handler(msg, context, build_timed)
    profile.record(
        side="node",
        kind=msg.metadata.message_type,
        message=msg.metadata.message_id,
        round=msg.metadata.group_id,
        created=msg.metadata.created_at,
        process=profile.process_started(),
        entered=entered,
        built=built[0],
        done=time.time(),
    )
    return reply


def register(msg: Message, context: Context, build: NodeBuilder) -> Message:
    """Answer who this node is: its client id, `ClientInfo` and data settings."""
    request = from_content(msg.content)
    node = node_for(context, request["config"], build)
    reply = {
        "partition_id": node.cid,
        "info": node.data.info(node.attrs),
        "data": node.fingerprint,
    }
    return Message(to_content(reply), reply_to=msg)


def train(msg: Message, context: Context, build: NodeBuilder) -> Message:
    """Run one `ClientTask`, keep the private state if the result is valid, send the result."""
    request = from_content(msg.content)
    node = node_for(context, request["config"], build)
    task: ClientTask = request["task"]
    rnd = int(request["round"])
    _check_cid(node, task.cid)
    device = node.program.device
    task.payload = {k: v.to(device) for k, v in task.payload.items()}
    private = PrivateState(context, node)
    out = node.program.fit(
        task,
        node.data,
        private.get(before_round=rnd),
        torch_generator(node.seed, rnd, task.cid, "train"),
        info=node.data.info(node.attrs),
    )
    # The same rule as the simulator's client store: an invalid result keeps nothing.
    if result_problem(out.result, task) is None:
        private.put(rnd, out.private)
    return Message(to_content({"result": out.result}), reply_to=msg)


def evaluate(msg: Message, context: Context, build: NodeBuilder) -> Message:
    """Test this client's model, with its private layers, on the split the task names
    (its local test split or its validation split)."""
    request = from_content(msg.content)
    node = node_for(context, request["config"], build)
    task: EvalTask = request["task"]
    _check_cid(node, task.cid)
    if node.data.split(task.split)[1].numel() == 0:
        return Message(to_content({"correct": 0, "loss": 0.0, "n": 0}), reply_to=msg)
    task.payload = {k: v.to(node.program.device) for k, v in task.payload.items()}
    private = PrivateState(context, node).get()
    correct, loss_sum, n = node.program.evaluate(task, node.data, private, node.models)
    return Message(to_content({"correct": correct, "loss": loss_sum, "n": n}), reply_to=msg)


def stats(msg: Message, context: Context, build: NodeBuilder) -> Message:
    """Sum per-batch BatchNorm statistics of the sent model over this node's training data,
    or over the share of it the server asks for, drawn here with this client's own generator
    (`hetfl.engine.statistics.client_bn_statistics`); the server combines all nodes' sums."""
    request = from_content(msg.content)
    node = node_for(context, request["config"], build)
    device = node.program.device
    model = node.models.model_for(request["spec"])
    model.load_state_dict({k: v.to(device) for k, v in request["tensors"].items()}, strict=True)
    x_train = node.data.x_train.to(device)
    sums = client_bn_statistics(
        model, x_train, int(request["share"]), node.seed, node.cid, node.data.pixels
    )
    reply = {k: [mean.cpu(), var.cpu(), n] for k, (mean, var, n) in sums.items()}
    return Message(to_content({"stats": reply}), reply_to=msg)


def _check_cid(node: Node, cid: int) -> None:
    if cid != node.cid:
        raise ValueError(f"this node serves client {node.cid}, the task is for client {cid}")
