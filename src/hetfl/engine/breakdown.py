"""The elements beyond a coverage-aware rule's breakdown point in the run outputs
(docs/contracts.md §1.7): `summary.json`'s `breakdown`, counted as rounds end.

A coverage-aware rule (`coverage-median`, `coverage-trimmed-mean`: up to A = ceil(β·n) of a
round's n clients attack; `coverage-krum`, `coverage-multi-krum`: up to f) counts, each
round, the elements covered by k <= 2A clients (`hetfl.core.server.robust.Beyond`): under
the threat model where every attacker covers every element (Park and Joe-Wong, ECML-PKDD
2024, §3.1) attackers can be half or more of such an element's coverage, and no rule can
hold there. It is a property of the coverage and the declared attackers, not of who
attacked: a clean run with the same rule counts the same elements. A study report reads
it to mark the cells of attacked runs beyond the breakdown (`hetfl.paired`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hetfl.core.server.robust import Beyond


def add_round(totals: dict[str, Any], beyond: Beyond | None) -> None:
    """Add a round's count to the run's `totals` (the checkpointed counters' `breakdown`:
    empty until a coverage-aware rule has counted a round)."""
    if beyond is None:
        return
    totals["rounds"] = totals.get("rounds", 0) + 1
    totals["rounds_beyond"] = totals.get("rounds_beyond", 0) + bool(beyond.elements)
    totals["share_sum"] = totals.get("share_sum", 0.0) + beyond.share
    if beyond.share > totals.get("max_share", -1.0):
        totals |= {"max_share": beyond.share, "elements": beyond.elements}
        totals |= {"covered": beyond.covered, "attackers": beyond.attackers}
    totals["tensors"] = sorted({*totals.get("tensors", []), *beyond.tensors})


def breakdown_summary(totals: Mapping[str, Any]) -> dict[str, Any] | None:
    """`summary.json`'s `breakdown`: the rounds counted and those with any element beyond,
    the largest share over the rounds (`max_share`, with that round's `elements`, `covered`
    and `attackers`), the mean share over the counted rounds, and every tensor that held
    such an element in any round; None when no round was counted."""
    if not totals:
        return None
    return {
        "rounds": totals["rounds"],
        "rounds_beyond": totals["rounds_beyond"],
        "max_share": totals["max_share"],
        "mean_share": totals["share_sum"] / totals["rounds"],
        "elements": totals["elements"],
        "covered": totals["covered"],
        "attackers": totals["attackers"],
        "tensors": list(totals["tensors"]),
    }
