"""allocator-fragmentation and oom-risk on recorded CUDA snapshots and on snapshot-shaped dicts.

Every expected number is computed here from the raw pickle dicts (or from the dict the test built),
not taken from the rule: reserved/free sums, the largest free block, the replayed peak and the
bytes each user line holds at it, and what was live when an appended OOM record fired.
"""
from __future__ import annotations

import functools
import gzip
import io
import json
import pickle
from pathlib import Path
from typing import Any

import pytest

from auditor.evidence.oom_record import OOM_RECORD_KIND, oom_record_path
from auditor.evidence.load import load_paths
from auditor.evidence.model import Evidence
from auditor.evidence.snapshot import GiB, MiB, Snapshot, _SafeUnpickler, load_snapshot
from auditor.rules._support.alloc_conf import merge_conf, split_conf
from auditor.rules.allocator_fragmentation import AllocatorFragmentation
from auditor.rules.base import Options, Rule
from auditor.rules.engine import skip_reason
from auditor.findings import Finding
from auditor.rules.oom_risk import OomRisk

from conftest import FIXTURES

SNAPSHOTS = FIXTURES / "snapshots"
FRAGMENTED = SNAPSHOTS / "fragmented_72gb_state_only.pickle"
TRANSFORMER = SNAPSHOTS / "transformer_fullstep_with_history.pickle"
LLAMA = SNAPSHOTS / "llama_mostly_free_segments.pickle"
H100_TRACE = SNAPSHOTS.parent / "traces" / "h100_bert_small_item_sync.pt.trace.json.gz"

CONF = "PYTORCH_CUDA_ALLOC_CONF"


def raw(path: Path) -> dict:
    return _SafeUnpickler(io.BytesIO(path.read_bytes())).load()


@functools.cache
def fixture(path: Path) -> Snapshot:
    return load_snapshot(path)


def evidence(*snaps: Snapshot) -> Evidence:
    ev = Evidence(source="snapshot", snapshots=[s.path for s in snaps])
    ev.__dict__["snapshot_data"] = list(snaps)
    return ev


def run(rule: type[Rule], snap: Snapshot, **options: Any) -> list[Finding]:
    opts = rule.options_with({k.replace("_", "-"): v for k, v in options.items()})
    return list(rule().check(evidence(snap), opts))


def from_dict(d: dict, tmp_path: Path, name: str = "built.pickle", protocol: int = 4) -> Snapshot:
    p = tmp_path / name
    p.write_bytes(pickle.dumps(d, protocol=protocol))
    return load_snapshot(p)


# ------------------------------------------------------------------------------------------------
# Snapshot-shaped dicts, laid out the way torch writes them


def segment(address: int, blocks: list[tuple[int, str]], *, stream: int = 0, pool: str = "large",
            expandable: bool = False, device: int = 0) -> dict:
    out, addr = [], address
    for size, state in blocks:
        out.append({"address": addr, "size": size, "requested_size": size if state != "inactive" else 0,
                    "state": state, "frames": []})
        addr += size
    allocated = sum(b["size"] for b in out if b["state"] == "active_allocated")
    return {"device": device, "address": address, "total_size": addr - address, "allocated_size": allocated,
            "active_size": sum(b["size"] for b in out if b["state"] != "inactive"), "requested_size": allocated,
            "stream": stream, "segment_type": pool, "segment_pool_id": (0, 0), "is_expandable": expandable,
            "frames": [], "blocks": out}


def settings(conf: str = "", expandable: bool = False) -> dict:
    return {"PYTORCH_CUDA_ALLOC_CONF": conf, "max_split_size": -1, "garbage_collection_threshold": 0.0,
            "expandable_segments": expandable, "pinned_num_register_threads": 1,
            "release_lock_on_cudamalloc": False, "pinned_use_cuda_host_register": False,
            "roundup_power2_divisions": {}}


def layout(segments: list[list[tuple[int, str]]], **kw: Any) -> list[dict]:
    base = 0x7F00_0000_0000
    out = []
    for blocks in segments:
        out.append(segment(base, blocks, **kw))
        base += 1 << 32
    return out


