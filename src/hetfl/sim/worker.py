"""A worker process of the process executor: receives the run's data block and programs
once, then runs units (`hetfl.sim.tasks`) one at a time and answers each.

The worker sets up what a spawned process does not inherit from the run: its intra-op
thread count (the config's `threads`, the same for every unit in every executor, so that a
unit computes the same bits wherever it runs), the run's determinism settings, the device
and the run's plugins (`hetfl.core.plugins`), imported before any message, since the
programs may hold a plugin's classes (its model, its recipe's parts). It ignores Ctrl-C
(the parent stops it) and exits when the parent's end of its pipe closes, so that no worker
outlives the run.

Messages (wire format: `hetfl.sim.wire`), parent to worker:
("block",) then the shared block itself by `multiprocessing`'s pickler; ("programs",
programs); ("exchange",): a new exchange starts (forget tensors of the last); ("unit",
index, unit, item); ("stop",). Worker to parent: ("done", index, result) or ("error",
index, traceback text) when a unit raised.
"""

from __future__ import annotations

import signal
import traceback
from collections.abc import Sequence
from multiprocessing.connection import Connection

import torch

from hetfl.core.plugins import load_plugins
from hetfl.engine.device import make_deterministic
from hetfl.sim.tasks import WorkerContext
from hetfl.sim.wire import Receiver, Sender, SharedBuffer


def serve(
    conn: Connection,
    threads: int,
    device: str,
    deterministic: bool,
    plugins: Sequence[str] = (),
) -> None:
    """The worker's loop (the target of its process)."""

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)
    make_deterministic(torch.device(device), deterministic)
    load_plugins(plugins)
    receiver, sender = Receiver(conn), Sender(conn)
    ctx: WorkerContext | None = None
    while True:
        try:
            msg = receiver.recv()
        except (EOFError, OSError):
            return
        kind = msg[0]
        if kind == "stop":
            return
        if kind == "block":
            receiver.shared = sender.shared = SharedBuffer(conn.recv())
        elif kind == "programs":
            ctx = WorkerContext(msg[1])
        elif kind == "exchange":
            receiver.reset()
        elif kind == "unit":
            _, index, unit, item = msg
            sender.reset()
            try:
                assert ctx is not None, "a unit arrived before the programs"
                answer = ("done", index, unit(ctx, item))
            except Exception:
                answer = ("error", index, traceback.format_exc())
            sender.send(answer)
