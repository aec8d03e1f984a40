"""Why the GPU was idle: each gap of the device timeline (no kernel, copy or memset on any stream)
charged to causes by the launch (CUPTI correlation) of the op that ends it:

- launched before the gap began: `queued work` (the device waited on a dependency: another stream,
  an event wait, a collective, a graph's order), as is a wait over LAUNCH_SLACK_US after the launch;
- launched later: until the launch call began the host was late, `data loading` inside a
  DataLoader's `__next__`, `host synchronisation` from a blocking call its thread made since its
  previous launch, `host work` for the rest; from the call's start to the op's start, `launch`;
- no launch recorded: `queued work` when later work on its stream was launched before the gap
  began (a stream runs in order), else `untraced`, as is the window's idle tail.

A sync is charged only the idle it causes; removing it saves the smaller of its wait and the host's
work after it, which then overlaps the GPU's (SyncCharge.saving_us).
"""
from __future__ import annotations

from dataclasses import dataclass

import msgspec
import numpy as np

from auditor.evidence.trace.decode import CPU_NESTING, GPU_WORK, LAUNCH_SIDE
from auditor.evidence.trace.intervals import intersect, merge_intervals, total_length
from auditor.evidence.trace.model import Trace
from auditor.evidence.trace.names import EVENT_WAIT_CALLS, GRAPH_LAUNCH, is_comm_kernel
from auditor.evidence.trace.queries import DATALOADER_NEXT, blocking_calls

CAUSES = ("queued work", "host synchronisation", "data loading", "host work", "launch", "untraced")
# Causes a change on the host can give back; queued work waits on the device's own dependencies
# and untraced idle on something the trace does not show.
HOST_CAUSES = ("host synchronisation", "data loading", "host work", "launch")
# How the queued op's dependency shows in the trace (first that applies): it is a collective
# (a communication kernel, waiting for its peers' launch), it came from a graph launch, an event wait
# was issued on its launching thread before it, it runs on another stream than the work before the
# gap, or on the same stream.
QUEUED_KINDS = ("collective", "graph launch", "event wait", "another stream", "same stream")
# Microseconds a launched op may take to start after its launch call returned and still count as
# its launch (the driver's submission), not as a wait on a dependency.
LAUNCH_SLACK_US = 50.0
_COL = {c: i for i, c in enumerate(CAUSES)}


class GapCause(msgspec.Struct, frozen=True):
    """GPU idle time of one cause within a trace's window.

    cause: one of CAUSES; ms: idle of this cause in the window; ms_per_step: that over the trace's
    steps; gaps: gaps holding some of it; largest_ms: the largest share of one gap it took."""

    cause: str
    ms: float
    ms_per_step: float
    gaps: int
    largest_ms: float


class GapSummary(msgspec.Struct, frozen=True):
    """The idle time of a trace's window (its ProfilerSteps, else the whole trace) by cause.

    idle_ms: all idle in the window; steps: steps it spans; causes: one GapCause per cause in CAUSES
    order, zero ones included; queued_by_ms_per_step: queued-work idle by how its dependency shows
    (QUEUED_KINDS); recoverable_ms_per_step: idle of HOST_CAUSES, what host-side fixes can give back."""

    idle_ms: float
    steps: int
    causes: list[GapCause]
    queued_by_ms_per_step: dict[str, float]
    recoverable_ms_per_step: float

    def ms_per_step(self, cause: str) -> float:
        return next((c.ms_per_step for c in self.causes if c.cause == cause), 0.0)


@dataclass
class Gaps:
    """Every gap of a trace's window (numpy arrays, one entry per gap, by start).

    start/end (us); next_row: the GPU row that ends it (-1: none); launch_row: its launch call (-1:
    not recorded); us: idle per cause, shape (gaps, len(CAUSES)); sync_row: the blocking call
    charged with the gap's `host synchronisation` part (-1: none); queued_kind: index into
    QUEUED_KINDS of a queued gap's dependency (-1: not queued); queued_from: where the gap's
    `queued work` part begins (it runs to the gap's end; = end when it has none)."""

    start: np.ndarray
    end: np.ndarray
    next_row: np.ndarray
    launch_row: np.ndarray
    us: np.ndarray
    sync_row: np.ndarray
    queued_kind: np.ndarray
    queued_from: np.ndarray

    def of(self, cause: str) -> np.ndarray:
        return self.us[:, CAUSES.index(cause)]