A, F = "active_allocated", "inactive"


# ------------------------------------------------------------------------------------------------
# allocator-fragmentation


def test_fragmented_fixture_is_flagged_with_its_figures() -> None:
    d = raw(FRAGMENTED)
    segs = d["segments"]
    reserved = sum(s["total_size"] for s in segs)
    free_blocks = [b["size"] for s in segs for b in s["blocks"] if b["state"] == "inactive"]
    empty = [s for s in segs if s["active_size"] == 0]

    [f] = run(AllocatorFragmentation, fixture(FRAGMENTED))
    e = f.evidence
    assert f.rule == "allocator-fragmentation" and f.severity == "warning"
    assert e["reserved"] == reserved
    assert e["allocated"] == sum(s["allocated_size"] for s in segs)
    assert e["free"] == sum(free_blocks) == reserved - sum(s["active_size"] for s in segs)
    assert e["largest_free"] == max(free_blocks) == 314 * MiB
    assert e["free_share"] == round(sum(free_blocks) / reserved, 4)
    assert e["empty_segments"] == len(empty)
    assert e["free_in_empty_segments"] == sum(s["total_size"] for s in empty)
    assert e["by_pool"]["large"]["free"] + e["by_pool"]["small"]["free"] == e["free"]
    assert e["by_stream"]["0"]["free"] == e["free"]
    # One figure up front, then the breakdown.
    assert f.message.startswith("GPU memory is fragmented: change the allocator's settings. "
                                "19.4 GiB of the 70.7 GiB reserved on cuda:0 (27%)")
    assert "314.0 MiB" in f.message and "561 wholly empty segments" in f.message
    # Not expandable yet, free bytes mostly in empty segments: expandable first, GC as the fallback.
    assert f.fix.config == {CONF: "expandable_segments:True"}
    assert e["alloc_conf_alternatives"] == ["garbage_collection_threshold:0.8"]


def test_transformer_fixture_is_healthy_by_the_default_thresholds() -> None:
    """5.8 GiB free of 56.9 GiB (10%) is under min-free-share 0.2; lowering the threshold flags it,
    so the silence is the threshold's doing, not a blind spot."""
    d = raw(TRANSFORMER)
    reserved = sum(s["total_size"] for s in d["segments"])
    free = sum(b["size"] for s in d["segments"] for b in s["blocks"] if b["state"] == "inactive")
    assert 0.05 < free / reserved < 0.2
    assert run(AllocatorFragmentation, fixture(TRANSFORMER)) == []
    [f] = run(AllocatorFragmentation, fixture(TRANSFORMER), min_free_share=0.05)
    assert f.evidence["free"] == free


def test_cached_but_contiguous_memory_is_not_fragmentation() -> None:
    """llama: 90% of the reserve is free, but one 3,142 MiB block is two thirds of it: the cache can
    serve any request up to that size, so this is caching, not fragmentation."""
    d = raw(LLAMA)
    free = [b["size"] for s in d["segments"] for b in s["blocks"] if b["state"] == "inactive"]
    assert max(free) / sum(free) > 0.5
    assert run(AllocatorFragmentation, fixture(LLAMA)) == []
    assert len(run(AllocatorFragmentation, fixture(LLAMA), max_largest_share=0.7)) == 1


def test_healthy_built_snapshot_is_not_flagged(tmp_path: Path) -> None:
    full = [[(25 * MiB, A)] * 4] * 40  # 40 segments of 100 MiB, all allocated
    some = [[(25 * MiB, A)] * 3 + [(25 * MiB, F)]] * 3  # 75 MiB of holes
    small = [[(512 * 1024, A)] * 3 + [(512 * 1024, F)]] * 4
    d = {"segments": layout(full + some) + layout(small, pool="small"), "device_traces": [[]],
         "allocator_settings": settings()}
    snap = from_dict(d, tmp_path)
    assert snap.totals.free == 3 * 25 * MiB + 4 * 512 * 1024
    assert run(AllocatorFragmentation, snap) == []


