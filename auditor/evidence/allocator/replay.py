"""Replays a snapshot's recorded requests through the simulated allocator.

The trace is a ring buffer that may begin mid-run, so the replay starts from the state at its first
entry, reconstructed: the final state's segments the trace never allocates, plus those it frees
before allocating; the allocations live when recording began (auditor.evidence.snapshot.live_at at
-1) at their recorded addresses and sizes (rounded requests where the snapshot no longer holds
them); the rest of each segment free. Expandable segments are seeded as plain ones (noted).
New segments take the addresses the recording gave its cudaMallocs of the same size, in order, so
ties broken by address break the same way. Requests are the trace's alloc / free_requested /
free_completed and the program's own `empty_cache()` calls (program_releases); the allocator's own
decisions in the trace are what the replay is compared against, never inputs.
"""
from __future__ import annotations

import time
from array import array
from bisect import bisect_right

from auditor.evidence.allocator.config import (K_SMALL_BUFFER, K_SMALL_SIZE, AllocatorConfig,
                                               round_size)
from auditor.evidence.allocator.records import Figures, ReplayError
from auditor.evidence.allocator.simulator import Blk, Simulator, pending_queue
from auditor.evidence.snapshot import (ALLOC, FREE_COMPLETED, FREE_REQUESTED, SEGMENT_ALLOC, SEGMENT_FREE,
                                       SEGMENT_MAP, SEGMENT_UNMAP, Snapshot, live_at)

_GROW = (SEGMENT_ALLOC, SEGMENT_MAP)
_SHRINK = (SEGMENT_FREE, SEGMENT_UNMAP)


class Replay:
    """A finished simulation: the simulator's final state, its reserve after every trace entry
    (when asked for), and the figures."""

    def __init__(self, sim: Simulator, series: array | None, seeded_segments: int, seeded_blocks: int,
                 ms: float) -> None:
        self.sim, self.series, self.ms = sim, series, ms
        self.seeded_segments, self.seeded_blocks = seeded_segments, seeded_blocks

    def figures(self) -> Figures:
        s = self.sim
        return Figures(reserved_peak_bytes=s.peak_reserved, allocated_peak_bytes=s.peak_allocated,
                       segment_allocs=s.segment_allocs, segment_frees=s.segment_frees)


def recorded_figures(snapshot: Snapshot, device: int) -> Figures:
    h = snapshot.histories[device]
    a = h.actions
    return Figures(reserved_peak_bytes=h.peak_reserved, allocated_peak_bytes=h.peak_allocated,
                   segment_allocs=a.get(SEGMENT_ALLOC, 0) + a.get(SEGMENT_MAP, 0),
                   segment_frees=a.get(SEGMENT_FREE, 0) + a.get(SEGMENT_UNMAP, 0))


def recorded_series(snapshot: Snapshot, device: int) -> array:
    """The recorded reserve after each trace entry."""
    h = snapshot.histories[device]
    out = array("q")
    r = h.start_reserved
    for e in snapshot.device_traces[device]:
        if e.action in _GROW:
            r += e.size
        elif e.action in _SHRINK:
            r -= e.size
        out.append(r)
    return out


# the caching allocator's empty_cache, as its stacks name it: the C++ entry point and torch's
# Python wrapper (torch/cuda/memory.py `empty_cache`)
_EMPTY_CACHE_NATIVE = ("emptyCache", "empty_cache")


def _released_by_program(e) -> bool | None:
    """Whether a segment_free / segment_unmap was made by empty_cache (its stack passes through it);
    None when the entry has no stack."""
    if not e.frames:
        return None
    return any(f.name.endswith(_EMPTY_CACHE_NATIVE) or "THCPModule_emptyCache" in f.name
               or (f.name == "empty_cache" and f.filename.endswith(("cuda/memory.py", "torch/accelerator/memory.py")))
               for f in e.frames)


def program_releases(trace: list) -> list[tuple[int, int]]:
    """(first, end) trace entries of each burst of segment_free / segment_unmap that the program's
    empty_cache() made: its stack passes through empty_cache; without stacks, a burst that no
    segment_alloc / segment_map follows (the allocator releases its cache on its own only to
    retry a cudaMalloc, which it then makes at once)."""
    out = []
    i, n = 0, len(trace)
    while i < n:
        if trace[i].action not in _SHRINK:
            i += 1
            continue
        j = i
        while j < n and trace[j].action in _SHRINK:
            j += 1
        by = _released_by_program(trace[i])
        if by or (by is None and not (j < n and trace[j].action in _GROW)):
            out.append((i, j))
        i = j
    return out


def _initial_segments(snapshot: Snapshot, device: int) -> dict[int, tuple[int, int, bool]]:
    """addr -> (size, stream, small) of the segments reserved when the trace began."""
    trace = snapshot.device_traces[device]
    grown: set[int] = set()
    initial: dict[int, tuple[int, int, bool]] = {}
    for e in trace:
        if e.addr is None:
            continue
        if e.action in _GROW:
            grown.add(e.addr)
        elif e.action in _SHRINK and e.addr not in grown and e.addr not in initial:
            initial[e.addr] = (e.size, e.stream, e.size == K_SMALL_BUFFER)
    for s in snapshot.device_segments(device):
        if s.address not in grown and s.address not in initial:
            initial[s.address] = (s.total_size, s.stream, s.segment_type == "small")
    return initial


