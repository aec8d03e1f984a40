"""The caching-allocator simulator: its rules taken one by one from c10/cuda/CUDACachingAllocator.cpp,
the replay of the recorded transformer step against what its allocator wrote, and what-ifs that move
the figures the way PyTorch's documentation says they should."""
from __future__ import annotations

import functools
import pickle
from pathlib import Path

import pytest

from auditor.evidence.allocator.analysis import analyze, capacity_for
from auditor.evidence.allocator.config import (AllocatorConfig, ConfError, from_settings, parse_alloc_conf,
                                               round_size, roundup_power2_next_division)
from auditor.evidence.allocator.replay import recorded_figures, replay
from auditor.evidence.allocator.simulator import Simulator
from auditor.evidence.snapshot import GiB, MiB, load_snapshot

from conftest import FIXTURES

TRANSFORMER = FIXTURES / "snapshots" / "transformer_fullstep_with_history.pickle"


@functools.cache
def transformer():
    return load_snapshot(TRANSFORMER)


def test_rounding_follows_the_allocator():
    cfg = AllocatorConfig()
    assert round_size(1, cfg) == 512
    assert round_size(513, cfg) == 1024
    assert roundup_power2_next_division(1200, 4) == 1280  # the source's own example
    four = parse_alloc_conf("roundup_power2_divisions:4")
    assert round_size(1100 * MiB, four) == 1280 * MiB  # 1024..2048 MiB in four steps
    assert round_size(1100 * MiB, cfg) == 1100 * MiB
    listed = parse_alloc_conf("roundup_power2_divisions:[256:1,512:2,>:8]")
    # the source fills the entry of 256 MiB's own interval (256..512 MiB) with 256's value
    assert listed.divisions_for(300 * MiB) == 1 and listed.divisions_for(600 * MiB) == 2
    assert listed.divisions_for(5000 * MiB) == 8


def test_conf_parsing_refuses_what_torch_refuses():
    assert parse_alloc_conf("max_split_size_mb:128").max_split_size == 128 * MiB
    with pytest.raises(ConfError):
        parse_alloc_conf("max_split_size_mb:20")
    assert parse_alloc_conf("expandable_segments:True,garbage_collection_threshold:0.6").alloc_conf() == \
        "expandable_segments:True,garbage_collection_threshold:0.6"
    recorded = {"max_split_size": -1, "expandable_segments": False,
                "roundup_power2_divisions": {str(1 << i): (4 if i == 3 else 0) for i in range(16)}}
    cfg = from_settings(recorded)
    assert cfg.max_split_size is None and cfg.divisions_for(9 * MiB) == 4


def test_segments_and_splitting():
    sim = Simulator(AllocatorConfig(), capacity=4 * GiB)
    a = sim.malloc(1000, 0)  # small pool: a 2 MiB segment
    b = sim.malloc(1000, 0)  # packed into the same segment
    assert sim.segment_allocs == 1 and sim.reserved == 2 * MiB and b.ptr == a.ptr + 1024
    c = sim.malloc(5 * MiB, 0)  # 1..10 MiB: a 20 MiB segment, split
    d = sim.malloc(5 * MiB, 0)  # served from the rest of it
    assert sim.segment_allocs == 2 and d.ptr == c.ptr + 5 * MiB
    e = sim.malloc(30 * MiB + 1, 0)  # >= 10 MiB: rounded up to 2 MiB
    assert sim.reserved == 2 * MiB + 20 * MiB + 32 * MiB
    sim.free_completed(e)
    f = sim.malloc(31 * MiB, 0)  # the cached 32 MiB block serves it whole (rest 1 MiB: not split)
    assert f.ptr == e.ptr and f.size == 32 * MiB and sim.segment_allocs == 3
    other = sim.malloc(100, 7)  # another stream never takes this stream's cached blocks
    assert sim.segment_allocs == 4 and other.stream == 7