def test_expandable_with_holes_suggests_max_split_size_not_expandable_again(tmp_path: Path) -> None:
    """Already expandable; 100 MiB segments cut into 25 MiB pieces, every other one free. The 25 MiB
    requests get 26 MiB segments of their own, so max_split_size_mb must be 27 to spare the rest."""
    holes = [[(25 * MiB, A), (25 * MiB, F), (25 * MiB, A), (25 * MiB, F)]] * 60
    d = {"segments": layout(holes, expandable=True) + layout([[(100 * MiB, A)]] * 20, stream=7, expandable=True),
         "device_traces": [[]], "allocator_settings": settings("expandable_segments:True", expandable=True)}
    [f] = run(AllocatorFragmentation, from_dict(d, tmp_path))
    assert f.evidence["free"] == 60 * 50 * MiB and f.evidence["largest_free"] == 25 * MiB
    assert f.evidence["free_in_split_segments"] == f.evidence["free"]
    assert f.fix.config == {CONF: "expandable_segments:True,max_split_size_mb:27"}
    assert "stream 7" in f.message and f.evidence["by_stream"]["7"]["free"] == 0


def test_expandable_with_empty_segments_suggests_gc_and_keeps_user_settings(tmp_path: Path) -> None:
    conf = "expandable_segments:True,roundup_power2_divisions:[256:1,512:2]"
    empty = [[(20 * MiB, F)], [(50 * MiB, F)], [(16 * MiB, F)]] * 20
    used = [[(100 * MiB, A)]] * 30
    d = {"segments": layout(empty + used, expandable=True), "device_traces": [[]],
         "allocator_settings": settings(conf, expandable=True)}
    [f] = run(AllocatorFragmentation, from_dict(d, tmp_path), gc_threshold=0.7)
    assert f.evidence["free_in_empty_segments"] == 20 * 86 * MiB
    assert f.fix.config == {CONF: conf + ",garbage_collection_threshold:0.7"}
    assert f.evidence["alloc_conf_alternatives"] == []


def test_not_expandable_with_holes_offers_max_split_size_as_the_alternative(tmp_path: Path) -> None:
    holes = [[(8 * MiB, A), (12 * MiB, F)]] * 100  # 20 MiB segments split by 8 MiB requests
    d = {"segments": layout(holes), "device_traces": [[]], "allocator_settings": settings()}
    [f] = run(AllocatorFragmentation, from_dict(d, tmp_path))
    assert f.fix.config == {CONF: "expandable_segments:True"}
    assert f.evidence["alloc_conf_alternatives"] == ["max_split_size_mb:21"]


@pytest.mark.parametrize("conf, expected", [
    ("", {}),
    ("expandable_segments:True", {"expandable_segments": "True"}),
    ("max_split_size_mb:128,roundup_power2_divisions:[256:1,512:2,>:4],garbage_collection_threshold:0.6",
     {"max_split_size_mb": "128", "roundup_power2_divisions": "[256:1,512:2,>:4]", "garbage_collection_threshold": "0.6"}),
])
def test_alloc_conf_round_trips(conf: str, expected: dict[str, str]) -> None:
    assert split_conf(conf) == expected
    assert merge_conf(conf) == conf
    assert split_conf(merge_conf(conf, expandable_segments="True"))["expandable_segments"] == "True"


# ------------------------------------------------------------------------------------------------
# oom-risk


def _is_user(f: dict) -> bool:
    fn = f["filename"]
    return f["line"] > 0 and fn.endswith(".py") and "site-packages" not in fn


