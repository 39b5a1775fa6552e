"""The benchmark's arithmetic: ratios of one repetition and their medians over repetitions.

A repetition's per-round ratio is the median over rounds of HetFL's round time over the
floor's same round; a workload's ratio is the median of that over repetitions (as are its
total-time and peak-memory ratios). Medians, so that one disturbed round or repetition
does not move the result.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def round_ratio(hetfl_s: Sequence[float], floor_s: Sequence[float]) -> float:
    """The median over rounds of hetfl_s[i] / floor_s[i] (the same rounds on both sides)."""
    if len(hetfl_s) != len(floor_s) or not hetfl_s:
        raise ValueError(
            f"per-round times of both sides must be non-empty and of one length, got "
            f"{len(hetfl_s)} and {len(floor_s)} rounds"
        )
    return statistics.median(h / f for h, f in zip(hetfl_s, floor_s, strict=True))


def per_round_medians(reps: Sequence[Sequence[float]]) -> list[float]:
    """Round by round, the median over repetitions of a side's round times."""
    return [statistics.median(col) for col in zip(*reps, strict=True)]


def verdict(value: float, target: float) -> str:
    """`target <= T: met` or `... MISSED`, to print next to a measured ratio."""
    return f"target <= {target:.2f}: {'met' if value <= target else 'MISSED'}"


def ratio_line(
    workload: str, ratio: float, target: float, versus: str = "floor", side: str = "hetfl"
) -> str:
    """A line a workload's result is read from: `A ratio hetfl/floor: 0.58  target ...`
    (`versus` "floor2": HetFL against the floor split over two one-thread processes;
    `side` "ray", `versus` "processes": HetFL's Ray executor against its process executor)."""
    return f"{workload} ratio {side}/{versus}: {ratio:.2f}  {verdict(ratio, target)}"


def floor_verdict(value: float, target: float) -> str:
    """`target >= T: met` or `... MISSED`, for a measured share that should reach `target`."""
    return f"target >= {target:.2f}: {'met' if value >= target else 'MISSED'}"
