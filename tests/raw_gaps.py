"""The GPU gap attribution recomputed from a trace's raw events with the standard library alone (no
auditor code), so that tests check auditor.evidence.trace.gaps against an independent reading of
the same rule: a gap of the device timeline ends when the next GPU op starts; that op's launch call
(same CUPTI correlation) had returned before the gap began -> queued work; else the launching
thread's time before the launch call is data loading (inside DataLoader.__next__), then host
synchronisation (from a blocking call it made since its previous launch), then host work; from the
launch call's start on it is launch, and a wait of more than 50 us after the call returned is queued
work. No launch recorded: queued work if later work on the op's stream was launched before the gap,
else untraced."""
from __future__ import annotations

import gzip
import json
import re
from bisect import bisect_left, bisect_right
from functools import cache
from pathlib import Path
from typing import Any

GPU_CATS = ("kernel", "Kernel", "gpu_memcpy", "Memcpy", "gpu_memset", "Memset")
CALL_CATS = ("cuda_runtime", "cuda_driver", "Runtime")
SYNC_CATS = ("cuda_sync",)
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "hipStreamSynchronize",
         "hipDeviceSynchronize", "hipEventSynchronize", "cudaMemcpy", "hipMemcpy", "hipMemcpyWithStream",
         "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize")
ASYNC_COPIES = ("cudaMemcpyAsync", "hipMemcpyAsync")
LOADER = re.compile(r"^enumerate\(DataLoader\)#.*__next__$")
SLACK = 50.0
CAUSES = ("queued work", "host synchronisation", "data loading", "host work", "launch", "untraced")


def load_events(path: Path) -> list[dict]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def _merge(spans: list[tuple[float, float, Any]]) -> list[list[Any]]:
    """[[start, end, first item]] of the union of (start, end, item) spans."""
    out: list[list[Any]] = []
    for a, b, item in sorted(spans, key=lambda t: t[0]):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b, item])
    return out


def _cover(a: float, b: float, merged: list[list[Any]]) -> float:
    return sum(max(0.0, min(b, e) - max(a, s)) for s, e, _ in merged)


def steps(events: list[dict]) -> list[tuple[float, float]]:
    return sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("ph") == "X"
                  and str(e.get("name", "")).startswith("ProfilerStep#")
                  and e.get("cat") in ("user_annotation", "Operator"))


def blocking(events: list[dict], window: tuple[float, float] | None = None) -> list[dict]:
    """The calls in which the host waits: the syncs, and async copies whose copy is to pageable memory."""
    pageable = {e["args"].get("correlation") for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS
                and re.search(r"DtoH.*Pageable", str(e.get("name", "")))}
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in CALL_CATS
            and (e.get("name") in SYNCS or (e.get("name") in ASYNC_COPIES
                                            and e.get("args", {}).get("correlation") in pageable))]