def _replay_raw(d: dict, upto: int) -> tuple[int, dict[tuple[str, int] | None, int]]:
    """Allocated bytes just after trace entry `upto`, and the bytes allocated during the trace and
    still live then, by first user frame (None: no user frame). Prefix sums from the end state."""
    trace = d["device_traces"][0]
    live_end = sum(b["requested_size"] for s in d["segments"] for b in s["blocks"] if b["state"] != "inactive")
    delta = [e["size"] if e["action"] == "alloc" else -e["size"] if e["action"] == "free_completed" else 0
             for e in trace]
    total = live_end - sum(delta) + sum(delta[:upto + 1])
    live: dict[int, dict] = {}
    for e in trace[:upto + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    groups: dict[tuple[str, int] | None, int] = {}
    for e in live.values():
        first = next((f for f in e["frames"] if _is_user(f)), None)
        key = (first["filename"], first["line"]) if first else None
        groups[key] = groups.get(key, 0) + e["size"]
    return total, groups


def _peak_raw(d: dict) -> tuple[int, int, int]:
    """(peak allocated, its index, peak reserved) by prefix sums."""
    trace = d["device_traces"][0]
    best, best_i = _replay_raw(d, -1)[0], -1
    cur = best
    for i, e in enumerate(trace):
        cur += e["size"] if e["action"] == "alloc" else -e["size"] if e["action"] == "free_completed" else 0
        if cur > best:
            best, best_i = cur, i
    reserved = sum(s["total_size"] for s in d["segments"])
    seg = [e["size"] if e["action"] == "segment_alloc" else -e["size"] if e["action"] == "segment_free" else 0
           for e in trace]
    r = reserved - sum(seg)
    r_peak = r
    for x in seg:
        r += x
        r_peak = max(r, r_peak)
    return best, best_i, r_peak


def test_transformer_near_a_60_gib_device_names_the_owning_lines() -> None:
    d = raw(TRANSFORMER)
    peak, peak_i, r_peak = _peak_raw(d)
    total, groups = _replay_raw(d, peak_i)
    assert total == peak

    [f] = run(OomRisk, fixture(TRANSFORMER), device_capacity_gib=60.0, top_owners=100)
    e = f.evidence
    assert f.severity == "warning" and f.rule == "oom-risk"
    assert (e["peak_allocated"], e["peak_index"], e["peak_reserved"]) == (peak, peak_i, r_peak)
    assert e["capacity"] == 60 * GiB and e["capacity_source"] == "device-capacity-gib"
    assert e["share"] == round(r_peak / (60 * GiB), 4)
    assert e["peak_time_us"] == d["device_traces"][0][peak_i]["time_us"]
    # Bytes per user line agree with the test's own replay; the rest (no user frame, or allocated
    # before recording began) adds up to the same remainder.
    named = {(o["file"], o["line"]): o["bytes"] for o in e["owners"]
             if o["file"] and not o["file"].startswith("<")}
    assert len(named) >= 3 and named == {k: v for k, v in groups.items() if k is not None}
    assert sum(o["bytes"] for o in e["owners"]) == peak
    # Locations are the named owners, largest first, no code when the file is not here.
    expected = sorted(named, key=lambda k: -named[k])
    assert [(loc.file, loc.line) for loc in f.locations] == expected
    assert f.locations[0].file.endswith("cs336_basics/optimizers.py") and f.locations[0].code == ""
    assert f.fix.config == {CONF: "expandable_segments:True"}


def test_transformer_on_an_80_gib_device_is_not_at_risk() -> None:
    assert run(OomRisk, fixture(TRANSFORMER), device_capacity_gib=80.0) == []
    assert run(OomRisk, fixture(TRANSFORMER)) == []  # an assumed 80 GB card's 79.15 GiB: 72%


def _recorded_80gb_totals() -> list[int]:
    """totalGlobalMem of the "80GB" cards the fixture traces were recorded on (A100, H100)."""
    totals = []
    for path in sorted((SNAPSHOTS.parent / "traces").glob("*.json.gz")):
        with gzip.open(path, "rt") as f:
            text = f.read()
        # (the top-level list alone is decoded: the events around it are most of the file's parse)
        at = text.find('"deviceProperties"')
        props = json.JSONDecoder().raw_decode(text, text.index("[", at))[0] if at >= 0 else []
        totals += [p["totalGlobalMem"] for p in props if "80GB" in p["name"]]
    return totals


def test_unknown_capacity_is_assumed_and_reported_as_info() -> None:
    """The fragmented snapshot (70.7 GiB reserved) alone: an 80 GB card is the smallest that holds
    it, at the memory such a card really has. The recorded A100 80GB and H100 80GB report 79.15 and
    79.18 GiB; the nominal 80 taken as GiB understated the share (88.4% for 89.3%), and a peak
    between 79.2 and 80 GiB would have been called a fit on a card that cannot hold it."""
    d = raw(FRAGMENTED)
    reserved = sum(s["total_size"] for s in d["segments"])
    recorded = _recorded_80gb_totals()
    assert len(recorded) >= 2 and max(recorded) < 80 * GiB
    assert run(OomRisk, fixture(FRAGMENTED)) == []
    [f] = run(OomRisk, fixture(FRAGMENTED), near_share=0.89)
    capacity = f.evidence["capacity"]
    assert min(recorded) - 8 * MiB < capacity <= min(recorded)  # the real card's, to 2 decimals of a GiB
    share = reserved / capacity
    assert 0.89 < share < 0.9 and reserved / (80 * GiB) < 0.89  # (the old 80 GiB: not flagged at 0.89)
    assert f.severity == "info"
    assert f.evidence["capacity_source"] == "assumed" and f.evidence["assumed_device"] == "80 GB A100/H100"
    assert f.evidence["peak_reserved"] == reserved and f.evidence["share"] == round(share, 4)
    assert (f"{share:.0%} of the {capacity / GiB:.2f} GiB of an assumed 80 GB A100/H100 (the smallest common "
            "device that holds it; set device-capacity-gib)") in f.message
    assert f.locations == []  # a state-only snapshot without stacks names no lines
    assert "owning lines are unknown" in f.message


def _with_oom(d: dict, at: int, size: int, device_free: int, frames: list[dict]) -> dict:
    trace = d["device_traces"][0]
    t = trace[at - 1]["time_us"] if at > 0 else trace[0]["time_us"]
    trace.insert(at, {"action": "oom", "size": size, "device_free": device_free, "stream": 0, "time_us": t,
                      "frames": frames})
    return d


@pytest.mark.parametrize("where", ["end", "middle"])
def test_oom_post_mortem(tmp_path: Path, where: str) -> None:
    d = raw(TRANSFORMER)
    trace = d["device_traces"][0]
    at = len(trace) if where == "end" else len(trace) // 2
    asking = next(e for e in reversed(trace[:at]) if e["action"] == "alloc"
                  and any(_is_user(f) for f in e["frames"]))
    user = next(f for f in asking["frames"] if _is_user(f))
    allocated, groups = _replay_raw(d, at - 1)
    seg = sum(e["size"] for e in trace[at:] if e["action"] == "segment_alloc")
    reserved = sum(s["total_size"] for s in d["segments"]) - seg
    _with_oom(d, at, size=64 * GiB, device_free=300 * MiB, frames=asking["frames"])

    snap = from_dict(d, tmp_path, protocol=5)
    assert snap.histories[0].oom_indices == [at]
    [f] = run(OomRisk, snap, top_owners=100)
    e = f.evidence
    assert f.severity == "error"
    assert (e["requested"], e["device_free"], e["oom_index"]) == (64 * GiB, 300 * MiB, at)
    assert (e["allocated"], e["reserved"]) == (allocated, reserved)
    assert e["capacity_at_least"] == reserved + 300 * MiB
    assert (f.locations[0].file, f.locations[0].line) == (user["filename"], user["line"])
    named = {(o["file"], o["line"]): o["bytes"] for o in e["owners"] if o["file"] and not o["file"].startswith("<")}
    assert named and named == {k: v for k, v in groups.items() if k is not None}
    assert sum(o["bytes"] for o in e["owners"]) == allocated
    assert "really full" in f.message  # 64 GiB asked, ~6 GiB cached: not fragmentation
    assert f"{allocated / GiB:.1f} GiB was allocated" in f.message


def test_oom_with_a_large_cache_blames_fragmentation(tmp_path: Path) -> None:
    d = raw(TRANSFORMER)
    trace = d["device_traces"][0]
    _with_oom(d, len(trace), size=2 * GiB, device_free=10 * MiB, frames=[])
    snap = from_dict(d, tmp_path)
    [f] = run(OomRisk, snap)
    assert f.evidence["reserved_unallocated"] == f.evidence["reserved"] - f.evidence["allocated"] > 2 * GiB
    assert "fragmentation, not a full device" in f.message
    assert f.fix.config == {CONF: "expandable_segments:True"}
    # No stack for the request: the locations are only the owners'.
    assert all("<" not in loc.file for loc in f.locations)


def test_oom_on_an_expandable_allocator_offers_no_allocator_setting(tmp_path: Path) -> None:
    d = raw(TRANSFORMER)
    d["allocator_settings"]["expandable_segments"] = True
    _with_oom(d, len(d["device_traces"][0]), size=2 * GiB, device_free=10 * MiB, frames=[])
    [f] = run(OomRisk, from_dict(d, tmp_path))
    assert f.fix.config == {}


# ------------------------------------------------------------------------------------------------
# oom-risk: where the capacity comes from (option > OOM record > device properties > assumed)


def _options(**options: Any) -> Options:
    return OomRisk.options_with({k.replace("_", "-"): v for k, v in options.items()})


def _analyze(paths: list[Path], **options: Any) -> list[Finding]:
    """`audit analyze PATHS`'s loading, then oom-risk alone."""
    return list(OomRisk().check(load_paths(paths), _options(**options)))


def _near_capacity(findings: list[Finding], snapshot: Path) -> list[Finding]:
    return [f for f in findings if f.evidence["snapshot"] == str(snapshot) and "capacity_source" in f.evidence]


def _device_trace(tmp_path: Path, devices: list[dict]) -> Path:
    """A profiler trace as Kineto writes one, reduced to its device table and one step."""
    path = tmp_path / "run.pt.trace.json"
    path.write_text(json.dumps({"deviceProperties": devices, "traceEvents": [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#0", "pid": 1, "tid": 1, "ts": 0, "dur": 100}]}))
    return path


def test_capacity_from_a_recorded_traces_device_properties() -> None:
    """The fragmented snapshot (70.7 GiB reserved) with the H100 trace: judged against the H100's
    totalGlobalMem (79.2 GiB, 89%), not an assumed 80 GiB, so a 0.85 threshold makes it a warning
    where the snapshot alone gives info. At the default 0.9 neither flags it: on a real 80 GB
    device this peak is not near-full by the rule's measure."""
    with gzip.open(H100_TRACE, "rt") as f:
        [props] = json.load(f)["deviceProperties"]
    total, name = props["totalGlobalMem"], props["name"]
    reserved = sum(s["total_size"] for s in raw(FRAGMENTED)["segments"])
    assert props["id"] == 0 and 0.85 < reserved / total < 0.9 and total != 80 * GiB

    [alone] = run(OomRisk, fixture(FRAGMENTED), near_share=0.85)
    assert alone.severity == "info" and alone.evidence["capacity_source"] == "assumed"
    [f] = _analyze([FRAGMENTED, H100_TRACE], near_share=0.85)
    e = f.evidence
    assert f.severity == "warning"
    assert (e["capacity"], e["capacity_source"], e["capacity_from"]) == (total, "device-properties", str(H100_TRACE))
    assert (e["peak_reserved"], e["share"]) == (reserved, round(reserved / total, 4))
    assert f"{reserved / total:.0%} of the {total / GiB:.1f} GiB device ({name}, from the profiler trace's " \
           "deviceProperties)" in f.message
    assert _analyze([FRAGMENTED, H100_TRACE]) == []


def test_a_device_just_above_the_peak_is_near_full_and_the_precedence_holds(tmp_path: Path) -> None:
    """A trace from the snapshot's run stating device 0 at 2 GiB above the peak reserved (device 1,
    larger, is not the snapshot's): flagged at the default threshold, where the assumed 80 GB card is
    silent. The option beats it; an OOM observer's record among the inputs beats it too."""
    reserved = sum(s["total_size"] for s in raw(FRAGMENTED)["segments"])
    total = reserved + 2 * GiB
    trace = _device_trace(tmp_path, [{"id": 1, "name": "other", "totalGlobalMem": 80 * GiB},
                                     {"id": 0, "name": "test device", "totalGlobalMem": total}])
    assert run(OomRisk, fixture(FRAGMENTED)) == []  # alone: 89% of an assumed 80 GB card
    [f] = _analyze([FRAGMENTED, trace])
    assert f.severity == "warning" and f.evidence["capacity_source"] == "device-properties"
    assert (f.evidence["capacity"], f.evidence["share"]) == (total, round(reserved / total, 4))
    assert "(test device, from the profiler trace's deviceProperties)" in f.message

    # the option first
    assert _analyze([FRAGMENTED, trace], device_capacity_gib=80.0) == []
    [g] = _analyze([FRAGMENTED, trace], device_capacity_gib=72.0)
    assert (g.evidence["capacity"], g.evidence["capacity_source"]) == (72 * GiB, "device-capacity-gib")

    # then an OOM record from the same run (another snapshot: the OOM snapshot), over the trace
    oom = tmp_path / "oom_snapshot.pickle"
    oom.write_bytes(pickle.dumps({"segments": layout([[(100 * MiB, A)]]), "device_traces": [[]],
                                  "allocator_settings": settings()}, protocol=4))
    limit = reserved + 1 * GiB
    oom_record_path(oom).write_text(json.dumps({"kind": OOM_RECORD_KIND, "device": 0, "requested": 2 * GiB,
                                                "device_total": limit, "device_free": 10 * MiB, "frames": []}))
    findings = _analyze([FRAGMENTED, trace, oom])
    assert {f.evidence.get("source") for f in findings if f.evidence["snapshot"] == str(oom)} == {"oom-observer"}
    [h] = _near_capacity(findings, FRAGMENTED)
    assert (h.evidence["capacity"], h.evidence["capacity_source"]) == (limit, "oom-record")
    assert h.evidence["capacity_from"] == str(oom_record_path(oom)) and h.severity == "warning"
    assert h.evidence["share"] == round(reserved / limit, 4)


def test_a_trace_from_a_smaller_device_is_called_out(tmp_path: Path) -> None:
    """A peak larger than the stated device: the inputs do not belong together."""
    reserved = sum(s["total_size"] for s in raw(FRAGMENTED)["segments"])
    trace = _device_trace(tmp_path, [{"id": 0, "name": "small", "totalGlobalMem": 32 * GiB}])
    [f] = _analyze([FRAGMENTED, trace])
    assert f.evidence["share"] == round(reserved / (32 * GiB), 4) > 1
    assert "was the snapshot taken on another device?" in f.message


# ------------------------------------------------------------------------------------------------
# Both rules


@pytest.mark.parametrize("rule", [AllocatorFragmentation, OomRisk])
def test_rules_skip_without_a_snapshot(rule: type[Rule]) -> None:
    reason = skip_reason(rule(), Evidence())
    assert reason and "snapshot" in reason
    assert skip_reason(rule(), evidence(fixture(LLAMA))) is None


@pytest.mark.parametrize("rule", [AllocatorFragmentation, OomRisk])
def test_rule_documents_itself(rule: type[Rule]) -> None:
    doc = rule.docs()
    for heading in ("What it detects:", "Why it costs:", "Example:", "Fix:", "Evidence needed:"):
        assert heading in doc
    assert rule.id in ("allocator-fragmentation", "oom-risk")
    assert all(o.help for o in rule.options)


def test_every_device_is_judged_on_its_own(tmp_path: Path) -> None:
    """Two GPUs in one snapshot: only the fragmented one is flagged, and figures are per device."""
    bad = layout([[(25 * MiB, A), (25 * MiB, F), (25 * MiB, A), (25 * MiB, F)]] * 60, device=1)
    good = layout([[(100 * MiB, A)]] * 60, device=0)
    d = {"segments": good + bad, "device_traces": [[], []], "allocator_settings": settings()}
    [f] = run(AllocatorFragmentation, from_dict(d, tmp_path))
    assert f.evidence["device"] == 1 and f.evidence["reserved"] == 60 * 100 * MiB