def test_max_split_size_keeps_oversize_blocks_whole():
    sim = Simulator(parse_alloc_conf("max_split_size_mb:64"), capacity=4 * GiB)
    big = sim.malloc(100 * MiB, 0)
    sim.free_completed(big)
    small = sim.malloc(30 * MiB, 0)  # an oversize cached block is refused to a smaller request
    assert small.ptr != big.ptr and sim.segment_allocs == 2
    near = sim.malloc(90 * MiB, 0)  # within 20 MiB of an oversize request: reused unsplit
    assert near.ptr == big.ptr and near.size == 100 * MiB


def test_full_device_frees_the_cache_and_retries():
    sim = Simulator(AllocatorConfig(), capacity=1 * GiB)
    a = sim.malloc(600 * MiB, 0)
    sim.free_completed(a)
    b = sim.malloc(700 * MiB, 0)  # 600 cached + 700 > 1 GiB: release_cached_blocks, then cudaMalloc
    assert sim.retries == 1 and sim.segment_frees == 1 and sim.reserved == 700 * MiB and b.size == 700 * MiB
    sim.malloc(700 * MiB, 0)  # does not fit even after that: an OOM
    assert sim.ooms == 1


def test_expandable_segments_grow_one_segment_per_stream():
    sim = Simulator(parse_alloc_conf("expandable_segments:True"), capacity=8 * GiB)
    a = sim.malloc(30 * MiB, 0)
    b = sim.malloc(50 * MiB, 0)
    assert b.ptr == a.ptr + 30 * MiB  # the same segment, grown by pages
    assert sim.reserved == 80 * MiB  # 20 MiB pages: 40 MiB mapped, its free 10 MiB + 40 more serve the 50
    sim.free_completed(a)
    sim.free_completed(b)
    sim.release_cached_blocks()  # empty_cache unmaps every free page
    assert sim.reserved == 0 and sim.segment_frees == 1  # one unmap of the merged free range


def test_replay_reproduces_the_recorded_transformer_step():
    snap = transformer()
    report = analyze(snap, 0)
    rec, rep = report.recorded, report.replayed
    assert rec.reserved_peak_bytes == 61111009280 and rec.segment_allocs == 783 and rec.segment_frees == 0
    assert rep == rec  # peak reserved, peak allocated, 783 cudaMallocs, 0 cudaFrees: exact
    # the reserve after every request matches the recording byte for byte
    assert report.error.reserved_max_diff_bytes == 0 and report.error.reserved_peak_pct == 0
    assert report.seeded_segments == 227  # reserved before the ring buffer's first entry
    assert report.capacity_source.startswith("assumed")


def test_what_ifs_move_the_way_the_documentation_says():
    snap = transformer()
    report = analyze(snap, 0)
    by = {w.alloc_conf: w for w in report.what_if}
    exp = by["expandable_segments:True"]
    # expandable segments: fewer device allocations and a lower reserve for the same requests
    assert exp.reserved_peak_bytes < report.recorded.reserved_peak_bytes * 0.95
    assert exp.segment_allocs < report.recorded.segment_allocs
    gc = by["garbage_collection_threshold:0.8"]
    assert gc.note and gc.reserved_peak_bytes == report.recorded.reserved_peak_bytes  # nothing to collect below 80%


def test_a_tight_device_makes_the_replay_churn():
    snap = transformer()
    cfg = snap.allocator_settings.config
    tight = replay(snap, 0, cfg, capacity=int(55 * GiB))
    assert tight.sim.retries > 0 and tight.sim.segment_frees > 0
    assert tight.sim.peak_reserved <= int(55 * GiB) or tight.sim.ooms
    roomy = replay(snap, 0, cfg, capacity=80 * GiB)
    assert roomy.sim.retries == 0 and roomy.figures() == recorded_figures(snap, 0)