def raw_gaps(events: list[dict]) -> list[dict[str, Any]]:
    """[{"start", "end", "us": {cause: us}, "sync": the charged blocking call or None, "launch"}]."""
    lo, hi = steps(events)[0][0], steps(events)[-1][1]
    ops = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS and e.get("dur", 0) > 0),
                 key=lambda e: (e["ts"], e["ts"] + e["dur"]))
    launches: dict[int, dict] = {}
    for e in events:
        c = e.get("args", {}).get("correlation") if e.get("ph") == "X" and e.get("cat") in CALL_CATS else None
        if c is not None and c >= 0:
            launches.setdefault(c, e)
    gpu_corr = {e.get("args", {}).get("correlation") for e in ops}
    by_thread: dict[tuple, list[dict]] = {}
    for c, e in launches.items():
        if c in gpu_corr:
            by_thread.setdefault((e["pid"], e["tid"]), []).append(e)
    for rows in by_thread.values():
        rows.sort(key=lambda e: e["ts"])
    launch_ts = {k: [e["ts"] for e in rows] for k, rows in by_thread.items()}
    syncs: dict[tuple, list[list[Any]]] = {}
    for e in blocking(events):
        syncs.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"], e))
    groups = {k: _merge(v) for k, v in syncs.items()}
    group_starts = {k: [grp[0] for grp in v] for k, v in groups.items()}
    # per stream (tid) of GPU ops, in (start, end) order: the earliest end of a launch of any op
    # from each position on (for "later work on the op's stream was launched before the gap")
    stream_keys: dict[Any, list[tuple[float, float]]] = {}
    stream_launch_end: dict[Any, list[float]] = {}
    for o in ops:
        c = o.get("args", {}).get("correlation")
        stream_keys.setdefault(o["tid"], []).append((o["ts"], o["ts"] + o["dur"]))
        end = launches[c]["ts"] + launches[c]["dur"] if c in launches else float("inf")
        stream_launch_end.setdefault(o["tid"], []).append(end)
    for ends in stream_launch_end.values():
        for i in range(len(ends) - 2, -1, -1):
            ends[i] = min(ends[i], ends[i + 1])
    loading = _merge([(e["ts"], e["ts"] + e["dur"], None) for e in events if e.get("ph") == "X"
                      and LOADER.match(str(e.get("name", "")))])
    gaps: list[tuple[float, float, dict | None]] = []
    run_end = None
    for k, op in enumerate(ops):
        if run_end is None:
            gaps.append((lo, op["ts"], op))
        elif op["ts"] > run_end:
            gaps.append((run_end, op["ts"], op))
        run_end = op["ts"] + op["dur"] if run_end is None else max(run_end, op["ts"] + op["dur"])
    if run_end is not None and run_end < hi:
        gaps.append((run_end, hi, None))
    out = []
    for a0, b0, op in gaps:
        a, b = min(max(a0, lo), hi), min(max(b0, lo), hi)
        if b <= a:
            continue
        us = dict.fromkeys(CAUSES, 0.0)
        g = {"start": a, "end": b, "us": us, "sync": None, "next": op, "launch": None}
        out.append(g)
        L = launches.get(op.get("args", {}).get("correlation", -1)) if op is not None else None
        if op is not None and op.get("args", {}).get("correlation") is None:
            L = None
        g["launch"] = L
        if L is None:
            queued = False
            if op is not None:  # the ops on its stream after it (in (start, end) order): launched before a?
                keys, ends = stream_keys[op["tid"]], stream_launch_end[op["tid"]]
                after = bisect_right(keys, (op["ts"], op["ts"] + op["dur"]))
                queued = after < len(ends) and ends[after] <= a
            if queued:
                us["queued work"] = b - a
            else:
                us["untraced"] = b - a
            continue
        ls, le = L["ts"], L["ts"] + L["dur"]
        if le <= a:
            us["queued work"] = b - a
            continue
        p = min(max(ls, a), b)
        ready = min(max(le, p), b)
        waited = max(b - ready - SLACK, 0.0)
        us["queued work"] = waited
        us["launch"] = (b - p) - waited
        if p <= a:
            continue
        loaded = _cover(a, p, loading)
        us["data loading"] = loaded
        rest = (p - a) - loaded
        thread = (L["pid"], L["tid"])
        before = bisect_left(launch_ts.get(thread, []), ls)  # the thread's launches that began before this one
        prev_ts = launch_ts[thread][before - 1] if before else float("-inf")
        last = bisect_left(group_starts.get(thread, []), p) - 1  # its last blocking span begun before p
        if last >= 0 and groups[thread][last][1] > prev_ts:
            s0 = max(a, groups[thread][last][0])
            charged = min(max((p - s0) - _cover(s0, p, loading), 0.0), rest)
            us["host synchronisation"] = charged
            g["sync"] = groups[thread][last][2]
            rest -= charged
        us["host work"] = max(rest, 0.0)
    return out


@cache
def fixture_gaps(path: str) -> tuple[list[dict[str, Any]], int]:
    events = load_events(Path(path))
    return raw_gaps(events), len(steps(events))


def per_step(path: str) -> dict[str, float]:
    """ms per step of each cause over the fixture's ProfilerSteps."""
    gaps, n = fixture_gaps(path)
    return {c: sum(g["us"][c] for g in gaps) / 1000.0 / n for c in CAUSES}


def sync_costs(path: str, calls: list[list[dict]]) -> tuple[float, float]:
    """(idle us charged to these calls, us their removal saves): per call (its blocking rows), the
    idle of the gaps charged to its rows, and the smaller of that and the union of its rows' time."""
    gaps, _ = fixture_gaps(path)
    charged: dict[tuple, float] = {}
    for g in gaps:
        if g["sync"] is not None:
            key = _key(g["sync"])
            charged[key] = charged.get(key, 0.0) + g["us"]["host synchronisation"]
    idle = saving = 0.0
    for rows in calls:
        blocked = sum(e - s for s, e, _ in _merge([(r["ts"], r["ts"] + r["dur"], None) for r in rows]))
        mine = sum(charged.get(_key(r), 0.0) for r in rows)
        idle += mine
        saving += min(blocked, mine)
    return idle, saving


def _key(e: dict) -> tuple:
    return (e["pid"], e["tid"], e["ts"], e["name"])