def seed(sim: Simulator, snapshot: Snapshot, device: int, cfg: AllocatorConfig) -> tuple[dict[int, Blk], int]:
    """Puts the state at the trace's first entry into `sim` (see the module's docstring).
    Returns recorded address -> live block, and the number of segments seeded."""
    segs = _initial_segments(snapshot, device)
    starts = sorted(segs)
    allocated_in_trace = {e.addr for e in snapshot.device_traces[device] if e.action == ALLOC}
    final_size = {b.address: b.size for s in snapshot.device_segments(device) for b in s.blocks if b.live}
    inside: dict[int, list[tuple[int, int]]] = {a: [] for a in starts}
    for la in live_at(snapshot, device, -1):
        i = bisect_right(starts, la.addr) - 1
        if i < 0:
            continue
        a = starts[i]
        if la.addr < a + segs[a][0]:
            inside[a].append((la.addr, la.size))
    live: dict[int, Blk] = {}
    limit = cfg.split_limit
    for a in starts:
        size, stream, small = segs[a]
        end = a + size
        allocs = sorted(inside[a])
        pieces = []
        for k, (ptr, requested) in enumerate(allocs):
            known = final_size.get(ptr) if ptr not in allocated_in_trace else None
            bsize = known or round_size(requested, cfg)
            nxt = allocs[k + 1][0] if k + 1 < len(allocs) else end
            gap = nxt - (ptr + bsize)
            if not small and gap > 0 and (gap <= K_SMALL_SIZE or bsize >= limit):
                bsize += gap  # the allocator would not have split that rest off
            pieces.append((ptr, min(bsize, max(nxt - ptr, 0)), requested, ptr))
        for b in sim.seed_segment(a, size, stream, small, pieces):
            live[b.rec] = b
    return live, len(starts)


def replay(snapshot: Snapshot, device: int, cfg: AllocatorConfig, capacity: int,
           keep_series: bool = False, releases: bool = True) -> Replay:
    """The device's requests under `cfg` on a device of `capacity` bytes; with `releases` False,
    as if the program had not called empty_cache()."""
    t0 = time.perf_counter()
    trace = snapshot.device_traces[device]
    release_at = {first for first, _ in program_releases(trace)} if releases else set()
    hints = pending_queue([(e.size, e.addr) for e in trace if e.action == SEGMENT_ALLOC and e.addr is not None])
    top = max([s.address + s.total_size for s in snapshot.device_segments(device)] +
              [(e.addr or 0) + e.size for e in trace if e.action in _GROW], default=0)
    sim = Simulator(cfg, capacity, hints=hints, next_address=max(top, 1 << 40) + (1 << 30))
    live, nseg = seed(sim, snapshot, device, cfg)
    nblocks = len(live)
    series = array("q") if keep_series else None
    malloc, free_req, free_done = sim.malloc, sim.free_requested, sim.free_completed
    for i, e in enumerate(trace):
        sim.index = i
        a = e.action
        addr = e.addr
        if a == ALLOC and addr is not None:
            b = malloc(e.size, e.stream)
            b.rec = addr
            live[addr] = b
        elif a == FREE_REQUESTED and addr is not None:
            b = live.get(addr)
            if b is not None and b.rec == addr:
                free_req(b)
        elif a == FREE_COMPLETED and addr is not None:
            b = live.pop(addr, None)
            if b is not None and b.rec == addr and (b.allocated or b.pending):
                free_done(b)
        elif i in release_at:
            sim.release_cached_blocks()
        if series is not None:
            series.append(sim.reserved)
    return Replay(sim, series, nseg, nblocks, (time.perf_counter() - t0) * 1000.0)


def replay_error(recorded: Figures, rec_series: array, replayed: Figures, series: array,
                 requests: list[bool] | None = None) -> ReplayError:
    """Compared after each request (`requests[i]`: entry i is an alloc or free): the allocator
    writes a segment_alloc just before the alloc it serves, the replay reserves at the alloc."""
    diffs = [abs(x - y) for i, (x, y) in enumerate(zip(rec_series, series)) if requests is None or requests[i]]
    peak = recorded.reserved_peak_bytes
    return ReplayError(  # (no reserve recorded, its segments left out: no share of it to give)
        reserved_peak_pct=round(100.0 * (replayed.reserved_peak_bytes - peak) / peak, 3) if peak else None,
        reserved_max_diff_bytes=max(diffs, default=0),
        reserved_mean_diff_bytes=int(sum(diffs) / len(diffs)) if diffs else 0,
        segment_allocs_diff=replayed.segment_allocs - recorded.segment_allocs,
        segment_frees_diff=replayed.segment_frees - recorded.segment_frees)
