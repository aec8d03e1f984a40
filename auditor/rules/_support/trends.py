"""Robust trend statistics over a series of steps: one slow step is not a trend."""
from __future__ import annotations

from statistics import median


def spearman(xs: list[float], ys: list[float]) -> float:
    """Rank correlation: a trend test that one outlier cannot fake."""
    n = len(xs)
    if n < 3:
        return 0.0

    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(n), key=lambda i: v[i])
        r = [0.0] * n
        i = 0
        while i < n:
            j = i
            while j + 1 < n and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / n, sum(ry) / n
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx = sum((a - mx) ** 2 for a in rx) ** 0.5
    vy = sum((b - my) ** 2 for b in ry) ** 0.5
    return cov / (vx * vy) if vx and vy else 0.0


EXACT_POINTS = 2000  # up to this many points every pair's slope is taken (2 million pairs)
SAMPLED_PAIRS = 2_000_000  # beyond, this many pairs drawn at random (the same draw for the same n)


def theil_sen(xs: list[float], ys: list[float]) -> float:
    """Median of pairwise slopes: a robust per-step trend. Up to EXACT_POINTS points, of every
    pair; beyond, of SAMPLED_PAIRS pairs drawn with a fixed seed, so time and memory stay bounded
    (the median of 2 million sampled slopes is within a fraction of a percent of the exact one's
    rank)."""
    import numpy as np

    n = len(xs)
    if n < 2:
        return 0.0
    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    if n <= EXACT_POINTS:
        i, j = np.triu_indices(n, 1)
    else:
        rng = np.random.default_rng(n)
        i, j = rng.integers(0, n, SAMPLED_PAIRS), rng.integers(0, n, SAMPLED_PAIRS)
    dx = x[j] - x[i]
    keep = dx != 0
    if not keep.any():
        return 0.0
    return float(np.median((y[j] - y[i])[keep] / dx[keep]))


def without_spikes(values: list[float], k: float = 6.0) -> list[int]:
    """Indexes of the values that are not isolated spikes: above median + k * MAD (the median
    absolute deviation, at least 2% of the median). A steady trend spreads the values, so its late
    steps stay in; a flat run's garbage-collection pauses and epoch boundaries drop out."""
    if len(values) < 4:
        return list(range(len(values)))
    mid = median(values)
    mad = max(median([abs(v - mid) for v in values]), 0.02 * abs(mid))
    return [i for i, v in enumerate(values) if v <= mid + k * mad]


def trend_ratio(xs: list[float], ys: list[float]) -> float:
    """End over start of the Theil-Sen line through (xs, ys): how much the trend itself grew,
    which one slow step at either end (a garbage collection, an epoch boundary) cannot fake."""
    if len(xs) < 2:
        return 1.0
    slope = theil_sen(xs, ys)
    intercept = median([y - slope * x for x, y in zip(xs, ys)])
    # a steep line may start below zero: it cannot start below the fastest step actually seen
    start = max(intercept + slope * xs[0], min(ys))
    end = intercept + slope * xs[-1]
    return end / start if start > 0 else 1.0


def quarter_medians(values: list[float]) -> tuple[float, float]:
    q = max(1, len(values) // 4)
    return median(values[:q]), median(values[-q:])


def quarter_floors(values: list[float]) -> tuple[float, float]:
    """The fastest value of the first and of the last quarter. Load from other processes only
    adds time to a step, in bursts that come and go: it lifts a quarter's median, but a quarter's
    fastest step stays near the work itself. Work that really grows lifts the floor too."""
    q = max(1, len(values) // 4)
    return min(values[:q]), min(values[-q:])
