"""The call tree of a trace's host events (Trace's `parent` column): the innermost CPU event that
encloses each CPU event on its thread.

The rule: in (thread, start, longest first, row) order, the parent of an event is the nearest
earlier event on its thread still open when it starts (end > start). An event that starts exactly
when another ends is its sibling, not its child.
"""
from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING

import numpy as np

from auditor.evidence.trace.decode import CPU_NESTING

# The parents of a large trace's host events are settled in threads (enclosing's `parts`): on the
# 506 MB tiling's 1.4 M events, 0.06 s on one core, 0.04 s in two threads.
MAX_PARTS = 4
PART_MIN_EVENTS = 1 << 17
FEW_THREADS = 8  # host threads grouped by a pass each rather than a sort

if TYPE_CHECKING:  # (pandas is imported where a trace is read: an audit without one never pays for it)
    import pandas as pd


def _small_codes(codes: np.ndarray, count: int) -> np.ndarray:
    """Dense codes in the smallest int type that holds them (numpy sorts 8- and 16-bit ints stably
    by radix, in one pass)."""
    for dtype in (np.int8, np.int16, np.int32):
        if count <= np.iinfo(dtype).max:
            return codes.astype(dtype, copy=False)
    return codes


def thread_time_order(pid: np.ndarray, tid: np.ndarray, ts: np.ndarray, dur: np.ndarray,
                      rows: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Indices sorted by (thread, start, longest first), as np.lexsort((-dur, ts, tid, pid)) would
    group them, but fast on traces already in time order: a stable sort by start (nearly sorted
    input), a re-sort of equal-start runs only, then a stable sort by a dense thread code. Also
    returns, in that order, where each thread's run begins (a bool per index). With `rows`, of the
    events at those rows of the arrays (indices into `rows`)."""
    import pandas as pd

    def of(col: np.ndarray, at: np.ndarray | None = None) -> np.ndarray:
        """`col` at indices `at` (all when None) of the events."""
        picked = rows if at is None else at if rows is None else rows[at]
        return col if picked is None else col[picked]

    starts = of(ts)
    order = np.argsort(starts, kind="stable")
    sorted_ts = starts[order]
    tie = np.flatnonzero(sorted_ts[1:] == sorted_ts[:-1])
    del sorted_ts
    if len(tie):
        in_run = np.zeros(len(order), dtype=bool)
        in_run[tie] = True
        in_run[tie + 1] = True
        at = np.flatnonzero(in_run)
        sub = order[at]
        order[at] = sub[np.lexsort((-of(dur, sub), starts[sub]))]
    del starts
    tcode, tuniq = pd.factorize(of(tid))
    pid = of(pid)
    # (one process, the usual host trace, needs no hashing of its pids: a pass compares them)
    pcode, puniq = pd.factorize(pid) if len(pid) and not (pid == pid[0]).all() else (None, pid[:1])
    del pid
    if len(puniq) > 1:
        thread, uniq = pd.factorize(pcode.astype(np.int64) * max(len(tuniq), 1) + tcode)
        count = len(uniq)
    else:
        thread, count = tcode, len(tuniq)
    code = _small_codes(thread, count)[order]
    del thread
    thread_start = np.zeros(len(order), dtype=bool)
    if count <= FEW_THREADS:  # (a pass per thread: cheaper than a sort, stable as one)
        runs = [np.compress(code == k, order) for k in range(count)]
        thread_start[np.cumsum([0] + [len(run) for run in runs[:-1]])] = True
        return np.concatenate(runs), thread_start
    by_thread = np.argsort(code, kind="stable")
    order = order[by_thread]
    code = code[by_thread]
    thread_start[:1] = True
    np.not_equal(code[1:], code[:-1], out=thread_start[1:])
    return order, thread_start


def enclosing(pid: np.ndarray, tid: np.ndarray, ts: np.ndarray, dur: np.ndarray, parts: int = 1) -> np.ndarray:
    """For events given as arrays (host events, none instant): the index of each one's parent
    (-1: none). See _settled."""
    n = len(ts)
    parent = np.full(n, -1, dtype=np.int64)
    if n:
        rows, cur = _settled(np.arange(n), pid, tid, ts, dur, parts)
        found = np.flatnonzero(cur >= 0)
        parent[rows[found]] = rows[cur[found]]
    return parent


def _settled(rows: np.ndarray, pid: np.ndarray, tid: np.ndarray, ts: np.ndarray, dur: np.ndarray,
             parts: int) -> tuple[np.ndarray, np.ndarray]:
    """`rows` (host events, none instant) in (thread, start, longest first) order, and for each the
    position in that order of its parent (-1: none). Found by pointer jumping in numpy (O(n log n),
    no Python loop over events): each event's candidate starts as the event before it and, while
    the candidate has ended by the event's start, moves to the candidate's own candidate.

    With `parts` > 1, the events (in that order) are cut into that many runs, each settled in a
    thread of its own (numpy lets go of the interpreter while it moves arrays): an event whose run
    holds no candidate left then starts again from the last event of the run before it, whose
    candidates are final (_stitch). Every order of those moves ends at the one parent the rule
    names. (Each column is read for `rows` only where it is used: a parse's arrays are made once
    and touched once, and fresh memory costs more than the work on it.)"""
    n = len(rows)
    order, thread_start = thread_time_order(pid, tid, ts, dur, rows)
    rows = rows[order]
    del order
    it = np.int32 if n < np.iinfo(np.int32).max else np.int64  # half the bytes every round moves
    start = ts[rows]
    end = dur[rows]
    end += start
    # cur[i]: a candidate such that every event strictly between it and i has ended by start[i]
    cur = np.arange(-1, n - 1, dtype=it)
    cur[thread_start] = -1
    cuts = [n * k // max(parts, 1) for k in range(max(parts, 1) + 1)]
    runs = list(zip(cuts[:-1], cuts[1:]))
    cur[cuts[1:-1]] = -1
    # (each run's arrays are made here: memory a thread allocates stays in its own malloc arena)
    work = [_Settling(cur, start, end, _first_round(start, end, thread_start, lo, hi), first=True) for lo, hi in runs]
    if len(work) == 1:
        work[0].run()
    else:
        threads = [threading.Thread(target=w.run) for w in work]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for lo, hi in runs[1:]:  # (in order: each run's stitch reads the run before it as final)
            _stitch(cur, start, end, thread_start, lo, hi)
    return rows, cur


def _first_round(start: np.ndarray, end: np.ndarray, thread_start: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """The events of [lo, hi) whose candidate (the event before them in the run) ended by their start."""
    it = np.int32 if len(start) < np.iinfo(np.int32).max else np.int64
    active = np.flatnonzero((end[lo:hi - 1] <= start[lo + 1:hi]) & ~thread_start[lo + 1:hi]).astype(it)
    active += lo + 1
    return active


def _stitch(cur: np.ndarray, start: np.ndarray, end: np.ndarray, thread_start: np.ndarray, lo: int, hi: int) -> None:
    """Settle the events of the run [lo, hi) that found no candidate in it, on the thread of the
    event before `lo` (whose candidates are final): every event between that one and them has
    ended by their start."""
    if thread_start[lo]:
        return
    later = np.flatnonzero(thread_start[lo:hi])
    stop = lo + int(later[0]) if len(later) else hi
    orphans = (np.flatnonzero(cur[lo:stop] < 0) + lo).astype(cur.dtype)
    if len(orphans):
        cur[orphans] = lo - 1
        _Settling(cur, start, end, orphans, first=False).run()


class _Settling:
    """Moves the candidate of every `active` event (those whose candidate has ended by their start,
    when `first`) until it is still open at the event's start or there is none (-1). `run` makes
    no arrays: every round works in the buffers made with it (fresh memory costs more than the work
    on it)."""

    def __init__(self, cur: np.ndarray, start: np.ndarray, end: np.ndarray, active: np.ndarray, first: bool) -> None:
        k, it = len(active), cur.dtype
        self.cur, self.start, self.end, self.active, self.first = cur, start, end, active, first
        self.bufs = (active, np.empty(k, dtype=it))
        self.cand, self.cand2 = np.empty(k, dtype=it), np.empty(k, dtype=it)
        self.ends, self.starts = np.empty(k, dtype=np.float64), np.empty(k, dtype=np.float64)
        self.mask = np.empty(k, dtype=bool)

    def run(self) -> None:
        cur, start, end, active, first = self.cur, self.start, self.end, self.active, self.first
        bufs, cand, cand2, ends, starts, mask = self.bufs, self.cand, self.cand2, self.ends, self.starts, self.mask
        k, side = len(active), 0
        while k:
            if not first:  # keep the events whose candidate has ended by their start
                c = np.take(cur, active, out=cand[:k], mode="clip")
                m = np.less_equal(np.take(end, c, out=ends[:k], mode="clip"),
                                  np.take(start, active, out=starts[:k], mode="clip"), out=mask[:k])
                k = int(np.count_nonzero(m))
                side ^= 1
                active = np.compress(m, active, out=bufs[side][:k])
            first = False
            # everything the candidate skipped ended by its own start <= start[i]: jump past it as well
            c = np.take(cur, active, out=cand[:k], mode="clip")
            c2 = np.take(cur, c, out=cand2[:k], mode="clip")
            cur[active] = c2
            m = np.greater_equal(c2, 0, out=mask[:k])
            k = int(np.count_nonzero(m))
            side ^= 1
            active = np.compress(m, active, out=bufs[side][:k])


def _parts(n: int) -> int:
    """How many threads settle the parents of n events: one per usable core (at most MAX_PARTS),
    each with PART_MIN_EVENTS or more."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (OSError, AttributeError):
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_PARTS, n // PART_MIN_EVENTS))


def host_rows(cat: np.ndarray, instant: np.ndarray) -> np.ndarray:
    """Rows of the events the call tree is made of: host events with a duration."""
    return np.flatnonzero(np.isin(cat, CPU_NESTING) & ~instant)


def nest(cat: np.ndarray, instant: np.ndarray, pid: np.ndarray, tid: np.ndarray, ts: np.ndarray,
         dur: np.ndarray) -> np.ndarray:
    """Row of the innermost host event enclosing each host event on the same thread (-1: none)."""
    parent = np.full(len(cat), -1, dtype=np.int64)
    cpu = host_rows(cat, instant)
    if len(cpu):
        rows, cur = _settled(cpu, pid, tid, ts, dur, _parts(len(cpu)))
        del cpu
        found = np.flatnonzero(cur >= 0)
        parent[rows[found]] = rows[cur[found]]
    return parent
