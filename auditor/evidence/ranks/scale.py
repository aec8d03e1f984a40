"""What the rank rules and plots share to stay readable and fast for hundreds of ranks: medians that
leave one rank out without re-sorting (median_without), a distribution in a few numbers (spread),
hosts (host_of: "unknown" when the recording does not say), and how a list of ranks is named in
a sentence (name_ranks: the first few by name, then a count)."""
from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

from auditor.evidence.ranks.combine import rank_ranges
from auditor.evidence.ranks.model import RankInfo

UNKNOWN_HOST = "unknown"
NAMED_RANKS = 8  # ranks a sentence names one by one


def median_without(ordered: Sequence[float], value: float) -> float:
    """The median of `ordered` (sorted ascending) with one occurrence of `value` left out, in O(1)
    after the search: what `median(others)` gives for each rank of a step, without the O(n log n)
    per rank that made a job of 1,024 ranks cost seconds per rule. `ordered` holds at least 2."""
    n = len(ordered) - 1
    k = bisect_left(ordered, value)

    def at(i: int) -> float:  # the i-th of the values without the one at k
        return ordered[i if i < k else i + 1]

    return at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2


def spread(values: Sequence[float]) -> dict[str, float]:
    """A distribution in a few numbers: min, quartiles, p90, p99, max (rounded to 3 decimals)."""
    xs = sorted(values)
    if not xs:
        return {}

    def q(p: float) -> float:
        pos = p * (len(xs) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(xs) - 1)
        return round(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo), 3)

    return {"min": round(xs[0], 3), "p25": q(0.25), "median": q(0.5), "p75": q(0.75), "p90": q(0.9),
            "p99": q(0.99), "max": round(xs[-1], 3)}


def host_of(info: RankInfo | None) -> str:
    """The machine a rank ran on, as its recording says; "unknown" when it does not."""
    return (info.hostname if info is not None else "") or UNKNOWN_HOST


def name_ranks(ranks: list[int], limit: int = NAMED_RANKS) -> str:
    """`5`, `5, 17`, or for many `3, 9, 17, ... (40 ranks: 3-20, 40-61)`: the first `limit` in the
    order given, then how many and which, as ranges."""
    if len(ranks) <= limit:
        return ", ".join(map(str, ranks))
    return f"{', '.join(map(str, ranks[:limit]))}, ... ({len(ranks)} ranks: {rank_ranges(ranks)})"
