"""A defence's decisions in the run outputs (docs/contracts.md §1.7): the `defence` key of a
metrics row, its totals over the run in `summary.json`, counted as rounds end.

A defence is a reducer kind that decides per client (`norm-clip`, `krum`, `multi-krum`:
`hetfl.core.server.defences`); the round's `RoundDecisions` say, per trained client, "kept",
"clipped" or "dropped", and whether the round fell back to the coordinate-wise median.
The median and the trimmed mean keep every client and decide nothing: their runs report
`defence: null`, as do rounds that trained nobody. In an attacked run the counts are also
split by the malicious clients (`hetfl.attacks.malicious`); without malicious clients those
keys are null.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from typing import Any

from hetfl.core.server.defences import SEVERITY, RoundDecisions


def _counts(decided: RoundDecisions, malicious: Set[int]) -> dict[str, int]:
    """Clients by decision, all and the malicious ones: `kept`, ..., `malicious_dropped`."""
    counts = {d: 0 for d in SEVERITY} | {f"malicious_{d}": 0 for d in SEVERITY}
    for cid, decision in decided.by_client.items():
        counts[decision] += 1
        if cid in malicious:
            counts[f"malicious_{decision}"] += 1
    return counts


def _attacked_only(counts: Mapping[str, Any], attacked: bool) -> dict[str, Any]:
    return {
        k: (v if attacked or not k.startswith("malicious_") else None) for k, v in counts.items()
    }


def defence_row(decided: RoundDecisions | None, malicious: Set[int]) -> dict[str, Any] | None:
    """A metrics row's `defence`: {kind, kept, clipped, dropped, fallback, malicious_kept,
    malicious_clipped, malicious_dropped} over the round's trained clients (the malicious
    counts null in a run without malicious clients); None without a defence's decisions."""
    if decided is None:
        return None
    counts = _attacked_only(_counts(decided, malicious), bool(malicious))
    overall: dict[str, Any] = {d: counts.pop(d) for d in SEVERITY}
    return {"kind": decided.kind, **overall, "fallback": decided.fallback, **counts}


def add_round(totals: dict[str, Any], decided: RoundDecisions | None, malicious: Set[int]) -> None:
    """Add a round's decisions to the run's `totals` (the checkpointed counters' `defence`:
    empty until a round is defended)."""
    if decided is None:
        return
    totals.setdefault("kind", decided.kind)
    totals["rounds"] = totals.get("rounds", 0) + 1
    totals["fallback_rounds"] = totals.get("fallback_rounds", 0) + decided.fallback
    for key, n in _counts(decided, malicious).items():
        totals[key] = totals.get(key, 0) + n


def defence_summary(totals: Mapping[str, Any], attacked: bool) -> dict[str, Any] | None:
    """`summary.json`'s `defence`: the kind, the rounds it decided and those that fell
    back, its decisions over all of them, and in an attacked run the malicious updates
    kept, clipped and dropped and the honest ones dropped (null otherwise); None when no
    round was defended."""
    if not totals:
        return None
    summary = _attacked_only(totals, attacked)
    summary["honest_dropped"] = (
        totals["dropped"] - totals["malicious_dropped"] if attacked else None
    )
    return summary
