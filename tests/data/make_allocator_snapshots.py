"""Writes the synthetic memory snapshots the allocator rules' tests read (run from the repo root:
`python tests/data/make_allocator_snapshots.py`); the pickles are committed beside it."""
from __future__ import annotations

import pickle
from pathlib import Path

MiB, GiB = 1 << 20, 1 << 30
HERE = Path(__file__).parent
SETTINGS = {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1, "expandable_segments": False,
            "garbage_collection_threshold": 0.0}
FRAMES = [{"filename": "/work/train.py", "line": 12, "name": "step"}]
BASE = 0x7F0000000000


def _seg(addr: int, size: int, live: int) -> dict:
    state = "active_allocated" if live else "inactive"
    return {"device": 0, "address": addr, "total_size": size, "allocated_size": live, "active_size": live,
            "requested_size": live, "stream": 0, "segment_type": "large" if size > 2 * MiB else "small",
            "blocks": [{"address": addr, "size": size, "requested_size": live, "state": state}]}


def _alloc(addr: int, size: int, t: int) -> list[dict]:
    return [{"action": "alloc", "addr": addr, "size": size, "stream": 0, "time_us": t, "frames": FRAMES}]


def _free(addr: int, size: int, t: int) -> list[dict]:
    return [{"action": a, "addr": addr, "size": size, "stream": 0, "time_us": t}
            for a in ("free_requested", "free_completed")]


def churn(churns: bool) -> dict:
    """A 1 GiB device: 600 MiB cached cannot serve a 700 MiB request; the allocator frees it and
    retries (churns) or, in the control, the device has room (no segment_free)."""
    a, b, s1, s2 = BASE, BASE + (1 << 32), 600 * MiB, 700 * MiB
    trace = [{"action": "segment_alloc", "addr": a, "size": s1, "stream": 0, "time_us": 1}]
    trace += _alloc(a, s1, 2) + _free(a, s1, 3)
    if churns:
        trace.append({"action": "segment_free", "addr": a, "size": s1, "stream": 0, "time_us": 4})
    trace.append({"action": "segment_alloc", "addr": b, "size": s2, "stream": 0, "time_us": 5})
    trace += _alloc(b, s2, 6)
    segments = [_seg(b, s2, s2)] if churns else [_seg(a, s1, 0), _seg(b, s2, s2)]
    return {"segments": segments, "device_traces": [trace], "allocator_settings": SETTINGS,
            "external_annotations": [{"stage": "END", "name": "Optimizer.step#SGD.step", "device": 0, "time_us": 0}]}


def overhang() -> dict:
    """A 4 GiB buffer freed after 2 s; the cache keeps it through a minute of small requests."""
    big, small = BASE, BASE + (1 << 33)
    trace = [{"action": "segment_alloc", "addr": big, "size": 4 * GiB, "stream": 0, "time_us": 1_000_000}]
    trace += _alloc(big, 4 * GiB, 1_000_001) + _free(big, 4 * GiB, 2_000_000)
    trace.append({"action": "segment_alloc", "addr": small, "size": 2 * MiB, "stream": 0, "time_us": 2_000_001})
    for k in range(6):
        t = 3_000_000 + k * 10_000_000
        trace += _alloc(small, 1024, t) + _free(small, 1024, t + 1)
    return {"segments": [_seg(big, 4 * GiB, 0), _seg(small, 2 * MiB, 0)], "device_traces": [trace],
            "allocator_settings": SETTINGS}


if __name__ == "__main__":
    for name, snap in (("allocator_churn", churn(True)), ("allocator_calm", churn(False)),
                       ("reserved_overhang", overhang())):
        (HERE / f"{name}.pickle").write_bytes(pickle.dumps(snap, protocol=4))