def synthetic_snapshot(path: Path, churn: bool) -> Path:
    """A one-device snapshot whose allocator (1 GiB device) frees its cache to retry a request
    (churn) or, as the control, has room for it."""
    MB600, MB700, base = 600 * MiB, 700 * MiB, 0x7F0000000000
    second = base + (1 << 32)
    frames = [{"filename": "/work/train.py", "line": 12, "name": "step"}]
    trace = [
        {"action": "segment_alloc", "addr": base, "size": MB600, "stream": 0, "time_us": 1},
        {"action": "alloc", "addr": base, "size": MB600, "stream": 0, "time_us": 2, "frames": frames},
        {"action": "free_requested", "addr": base, "size": MB600, "stream": 0, "time_us": 3},
        {"action": "free_completed", "addr": base, "size": MB600, "stream": 0, "time_us": 3},
    ]
    if churn:
        trace.append({"action": "segment_free", "addr": base, "size": MB600, "stream": 0, "time_us": 4})
    trace += [{"action": "segment_alloc", "addr": second, "size": MB700, "stream": 0, "time_us": 5},
              {"action": "alloc", "addr": second, "size": MB700, "stream": 0, "time_us": 6, "frames": frames}]
    segments = [{"device": 0, "address": second, "total_size": MB700, "allocated_size": MB700,
                 "active_size": MB700, "requested_size": MB700, "stream": 0, "segment_type": "large",
                 "blocks": [{"address": second, "size": MB700, "requested_size": MB700, "state": "active_allocated"}]}]
    if not churn:
        segments.insert(0, {"device": 0, "address": base, "total_size": MB600, "allocated_size": 0,
                            "active_size": 0, "requested_size": 0, "stream": 0, "segment_type": "large",
                            "blocks": [{"address": base, "size": MB600, "requested_size": 0, "state": "inactive"}]})
    snap = {"segments": segments, "device_traces": [trace],
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1, "expandable_segments": False}}
    path.write_bytes(pickle.dumps(snap, protocol=4))
    return path


def test_synthetic_churn_is_recorded_and_replayed(tmp_path):
    snap = load_snapshot(synthetic_snapshot(tmp_path / "churn.pickle", churn=True))
    assert capacity_for(snap, 0) == (1300 * MiB - 1, "churn in the trace")  # what the retry implies
    report = analyze(snap, 0, capacity=1 * GiB)
    assert report.recorded.segment_frees == 1 and report.replayed == report.recorded
    assert [(c.index, c.requested_bytes, c.segments_freed, c.line) for c in report.churn] == [(6, 700 * MiB, 1, 12)]
    exp = {w.alloc_conf: w for w in report.what_if}["expandable_segments:True"]
    assert exp.segment_frees == 0 and exp.retries == 0  # the pages of one segment serve both


def test_synthetic_control_does_not_churn(tmp_path):
    snap = load_snapshot(synthetic_snapshot(tmp_path / "calm.pickle", churn=False))
    assert capacity_for(snap, 0)[1].startswith("assumed")
    report = analyze(snap, 0, capacity=2 * GiB)
    assert report.churn == [] and report.replayed == report.recorded


def test_a_replay_of_a_snapshot_whose_segments_were_all_left_out_reads_sensibly(tmp_path):
    """Its recorded reserve is 0: the replay's error against it read "+4080218931200.00%"."""
    from auditor.reports.allocator_view import error_line

    segment = {"device": 0, "address": 0, "total_size": 2 ** 70, "stream": 0, "segment_type": "large", "blocks": []}
    allocs = [{"action": "alloc", "addr": 4096 * (i + 1), "size": 2 * GiB, "stream": 0} for i in range(19)]
    p = tmp_path / "s.pickle"
    p.write_bytes(pickle.dumps({"segments": [segment], "device_traces": [allocs]}, protocol=4))
    snap = load_snapshot(p)
    assert snap.dropped.startswith("1 entry with sizes no device has was left out")
    report = analyze(snap, 0)
    assert report.recorded.reserved_peak_bytes == 0 and report.replayed.reserved_peak_bytes == 38 * GiB
    assert report.error.reserved_peak_pct is None
    assert "recorded reserved peak 0 B, 0 segment allocs, 0 frees; replayed 38.0 GiB (no recorded reserve to " \
           "compare with), 19 allocs" in error_line(report)
