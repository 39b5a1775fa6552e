"""The per-client trace, `clients.jsonl`: who trained, what it cost, who got a bad model.

`metrics.jsonl` holds a round's means; the trace holds its clients, one row per (round,
client) for every client that was asked to train that round (whether its result was kept
or excluded) or was evaluated on its local test split, in client-id order within a round.
Every row has every key of `TRACE_KEYS` (null where it does not apply); docs/contracts.md
§1.7 defines each. Nothing in a row is measured in wall time, so a run's trace is the same
under every executor, after a resume and under the Flower engine.

The numbers are those the engine already has: the charges the counters add up
(`RoundOutcome.charges`), the simulated times the clock computed (`RoundOutcome.times`),
the kept results, the failures, a defence's decision (`RoundOutcome.defence`) and the
local scores `local_acc` averages. A row's `fields`
are what the method declares per client (`Strategy.trace_fields`, and a client program
with a `trace_fields` method, `TracedProgram`: an attack's malicious flag).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from hetfl.core.spec import Spec
from hetfl.core.types import ClientTask, ClientTimes
from hetfl.engine.steps import Charge, LocalScore, RoundOutcome

TRACE_KEYS = (
    "round",
    "cid",
    "sampled",
    "spec",
    "fields",
    "samples",
    "steps",
    "loss",
    "bytes_down",
    "bytes_up",
    "macs",
    "sim",
    "failure",
    "defence",
    "local_acc",
    "local_loss",
    "group",
    "local_acc_trained",
)
#: A JSON scalar: what a declared field may be in a row.
Scalar = bool | int | float | str | None


@runtime_checkable
class TracedProgram(Protocol):
    """A client program (or a wrapper, such as an attack) that declares fields of its own
    for its client's trace rows, e.g. `{"malicious": True}`."""

    def trace_fields(self) -> Mapping[str, Scalar]: ...


def spec_object(spec: Spec) -> dict[str, Any]:
    """`spec` as a JSON object: every entry (the family's width ratios per slot, stages and
    blocks, input shape, classes, capacity, ...), tuples as lists. A model family's specs
    name their sub-models by these entries, so two clients with equal `spec` objects
    trained the same sub-model."""
    return _listed(spec.to_dict())


def _listed(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _listed(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_listed(v) for v in value]
    return value


def checked_fields(fields: Mapping[str, Any], source: str) -> dict[str, Scalar]:
    """Declared fields as they go into a row: JSON scalars under string names, else an
    error naming the field and `source` (who declared it)."""
    out: dict[str, Scalar] = {}
    for name, value in fields.items():
        finite = not isinstance(value, float) or math.isfinite(value)
        if not (isinstance(name, str) and isinstance(value, Scalar) and finite):
            raise ValueError(
                f"{source} declared the trace field {name!r} = {value!r:.60}; a field must "
                "be a string name with a finite number, a string, a boolean or None"
            )
        out[name] = value
    return out


def _sim(times: ClientTimes | None) -> dict[str, Any] | None:
    if times is None:
        return None
    return {
        "profile": times.profile,
        "compute_s": times.compute_s,
        "server_s": times.server_s,
        "down_s": times.down_s,
        "up_s": times.up_s,
        "total_s": times.total_s,
    }


def trace_rows(
    rnd: int,
    tasks: Sequence[ClientTask],
    outcome: RoundOutcome,
    local: Sequence[LocalScore],
    fields_of: Callable[[int, ClientTask | None], Mapping[str, Scalar]],
    trained: Sequence[LocalScore] = (),
) -> list[dict[str, Any]]:
    """Round `rnd`'s rows: each client with a task (`tasks`), or evaluated on its local test
    split (`local`), in client-id order. `fields_of(cid, task or None)` gives a client's
    declared fields; `trained` are the scores of this round's trained models
    (`eval.local_trained`)."""
    asked = {t.cid: t for t in tasks}
    kept = {r.cid: r for r in outcome.results}
    failed = {f.cid: f.kind for f in outcome.failures}
    scored = {s.cid: s for s in local}
    after_training = {s.cid: s.acc for s in trained}
    decided = {} if outcome.defence is None else outcome.defence.by_client
    rows = []
    for cid in sorted(asked.keys() | scored.keys()):
        task, result, score = asked.get(cid), kept.get(cid), scored.get(cid)
        charge = outcome.charges.get(cid, Charge())
        rows.append(
            {
                "round": rnd,
                "cid": cid,
                "sampled": task is not None,
                "spec": None if task is None else spec_object(task.spec),
                "fields": dict(fields_of(cid, task)),
                "samples": None if result is None else result.num_examples,
                "steps": None if result is None else result.num_steps,
                "loss": None if result is None else result.loss,
                "bytes_down": None if task is None else charge.bytes_down,
                "bytes_up": None if task is None else charge.bytes_up,
                "macs": None if task is None else charge.macs,
                "sim": _sim(outcome.times.get(cid)),
                "failure": failed.get(cid),
                "defence": decided.get(cid),
                "local_acc": None if score is None else score.acc,
                "local_loss": None if score is None else score.loss,
                "group": None if score is None else score.group,
                "local_acc_trained": after_training.get(cid),
            }
        )
    return rows
