"""The strategy's set-up query (`SetupQuery`, FedFA's ZiCo scores) asked of every client as
units of the executor in use, each answer kept on disk so that a sweep asks it once.

One unit per client (`answer_setup_query`), the same function in process and in a worker,
so that an answer does not depend on where it was computed: the process and Ray executors
spread a hundred clients' ZiCo scores over their workers as they spread a round's
trainings.

The cache: an answer depends on the query (its `key`: for ZiCo, every candidate's
architecture, the batch size and the number of batches), what the client is told (FedFA's
MACs budget, `Capabilities.setup_query_clients`), the client's data (its training samples
and labels, and how stored pixels are standardised) and the client's generator (from the
run's seed), and on nothing else; its file is named by a SHA-256 over the four and holds
the answer as JSON, whose floats read back bit for bit. A changed architecture,
client data or seed names another file. Files are written to a temporary name and renamed,
so that units writing at once, or a run stopped mid-write, never leave half a file under a
final name. A query whose `key` is None is never cached.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import torch

from hetfl.core.client.program import Programs
from hetfl.core.server.strategy import SetupQuery
from hetfl.core.types import ClientData, ClientInfo
from hetfl.engine.progress import Progress
from hetfl.sim.executor import Executor
from hetfl.sim.tasks import WorkerContext

#: How many steps a set-up query's units go in (one progress line each), with at least
#: `STEP_UNITS` units a step, so that up to that many workers stay busy between two lines.
SETUP_STEPS = 10
STEP_UNITS = 16


class SetupQueryItem(NamedTuple):
    """One client's set-up query: `told` what it is told before it answers (under what it
    declared itself in `info`, which wins), `generator` its (seed, 0, client,
    "setup-query") generator, `cache` the folder its answer is kept in (None: not kept)."""

    query: SetupQuery
    info: ClientInfo
    data: ClientData
    generator: torch.Generator
    cache: Path | None
    told: Mapping[str, Any]


class SetupAsk(NamedTuple):
    """What a run asks its clients at set-up: the query, the generator of each client it
    asks (the others are not asked), the folder answers are kept in (None: not kept), and
    what each asked client is told (`Capabilities.setup_query_clients`)."""

    query: SetupQuery
    generators: Mapping[int, torch.Generator]
    cache: Path | None
    told: Mapping[int, Mapping[str, Any]]


def ask_clients(
    executor: Executor,
    programs: Programs,
    asked: SetupAsk,
    infos: Mapping[int, ClientInfo],
    clients: Mapping[int, ClientData],
    progress: Progress,
) -> dict[int, ClientInfo]:
    """Every client's info, the asked ones' (those `asked.generators` holds) with the
    answer merged under what it declared itself (which wins), the answers computed as
    units of `executor` in `SETUP_STEPS` steps, each shown by `progress`, and timed as the
    set-up phase `setup_query`."""
    items = [
        SetupQueryItem(
            asked.query, infos[cid], clients[cid], generator, asked.cache, asked.told[cid]
        )
        for cid, generator in asked.generators.items()
    ]
    answers: list[Mapping[str, Any]] = []
    step = max(STEP_UNITS, -(-len(items) // SETUP_STEPS))
    about = f"asking {len(items)} of {len(infos)} clients the strategy's set-up query"
    if items:
        with progress.phase("setup_query", about=about):
            for start in range(0, len(items), step):
                answers += executor.map(programs, answer_setup_query, items[start : start + step])
                progress.step("setup_query", len(answers), len(items), "clients")
    merged = {
        item.info.cid: replace(item.info, attrs={**answer, **item.info.attrs})
        for item, answer in zip(items, answers, strict=True)
    }
    return {cid: merged.get(cid, info) for cid, info in infos.items()}


def answer_setup_query(ctx: WorkerContext, item: SetupQueryItem) -> Mapping[str, Any]:
    """The client's answer, told `item.told`: read from the cache when kept there, else
    computed (and kept) by the process's copy of the query (`WorkerContext.setup_query`)."""
    query = ctx.setup_query(item.query)
    key = query.key
    info = replace(item.info, attrs={**item.told, **item.info.attrs}) if item.told else item.info
    if item.cache is None or key is None:
        return query(info, item.data, item.generator)
    digest = answer_digest(key, item.data, item.generator, item.told)
    path = item.cache / f"{digest}.json"
    if path.is_file():
        return dict(json.loads(path.read_text())["answer"])
    answer = query(info, item.data, item.generator)
    _write_atomically(path, {"key": key, "cid": item.info.cid, "answer": dict(answer)})
    return answer


def answer_digest(
    key: str, data: ClientData, generator: torch.Generator, told: Mapping[str, Any]
) -> str:
    """The SHA-256 (hex) of what an answer depends on: the query's `key`, what the client
    is told (JSON, its floats written exactly), the client's training data and pixel
    standardisation, and its generator's state."""
    digest = hashlib.sha256(key.encode())
    digest.update(json.dumps(dict(told), sort_keys=True).encode())
    for tensor in (data.x_train, data.y_train):
        plain = tensor.detach().cpu().contiguous()
        digest.update(f"{plain.dtype}{tuple(plain.shape)}".encode())
        digest.update(plain.reshape(-1).view(torch.uint8).numpy().tobytes())
    digest.update(repr(data.pixels).encode())
    digest.update(generator.get_state().numpy().tobytes())
    return digest.hexdigest()


def _write_atomically(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".part")
    try:
        with os.fdopen(fd, "w") as out:
            json.dump(record, out)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
