"""The call tree of host events (auditor.evidence.trace.nesting) against a plain stack sweep, on
events that nest, overlap without nesting, tie on their start and spread over several processes
and threads."""
from __future__ import annotations

import numpy as np
import pytest

from auditor.evidence.trace import nesting
from auditor.evidence.trace.decode import CAT
from auditor.evidence.trace.nesting import nest


def _sweep(pid: np.ndarray, tid: np.ndarray, ts: np.ndarray, dur: np.ndarray, host: np.ndarray) -> np.ndarray:
    """In (thread, start, longest first, row) order, each host event's parent is the top of a stack
    from which every event that ended by its start was popped."""
    parent = np.full(len(ts), -1, dtype=np.int64)
    rows = sorted(np.flatnonzero(host).tolist(), key=lambda r: (pid[r], tid[r], ts[r], -dur[r], r))
    stack: list[int] = []
    thread = None
    for r in rows:
        if (pid[r], tid[r]) != thread:
            thread, stack = (pid[r], tid[r]), []
        while stack and ts[stack[-1]] + dur[stack[-1]] <= ts[r]:
            stack.pop()
        # an event below the top that ended is skipped too: the nearest earlier one still open
        open_ = [s for s in stack if ts[s] + dur[s] > ts[r]]
        parent[r] = open_[-1] if open_ else -1
        stack.append(r)
    return parent


@pytest.mark.parametrize("parts,few_threads", [(1, 8), (2, 8), (7, 0)])
@pytest.mark.parametrize("seed", range(6))
def test_nest_is_the_nearest_earlier_event_still_open(seed: int, parts: int, few_threads: int,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """In one run, or cut into runs settled in threads of their own and stitched (what a trace of
    millions of host events gets, one run per core); its 6 threads grouped by a pass each, or by a
    sort (as more than FEW_THREADS are)."""
    monkeypatch.setattr(nesting, "_parts", lambda n: parts)
    monkeypatch.setattr(nesting, "FEW_THREADS", few_threads)
    rng = np.random.default_rng(seed)
    n = 3000
    pid = rng.choice([7, 123456789012], size=n)
    tid = rng.choice([1, 2, 3], size=n)
    ts = rng.integers(0, 2000, size=n).astype(np.float64)  # many equal starts
    dur = rng.choice([0.0, 1.0, 3.0, 50.0, 400.0], size=n)
    cat = rng.choice([CAT["cpu_op"], CAT["python"], CAT["runtime"], CAT["kernel"]], size=n).astype(np.int8)
    instant = rng.random(n) < 0.05
    host = np.isin(cat, (CAT["cpu_op"], CAT["python"], CAT["runtime"])) & ~instant
    got = nest(cat, instant, pid, tid, ts, dur)
    want = _sweep(pid, tid, ts, dur, host)
    assert (got >= 0).sum() > n // 3  # most host events have a parent: the case is not trivial
    np.testing.assert_array_equal(got, want)
