"""Waits that hit some steps only (a slow sample, workers that fall behind): how much of a run's
waits per step are such stalls, and the words for them."""
from __future__ import annotations

from statistics import median
from typing import Sequence

STALL_RATIO = 3.0  # a step that waited this many times the median step's wait ...
STALL_MIN_MS = 2.0  # ... and this much more than it stalled


def stall_ms(waits: Sequence[float]) -> float:
    """The waits past the median step's, per step: the part of the mean wait that stalls in some
    steps make (the mean less what every step waits)."""
    if not waits:
        return 0.0
    med = median(waits)
    return round(sum(max(0.0, w - med) for w in waits) / len(waits), 3)


def stalled(waits: Sequence[float]) -> list[int]:
    """The indices of the steps that stalled (STALL_RATIO, STALL_MIN_MS)."""
    if not waits:
        return []
    med = median(waits)
    return [i for i, w in enumerate(waits) if w > max(STALL_RATIO * med, med + STALL_MIN_MS)]


def stall_phrase(waits: Sequence[float]) -> str | None:
    """'3 of 13 steps stalled 62-73 ms, the others waited 1.4 ms (median)' where the stalls are
    most of the mean wait; None otherwise."""
    hit = stalled(waits)
    if not hit or stall_ms(waits) < 0.5 * sum(waits) / len(waits):
        return None
    lo, hi = min(waits[i] for i in hit), max(waits[i] for i in hit)
    rest = [w for i, w in enumerate(waits) if i not in set(hit)]
    span = f"{lo:.0f}-{hi:.0f}" if round(hi) > round(lo) else f"{hi:.0f}"
    return (f"{len(hit)} of {len(waits)} steps stalled {span} ms, the others waited "
            f"{median(rest) if rest else 0.0:.1f} ms (median)")