def gap_table(trace: Trace) -> Gaps:
    """The gaps of the trace's window with their causes, made once per trace. The host waits in the
    calls queries.blocking_calls finds (the auditor's own left out) and loads data inside the
    DataLoader's `__next__`."""
    cached = trace.__dict__.get("_gap_table")
    if cached is not None:
        return cached
    blocking = blocking_calls(trace)
    rows = np.flatnonzero(np.isin(trace.col("cat"), CPU_NESTING) & ~trace.col("instant")
                          & np.isin(trace.col("name"), trace.symbols.matching(DATALOADER_NEXT)))
    loader = merge_intervals(trace.col("ts")[rows], trace.col("end")[rows])
    ts, end, link = trace.col("ts"), trace.col("end"), trace.col("link")
    gpu, s, e, nxt, prev = _idle_spans(trace)
    n = len(s)
    launch = np.where(nxt >= 0, link[np.maximum(nxt, 0)], -1).astype(np.int64)
    us = np.zeros((n, len(CAUSES)))
    sync_row = np.full(n, -1, dtype=np.int64)
    queued_kind = np.full(n, -1, dtype=np.int64)
    queued_from = e.copy()
    threads = _ThreadIndex(trace, blocking)
    queued_later = _queued_later(trace, gpu)
    # a gap whose next op was launched before it began is all queued work (most gaps of a
    # GPU-bound trace): set for all of them at once, the loop below judges the others
    queued_before = (launch >= 0) & (end[np.maximum(launch, 0)] <= s)
    us[queued_before, _COL["queued work"]] = (e - s)[queued_before]
    queued_from[queued_before] = s[queued_before]
    kinded: list[int] = np.flatnonzero(queued_before).tolist()  # the gaps with queued work (kinds found at the end)
    for i in np.flatnonzero(~queued_before).tolist():
        a, b, L = float(s[i]), float(e[i]), int(launch[i])
        if L < 0:
            # A stream runs its work in order: the op was queued already if work after it on its
            # stream was launched before the gap began (a launch from before the profiler started).
            if nxt[i] >= 0 and queued_later.get(int(nxt[i]), np.inf) <= a:
                us[i, _COL["queued work"]] = b - a
                queued_from[i] = a
                kinded.append(i)
            else:
                us[i, _COL["untraced"]] = b - a
            continue
        waited, sync_row[i] = _charge_launched_later(us[i], a, b, L, float(ts[L]), float(end[L]), loader, threads)
        if waited > 0:
            queued_from[i] = b - waited
            kinded.append(i)
    if kinded:
        at = np.sort(np.asarray(kinded, dtype=np.int64))
        queued_kind[at] = _queued_kinds(trace, threads, launch[at], nxt[at], prev[at])
    out = Gaps(start=s, end=e, next_row=nxt, launch_row=launch, us=us, sync_row=sync_row, queued_kind=queued_kind,
               queued_from=queued_from)
    trace.__dict__["_gap_table"] = out
    return out


def _idle_spans(trace: Trace) -> tuple[np.ndarray, ...]:
    """(gpu, start, end, next, prev): the GPU work rows by start, then every gap of the window
    (clipped to it, empty ones left out) with the rows of the op that ends it and of the op before
    it (-1: none; the window's idle tail has no next op)."""
    lo, hi = trace.window()
    cat, ts, end = trace.col("cat"), trace.col("ts"), trace.col("end")
    gpu = np.flatnonzero(np.isin(cat, GPU_WORK) & (end > ts))
    gpu = gpu[np.lexsort((end[gpu], ts[gpu]))]
    g_ts, g_end = ts[gpu].astype(np.float64), end[gpu].astype(np.float64)
    run_end = np.maximum.accumulate(g_end) if len(gpu) else g_end
    # a gap opens before each op that starts after everything before it ended, and before the first
    opens = np.flatnonzero(np.r_[True, g_ts[1:] > run_end[:-1]]) if len(gpu) else np.empty(0, dtype=np.int64)
    starts = np.r_[lo, run_end[opens[1:] - 1]] if len(opens) else np.array([lo])
    ends = g_ts[opens] if len(opens) else np.array([hi])
    nxt = gpu[opens] if len(opens) else np.array([-1])
    prev = np.r_[-1, gpu[opens[1:] - 1]] if len(opens) else np.array([-1])
    if len(opens) and run_end[-1] < hi:  # the tail: idle until the window ends, nothing after it
        starts, ends = np.r_[starts, run_end[-1]], np.r_[ends, hi]
        nxt, prev = np.r_[nxt, -1], np.r_[prev, gpu[-1]]
    s, e = np.clip(starts, lo, hi), np.clip(ends, lo, hi)
    keep = e > s
    return gpu, s[keep], e[keep], nxt[keep].astype(np.int64), prev[keep].astype(np.int64)


