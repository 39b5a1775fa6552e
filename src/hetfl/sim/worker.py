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
index, unit, item); ("stop",). Worker to parent: "ready" once, by `multiprocessing`'s
pickler, when its set-up is done (the parent waits for it before the run's first exchange,
so a worker's start is not charged to round 1); then ("done", index, result) or ("error",
index, traceback text) when a unit raised.

Memory: a worker is forked from the fork server, which holds torch and HetFL imported
(about 150 MiB, shared page by page until written). CPython's cyclic collector writes to
the header of every object it examines, so a worker's first full collection would copy
every inherited page that holds a tracked object; `gc.freeze()` first thing moves the
inherited objects out of the collector's reach (the Python documentation of `gc.freeze`
names this use). The heap is set up as a worker's (`hetfl.engine.heap.tune_worker_heap`:
a fixed threshold for mapping large blocks apart, no trimming by free()), and each exchange
starts by handing its free pages back (`trim_heap`): a training exchange leaves its freed
activations in the heap among blocks that outlive it, and without the trim they stay
resident beside the next exchange's (an evaluation's large batches), in every worker at
once. Measured on workload H of `benchmarks/` (HeteroFL, four widths, two workers): peak
PSS of the run's processes 2.73 GiB without the trim, 2.37 with.
"""

from __future__ import annotations

import gc
import os
import signal
import traceback
from collections.abc import Sequence
from multiprocessing.connection import Connection

import torch

from hetfl.core.plugins import load_plugins
from hetfl.engine.device import make_deterministic
from hetfl.engine.heap import trim_heap, tune_worker_heap
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
    gc.freeze()  # before any collection can touch the fork server's objects
    tune_worker_heap(os.environ)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)
    make_deterministic(torch.device(device), deterministic)
    load_plugins(plugins)
    receiver, sender = Receiver(conn), Sender(conn)
    conn.send("ready")
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
            trim_heap()
        elif kind == "unit":
            _, index, unit, item = msg
            sender.reset()
            try:
                assert ctx is not None, "a unit arrived before the programs"
                answer = ("done", index, unit(ctx, item))
            except Exception:
                answer = ("error", index, traceback.format_exc())
            sender.send(answer)
