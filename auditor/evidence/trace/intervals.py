"""Interval arithmetic the trace rules share (busy time, idle gaps, overlaps): an interval set is
a pair of numpy arrays (starts, ends); a merged set is sorted and disjoint."""
from __future__ import annotations

import numpy as np


def merge_intervals(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Union of intervals as sorted, disjoint (start, end) arrays."""
    starts = np.asarray(starts, dtype=np.float64)
    ends = np.asarray(ends, dtype=np.float64)
    keep = ends > starts
    if not keep.all():
        starts, ends = starts[keep], ends[keep]
    n = len(starts)
    if n < 2:  # (new arrays, as below: the caller's are never handed back)
        return starts.copy(), ends.copy()
    # (called thousands of times on a few intervals each: few numpy calls, no np.r_)
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    run_end = np.maximum.accumulate(e)
    new = np.empty(n, dtype=bool)
    new[0] = True
    np.greater(s[1:], run_end[:-1], out=new[1:])
    first = np.flatnonzero(new)
    last = np.empty_like(first)
    last[:-1] = first[1:] - 1
    last[-1] = n - 1
    return s[first], run_end[last]


def total_length(iv: tuple[np.ndarray, np.ndarray]) -> float:
    return float((iv[1] - iv[0]).sum())


def intersect(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Intersection of two merged interval sets."""
    (s1, e1), (s2, e2) = a, b
    if not len(s1) or not len(s2):
        return np.empty(0), np.empty(0)
    # for each interval of a, the b intervals that may overlap it
    lo = np.searchsorted(e2, s1, side="right")
    hi = np.searchsorted(s2, e1, side="left")
    counts = np.maximum(hi - lo, 0)
    if not counts.sum():
        return np.empty(0), np.empty(0)
    ia = np.repeat(np.arange(len(s1)), counts)
    offsets = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    ib = np.repeat(lo, counts) + offsets
    s = np.maximum(s1[ia], s2[ib])
    e = np.minimum(e1[ia], e2[ib])
    keep = e > s
    return s[keep], e[keep]


def subtract(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Parts of merged set `a` not covered by merged set `b`."""
    s1, e1 = a
    if not len(s1) or not len(b[0]):
        return a
    lo, hi = float(min(s1.min(), b[0].min())) - 1.0, float(max(e1.max(), b[1].max())) + 1.0
    # complement of b within [lo, hi], then intersect
    cs = np.r_[lo, b[1]]
    ce = np.r_[b[0], hi]
    return intersect(a, merge_intervals(cs, ce))


def clip(iv: tuple[np.ndarray, np.ndarray], lo: float, hi: float) -> tuple[np.ndarray, np.ndarray]:
    return merge_intervals(np.clip(iv[0], lo, hi), np.clip(iv[1], lo, hi))