def _charge_launched_later(us: np.ndarray, a: float, b: float, L: int, ls: float, le: float,
                           loader: tuple[np.ndarray, np.ndarray], threads: _ThreadIndex) -> tuple[float, int]:
    """Charge gap [a, b), whose op's launch call L ([ls, le]) ended after the gap began, in `us`
    (its row of the table): (the queued wait after the call returned, the blocking call charged
    with host synchronisation or -1)."""
    p = min(max(ls, a), b)  # the host's part ends where the launch call starts
    ready = min(max(le, p), b)  # the call returned: from then on the op was queued
    waited = max(b - ready - LAUNCH_SLACK_US, 0.0)
    us[_COL["queued work"]] = waited
    us[_COL["launch"]] = (b - p) - waited
    if p <= a:
        return waited, -1
    loading = _overlap((np.array([a]), np.array([p])), loader)
    us[_COL["data loading"]] = loading
    rest = (p - a) - loading
    g, g_start = threads.sync_before(L, p)
    if g >= 0:
        lo_sync = max(a, g_start)
        charged = (p - lo_sync) - _overlap((np.array([lo_sync]), np.array([p])), loader)
        charged = min(max(charged, 0.0), rest)
        us[_COL["host synchronisation"]] = charged
        rest -= charged
    us[_COL["host work"]] = max(rest, 0.0)
    return waited, g


def summarize(trace: Trace, gaps: Gaps) -> GapSummary:
    """The gaps' idle by cause, in ms and ms per step of the trace."""
    steps = trace.step_count()
    causes = []
    for k, cause in enumerate(CAUSES):
        col = gaps.us[:, k]
        total = float(col.sum()) / 1000.0
        causes.append(GapCause(cause=cause, ms=round(total, 3), ms_per_step=round(total / steps, 3),
                               gaps=int((col > 0).sum()),
                               largest_ms=round(float(col.max()) / 1000.0, 3) if len(col) else 0.0))
    queued = gaps.of("queued work")
    by_kind = {kind: round(float(queued[gaps.queued_kind == j].sum()) / 1000.0 / steps, 3)
               for j, kind in enumerate(QUEUED_KINDS)}
    host = sum(float(gaps.of(c).sum()) for c in HOST_CAUSES) / 1000.0
    return GapSummary(idle_ms=round(float(gaps.us.sum()) / 1000.0, 3), steps=steps, causes=causes,
                      queued_by_ms_per_step=by_kind, recoverable_ms_per_step=round(host / steps, 3))


class SyncCharge(msgspec.Struct, frozen=True):
    """What one group of blocking calls (a sync the user made, in one or more runtime rows) costs.

    blocked_us: the host's time in them (their union); idle_us: GPU idle charged to them (from the
    sync until its thread's next launch, queued-work idle excluded); saving_us: what removing them
    saves on the step's critical path, the smaller of the two: without the wait, the host's work
    after it overlaps the GPU's instead of following it."""

    blocked_us: float
    idle_us: float
    saving_us: float


def sync_charges(trace: Trace, gaps: Gaps, groups: list[list[int]]) -> list[SyncCharge]:
    """SyncCharge per group of blocking rows (rows of the same call, as host-sync groups them)."""
    sync_us = gaps.of("host synchronisation")
    charged: dict[int, float] = {}
    for row, x in zip(gaps.sync_row.tolist(), sync_us.tolist()):
        if row >= 0:
            charged[row] = charged.get(row, 0.0) + x
    ts, end = trace.col("ts"), trace.col("end")
    out = []
    for rows in groups:
        blocked = total_length(merge_intervals(ts[rows], end[rows]))
        idle = sum(charged.get(int(r), 0.0) for r in rows)
        out.append(SyncCharge(blocked_us=blocked, idle_us=idle, saving_us=min(blocked, idle)))
    return out


