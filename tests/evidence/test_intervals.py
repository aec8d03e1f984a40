"""Interval sets (auditor.evidence.trace.intervals) against a plain sweep: the union of intervals,
empty and backwards ones left out, as sorted disjoint (start, end) arrays."""
from __future__ import annotations

import numpy as np
import pytest

from auditor.evidence.trace.intervals import merge_intervals


def _sweep(starts: list[float], ends: list[float]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted((s, e) for s, e in zip(starts, ends) if e > s):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


@pytest.mark.parametrize("n", [0, 1, 2, 3, 17, 500])
@pytest.mark.parametrize("seed", range(4))
def test_merge_is_the_union_a_sweep_finds(n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, 60, size=n).astype(np.float64)
    ends = starts + rng.choice([-2.0, 0.0, 1.0, 3.0, 20.0], size=n)  # (backwards and empty ones too)
    got_s, got_e = merge_intervals(starts, ends)
    assert list(zip(got_s.tolist(), got_e.tolist())) == _sweep(starts.tolist(), ends.tolist())
    assert got_s is not starts and got_e is not ends  # (new arrays: a caller may write to them)


def test_touching_intervals_are_one() -> None:
    s, e = merge_intervals(np.array([5.0, 0.0, 2.0]), np.array([7.0, 2.0, 5.0]))
    assert s.tolist() == [0.0] and e.tolist() == [7.0]
