"""The call tree of a trace's host events (Trace's `parent` column): the innermost CPU event that
encloses each CPU event on its thread.

The rule: in (thread, start, longest first, row) order, the parent of an event is the nearest
earlier event on its thread still open when it starts (end > start). An event that starts exactly
when another ends is its sibling, not its child.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from auditor.evidence.trace.decode import CPU_NESTING


def thread_time_order(pid: np.ndarray, tid: np.ndarray, ts: np.ndarray, dur: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Indices sorted by (thread, start, longest first), as np.lexsort((-dur, ts, tid, pid)) would
    group them, but fast on traces already in time order: a stable sort by start (nearly sorted
    input), a re-sort of equal-start runs only, then a stable sort by a dense thread code. Also
    returns, in that order, where each thread's run begins (a bool per index)."""
    order = np.argsort(ts, kind="stable")
    sorted_ts = ts[order]
    tie = np.flatnonzero(sorted_ts[1:] == sorted_ts[:-1])
    if len(tie):
        in_run = np.zeros(len(order), dtype=bool)
        in_run[tie] = True
        in_run[tie + 1] = True
        at = np.flatnonzero(in_run)
        sub = order[at]
        order[at] = sub[np.lexsort((-dur[sub], ts[sub]))]
    pcode, _ = pd.factorize(pid)
    tcode, tuniq = pd.factorize(tid)
    thread = pcode.astype(np.int64) * max(len(tuniq), 1) + tcode
    by_thread = np.argsort(thread[order], kind="stable")
    order = order[by_thread]
    code = thread[order]
    thread_start = np.ones(len(order), dtype=bool)
    thread_start[1:] = code[1:] != code[:-1]
    return order, thread_start


def enclosing(pid: np.ndarray, tid: np.ndarray, ts: np.ndarray, dur: np.ndarray,
              ordered: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """For events given as arrays (host events, none instant): the index of each one's parent
    (-1: none). Found by pointer jumping in numpy (O(n log n), no Python loop). `ordered`:
    thread_time_order's result, when the caller has it."""
    parent = np.full(len(ts), -1, dtype=np.int64)
    if not len(ts):
        return parent
    order, thread_start = thread_time_order(pid, tid, ts, dur) if ordered is None else ordered
    start, end = ts[order], (ts + dur)[order]
    idx = np.arange(len(order))
    # cur[i]: a candidate such that every event strictly between it and i has ended by start[i]
    cur = idx - 1
    cur[thread_start] = -1
    active = idx[cur >= 0]
    while len(active):
        c = cur[active]
        active = active[end[c] <= start[active]]  # candidate already ended: keep jumping
        # everything the candidate skipped ended by its own start <= start[i]: jump past it as well
        cur[active] = cur[cur[active]]
        active = active[cur[active] >= 0]
    found = cur >= 0
    parent[order[found]] = order[cur[found]]
    return parent


def host_rows(cat: np.ndarray, instant: np.ndarray) -> np.ndarray:
    """Rows of the events the call tree is made of: host events with a duration."""
    return np.flatnonzero(np.isin(cat, CPU_NESTING) & ~instant)


def nest(cat: np.ndarray, instant: np.ndarray, pid: np.ndarray, tid: np.ndarray, ts: np.ndarray,
         dur: np.ndarray) -> np.ndarray:
    """Row of the innermost host event enclosing each host event on the same thread (-1: none)."""
    parent = np.full(len(cat), -1, dtype=np.int64)
    cpu = host_rows(cat, instant)
    if len(cpu):
        found = enclosing(pid[cpu], tid[cpu], ts[cpu], dur[cpu])
        hit = found >= 0
        parent[cpu[hit]] = cpu[found[hit]]
    return parent