def queued_during(trace: Trace, gaps: Gaps, rows: np.ndarray | list[int]) -> float:
    """Microseconds of `queued work` idle while the host was inside `rows` (their union): idle the
    device spent with its next work already queued, which those calls did not cause."""
    ts, end = trace.col("ts"), trace.col("end")
    rows = np.asarray(rows, dtype=np.int64)
    spans = merge_intervals(ts[rows], end[rows])
    return total_length(intersect(spans, merge_intervals(gaps.queued_from, gaps.end)))


# ---------------------------------------------------------------------------------------------
class _ThreadIndex:
    """Per host thread: its launch calls and its blocking calls (merged, each group named by its
    first row), by time, for the questions the attribution asks of a launch."""

    def __init__(self, trace: Trace, blocking: np.ndarray) -> None:
        cat, link = trace.col("cat"), trace.col("link")
        ts, end = trace.col("ts"), trace.col("end")
        pid, tid = trace.col("pid"), trace.col("tid")
        self.ts, self.end, self.pid, self.tid = ts, end, pid, tid
        # calls that launched GPU work (a sync's own `cuda_sync` record is not work)
        launches = np.flatnonzero(np.isin(cat, LAUNCH_SIDE) & (link >= 0))
        launches = launches[np.isin(cat[link[launches]], GPU_WORK)]
        self.launches: dict[tuple[int, int], np.ndarray] = {}
        self.launch_ts: dict[tuple[int, int], np.ndarray] = {}  # their starts, in order
        for key, rows in _by_thread(pid, tid, launches).items():
            self.launches[key] = rows = rows[np.argsort(ts[rows], kind="stable")]
            self.launch_ts[key] = ts[rows]
        self.syncs: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        for key, rows in _by_thread(pid, tid, np.asarray(blocking, dtype=np.int64)).items():
            rows = rows[np.argsort(ts[rows], kind="stable")]
            s, e = ts[rows].astype(np.float64), end[rows].astype(np.float64)
            run_end = np.maximum.accumulate(e)
            first = np.flatnonzero(np.r_[True, s[1:] > run_end[:-1]])
            last = np.r_[first[1:] - 1, len(s) - 1]
            self.syncs[key] = (s[first], run_end[last], rows[first])
        waits = np.flatnonzero(np.isin(trace.col("name"), [c for c in (trace.symbols.id(w) for w in EVENT_WAIT_CALLS)
                                                           if c >= 0]) & np.isin(cat, LAUNCH_SIDE))
        self.waits = {k: np.sort(ts[r]) for k, r in _by_thread(pid, tid, waits).items()}

    def key(self, row: int) -> tuple[int, int]:
        return int(self.pid[row]), int(self.tid[row])

    def previous_launch_ts(self, launch: int) -> float:
        """Start of the launch call its thread made before `launch` (-inf: none)."""
        starts = self.launch_ts.get(self.key(launch))
        if starts is None:
            return -np.inf
        k = int(np.searchsorted(starts, self.ts[launch], side="left"))
        return float(starts[k - 1]) if k > 0 else -np.inf

    def sync_before(self, launch: int, until: float) -> tuple[int, float]:
        """The blocking call group the launching thread was in after its previous launch and before
        `until` (the host's part of a gap ends there): (its first row, its start), or (-1, 0)."""
        found = self.syncs.get(self.key(launch))
        if found is None:
            return -1, 0.0
        s, e, rows = found
        k = int(np.searchsorted(s, until, side="left")) - 1
        if k < 0:
            return -1, 0.0
        # the host's next launch after the sync returned is this one: none came in between
        if e[k] <= self.previous_launch_ts(launch):
            return -1, 0.0
        return int(rows[k]), float(s[k])

    def waited_on_events(self, launches: np.ndarray) -> np.ndarray:
        """For each launch: an event wait was issued on its thread since the thread's previous launch."""
        out = np.zeros(len(launches), dtype=bool)
        if not self.waits:
            return out
        at = np.arange(len(launches))
        for key, mine in _by_thread(self.pid[launches], self.tid[launches], at).items():
            w = self.waits.get(key)
            if w is None:
                continue
            hi = self.ts[launches[mine]]
            lo = np.full(len(hi), -np.inf)
            starts = self.launch_ts.get(key)
            if starts is not None:  # (the thread's previous launch, as previous_launch_ts finds it)
                k = np.searchsorted(starts, hi, side="left")
                lo = np.where(k > 0, starts[np.maximum(k - 1, 0)], -np.inf)
            k = np.searchsorted(w, hi, side="right") - 1
            out[mine] = (k >= 0) & (w[np.maximum(k, 0)] >= lo)
        return out


