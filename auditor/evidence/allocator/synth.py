"""A memory snapshot built from requests alone, as the caching allocator would have recorded them.

A rehearsed program (auditor.capture.rehearsal.memory) has no allocator: it records the requests its
GPU tensors would make (alloc / free of a size on a stream, with the Python stack), and this module
runs them through the simulator to write what `torch.cuda.memory._snapshot()` returns on a GPU: the
trace with the allocator's own decisions interleaved (segment_alloc before the alloc it serves,
segment_free / segment_map / segment_unmap, an `oom` entry where the device would have been full),
and the final segments with their blocks. The result loads with auditor.evidence.snapshot and is
judged as any recorded snapshot is.
"""
from __future__ import annotations

from typing import Any

from auditor.evidence.allocator.config import INTERVALS, AllocatorConfig
from auditor.evidence.allocator.simulator import OOM, RETRY, Blk, Simulator

ALLOC, FREE = "alloc", "free"


def settings_of(cfg: AllocatorConfig, conf: str) -> dict[str, Any]:
    """allocator_settings as torch writes them into a snapshot."""
    return {"PYTORCH_CUDA_ALLOC_CONF": conf, "max_split_size": cfg.max_split_size or -1,
            "garbage_collection_threshold": cfg.garbage_collection_threshold,
            "expandable_segments": cfg.expandable_segments,
            "roundup_power2_divisions": {str(1 << i): cfg.roundup_power2_divisions[i] for i in range(INTERVALS)}}


def snapshot_from_requests(requests: list[dict[str, Any]], cfg: AllocatorConfig, capacity: int,
                           conf: str = "") -> dict[str, Any]:
    """The snapshot a device of `capacity` bytes would have written for these requests: each a dict
    {"action": "alloc" | "free", "id": the allocation's key, "size", "stream", "time_us", "frames"}.
    An alloc marked "before": True was made before recording began: its block (and the segment
    that holds it) is in the final state, with no trace entry, as torch records it; only an `oom`
    it causes is traced."""
    sim = Simulator(cfg, capacity, next_address=0x7F0000000000)
    trace: list[dict[str, Any]] = []
    live: dict[int, Blk] = {}
    frames_of: dict[int, list] = {}
    for i, r in enumerate(requests):
        sim.index = i
        seen = len(sim.events)
        t = r.get("time_us")
        if r["action"] == ALLOC:
            b = sim.malloc(int(r["size"]), int(r.get("stream", 0)))
            before = bool(r.get("before"))
            for _, kind, size, stream, addr in sim.events[seen:]:
                if kind == RETRY or (before and kind != OOM):
                    continue
                if kind == OOM:
                    trace.append({"action": "oom", "device_free": addr, "size": size,
                                  "stream": stream, "time_us": t, "frames": r.get("frames", [])})
                    continue
                trace.append({"action": kind, "addr": addr, "size": size, "stream": stream, "time_us": t})
            live[r["id"]] = b
            frames_of[id(b)] = r.get("frames", [])
            if before:
                continue
            trace.append({"action": "alloc", "addr": b.ptr, "size": b.requested, "stream": b.stream, "time_us": t,
                          "frames": r.get("frames", [])})
        elif r["action"] == FREE:
            b = live.pop(r["id"], None)
            if b is None:
                continue
            for action in ("free_requested", "free_completed"):
                trace.append({"action": action, "addr": b.ptr, "size": b.requested, "stream": b.stream,
                              "time_us": t, "frames": r.get("frames", [])})
            sim.free_completed(b)
            for _, kind, size, stream, addr in sim.events[seen:]:
                trace.append({"action": kind, "addr": addr, "size": size, "stream": stream, "time_us": t})
    return {"segments": _segments(sim, live, frames_of), "device_traces": [trace],
            "allocator_settings": settings_of(cfg, conf)}


def _segments(sim: Simulator, live: dict[int, Blk], frames_of: dict[int, list]) -> list[dict[str, Any]]:
    blocks = [b for p in sim.pools.values() for b in p.blocks.values()] + list(live.values())
    heads = [b for b in blocks if b.mapped and (b.prev is None or not b.prev.mapped)]
    out = []
    for head in sorted(heads, key=lambda b: b.ptr):
        seg: dict[str, Any] = {"device": 0, "address": head.ptr, "total_size": 0, "allocated_size": 0,
                               "active_size": 0, "requested_size": 0, "stream": head.stream,
                               "segment_type": "small" if head.small else "large",
                               "is_expandable": head.seg is not None, "blocks": []}
        b: Blk | None = head
        while b is not None and b.mapped:
            seg["total_size"] += b.size
            state = "active_allocated" if b.allocated else "inactive"
            if b.allocated:
                seg["allocated_size"] += b.size
                seg["active_size"] += b.size
                seg["requested_size"] += b.requested
            seg["blocks"].append({"address": b.ptr, "size": b.size, "requested_size": b.requested if b.allocated else 0,
                                  "state": state, "frames": frames_of.get(id(b), []) if b.allocated else []})
            b = b.next
        out.append(seg)
    return out

