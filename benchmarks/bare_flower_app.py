"""A bare Flower app for `bench_deploy.py`: the Message API, a NumPy "model" and nothing
else (no torch, no HetFL), as the floor of a Flower round on the same machine.

Each round does what Flower's own FedAvg does and what HetFL's README example does: a
`train` exchange (each node adds one to the model and sends it back; the server averages)
and an `evaluate` exchange (each node answers a metric). The server pushes the messages
and pulls the replies every `poll-s` seconds, as HetFL's server does, and appends one JSON
line per round (`round`, `seconds`) to the file `out` of the run config.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

client_app = ClientApp()
server_app = ServerApp()


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    arrays = [a + 1 for a in msg.content.array_records["model"].to_numpy_ndarrays()]
    return Message(RecordDict({"model": ArrayRecord(arrays)}), reply_to=msg)


@client_app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return Message(RecordDict({"metrics": MetricRecord({"accuracy": 0.5})}), reply_to=msg)


def exchange(grid: Grid, messages: list[Message], poll_s: float) -> list[Message]:
    pending = {mid for mid in grid.push_messages(messages) if mid}
    replies: list[Message] = []
    while pending:
        for reply in grid.pull_messages(list(pending)):
            pending.discard(reply.metadata.reply_to_message_id)
            replies.append(reply)
        if pending:
            time.sleep(poll_s)
    return replies


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    nodes, rounds, poll_s = int(cfg["nodes"]), int(cfg["rounds"]), float(cfg["poll-s"])
    out = Path(str(cfg["out"]))
    while len(ids := sorted(grid.get_node_ids())) < nodes:
        time.sleep(poll_s)
    model = [np.zeros(int(cfg["size"]), dtype=np.float32)]
    for rnd in range(1, rounds + 1):
        started = time.time()
        for kind in ("train", "evaluate"):
            content = RecordDict({"model": ArrayRecord(model)})
            msgs = [Message(content, nid, kind, group_id=str(rnd)) for nid in ids]
            replies = exchange(grid, msgs, poll_s)
            if kind == "train":
                uploads = [r.content.array_records["model"].to_numpy_ndarrays()[0] for r in replies]
                model = [np.mean(uploads, axis=0)]
        with out.open("a") as f:
            f.write(json.dumps({"round": rnd, "seconds": time.time() - started}) + "\n")