def _queued_later(trace: Trace, gpu: np.ndarray) -> dict[int, float]:
    """For each GPU row whose launch is not recorded: the earliest return of a recorded launch of
    work that runs after it on its stream (inf: none)."""
    link, end, tid = trace.col("link"), trace.col("end"), trace.col("tid")
    missing = gpu[link[gpu] < 0]
    if not len(missing):
        return {}
    out: dict[int, float] = {}
    for stream in np.unique(tid[missing]):
        rows = gpu[tid[gpu] == stream]  # (by start already)
        ready = np.where(link[rows] >= 0, end[np.maximum(link[rows], 0)], np.inf).astype(np.float64)
        later = np.minimum.accumulate(ready[::-1])[::-1]  # the earliest from each op on
        for k in np.flatnonzero(link[rows] < 0):
            out[int(rows[k])] = float(later[k + 1]) if k + 1 < len(rows) else np.inf
    return out


def _queued_kinds(trace: Trace, threads: _ThreadIndex, launch: np.ndarray, nxt: np.ndarray,
                  prev: np.ndarray) -> np.ndarray:
    """QUEUED_KINDS index of each queued gap (its next op's launch row, -1 unrecorded; the next op;
    the op before, -1 none), the first that holds: the next op is a collective's kernel, its launch a
    graph launch, an event wait came since its thread's previous launch, the op before ran on
    another stream; else the same stream. Each distinct kernel and launch name is matched once."""
    names, tid, symbols = trace.col("name"), trace.col("tid"), trace.symbols
    kind = np.full(len(nxt), QUEUED_KINDS.index("same stream"), dtype=np.int64)
    kind[(prev >= 0) & (tid[np.maximum(prev, 0)] != tid[nxt])] = QUEUED_KINDS.index("another stream")
    has = launch >= 0
    if has.any():
        kind[np.flatnonzero(has)[threads.waited_on_events(launch[has])]] = QUEUED_KINDS.index("event wait")
        codes = names[launch[has]]
        graph = [c for c in np.unique(codes).tolist() if GRAPH_LAUNCH.match(symbols[c])]
        kind[np.flatnonzero(has)[np.isin(codes, graph)]] = QUEUED_KINDS.index("graph launch")
    comm = [c for c in np.unique(names[nxt]).tolist() if is_comm_kernel(symbols[c])]
    kind[np.isin(names[nxt], comm)] = QUEUED_KINDS.index("collective")
    return kind


def _by_thread(pid: np.ndarray, tid: np.ndarray, rows: np.ndarray) -> dict[tuple[int, int], np.ndarray]:
    """`rows` per (pid, tid), threads in order, each thread's rows in their order in `rows` (one sort)."""
    if not len(rows):
        return {}
    rows = rows[np.lexsort((np.arange(len(rows)), tid[rows], pid[rows]))]
    p, t = pid[rows], tid[rows]
    cuts = np.r_[0, np.flatnonzero((p[1:] != p[:-1]) | (t[1:] != t[:-1])) + 1, len(rows)]
    return {(int(p[a]), int(t[a])): rows[a:b] for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist())}


def _overlap(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> float:
    """Length of a single interval `a` covered by the merged set `b`."""
    (s,), (e,) = a
    bs, be = b
    if not len(bs):
        return 0.0
    k0 = int(np.searchsorted(be, s, side="right"))
    k1 = int(np.searchsorted(bs, e, side="left"))
    if k1 <= k0:
        return 0.0
    return float(np.clip(np.minimum(be[k0:k1], e) - np.maximum(bs[k0:k1], s), 0.0, None).sum())

