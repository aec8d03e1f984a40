"""A snapshot's allocator report: the replay under its own settings set against the recording,
what-ifs under other settings, and the times the allocator hit the device's limit (churn).

The device's capacity is not in a snapshot. It comes, in order, from the caller (`--device-memory`),
the OOM observer's record beside the snapshot, an `oom` entry of the trace (reserve at that moment
plus what CUDA still had free), a recorded release-and-retry (see _churn_bound), or is assumed: the smallest common device (auditor.evidence.allocator.devices)
that holds the recorded reserve.
"""
from __future__ import annotations

import contextlib
from bisect import bisect_left
from typing import Any, Iterator

import msgspec

from auditor.evidence.allocator.devices import COMMON_DEVICES_GIB
from auditor.evidence.allocator.config import AllocatorConfig, parse_alloc_conf
from auditor.evidence.allocator.records import AllocatorReport, Churn, Figures, Release, StepPeak, WhatIf
from auditor.evidence.allocator.replay import (program_releases, recorded_figures, recorded_series, replay,
                                               replay_error)
from auditor.evidence.allocator.simulator import OOM, RETRY, SEGMENT_FREE, SEGMENT_UNMAP
from auditor.evidence.snapshot import ALLOC, FREE_COMPLETED, FREE_REQUESTED, OOM as OOM_ACTION, SEGMENT_ALLOC, SEGMENT_MAP, GiB, Snapshot, reserved_at

# max_split_size_mb values tried besides the one allocator-fragmentation derives from the snapshot
_SPLIT_MB = (128, 512)
GC_NOTE = "needs torch.cuda.set_per_process_memory_fraction (the allocator collects only under a fraction)"


_GIVEN: list[int | None] = [None]  # the command's --device-memory, in bytes (given_device_memory)


def given_capacity() -> int | None:
    """`--device-memory` of the command running (given_device_memory), in bytes; None when not given."""
    return _GIVEN[0]


@contextlib.contextmanager
def given_device_memory(gib: float | None) -> Iterator[None]:
    """Replays in this block run on a device of `gib` GiB (`--device-memory`; None: as recorded)."""
    before, _GIVEN[0] = _GIVEN[0], int(gib * GiB) if gib else None
    try:
        yield
    finally:
        _GIVEN[0] = before


def step_ends(snapshot: Snapshot) -> list[int]:
    """Times (us) the snapshot's optimizer steps ended: its `Optimizer.step` END annotations."""
    return sorted(a.time_us for a in snapshot.external_annotations
                  if a.stage == "END" and a.name.startswith("Optimizer.step") and a.time_us is not None)


def step_peaks(snapshot: Snapshot, device: int, series: Any) -> list[StepPeak]:
    """The reserve's peak in each step of the trace (an entry belongs to the first step that ends at
    or after its time); empty without step annotations or times."""
    ends = step_ends(snapshot)
    trace = snapshot.device_traces[device]
    if not ends or len(series) != len(trace):
        return []
    out: dict[int, StepPeak] = {}
    for i, e in enumerate(trace):
        if e.time_us is None:
            continue
        step = bisect_left(ends, e.time_us)
        p = out.get(step)
        if p is None:
            out[step] = StepPeak(step=step, reserved_peak_bytes=series[i], first_index=i, last_index=i)
        else:
            p.reserved_peak_bytes = max(p.reserved_peak_bytes, series[i])
            p.last_index = i
    return [out[k] for k in sorted(out)]


def device_capacity(evidence: Any, device: int) -> tuple[int, str] | None:
    """The capacity the run's own device reported (environment.cuda_devices, read at the run's end):
    its total memory times the per-process fraction the program set, with the source naming the
    device; None when the run recorded no such device (a snapshot analysed on its own)."""
    env = getattr(evidence, "environment", None)
    for d in getattr(env, "cuda_devices", None) or []:
        if d.get("index") == device and int(d.get("total_memory") or 0) > 0:
            fraction = d.get("memory_fraction")
            fraction = float(fraction) if isinstance(fraction, (int, float)) and 0 < fraction < 1 else 1.0
            name = str(d.get("name") or f"cuda:{device}")
            if fraction < 1:
                return (int(d["total_memory"] * fraction),
                        f"from the device: {name}, per-process fraction {fraction:g}")
            return int(d["total_memory"]), f"from the device: {name}"
    return None


def capacity_for(snapshot: Snapshot, device: int, given: int | None = None,
                 recorded: tuple[int, str] | None = None) -> tuple[int, str]:
    """The device capacity the replay runs under: --device-memory; the OOM observer's record or a
    recorded OOM entry; the run's own device (`recorded`, see device_capacity); a recorded
    release-and-retry; else the smallest common device that holds the recorded reserve."""
    given = given or given_capacity()
    if given:
        return given, "given"
    if snapshot.oom is not None and snapshot.oom.device == device and snapshot.oom.device_total:
        return snapshot.oom.device_total, "oom record"
    trace = snapshot.device_traces[device] if device < len(snapshot.device_traces) else []
    for i, e in enumerate(trace):
        if e.action == OOM_ACTION and e.device_free is not None:
            total = reserved_at(snapshot, device, i) + e.device_free
            if total > 0:
                return total, "oom entry"
    if recorded is not None:
        return recorded
    h = snapshot.histories.get(device)
    bound = _churn_bound(snapshot, device)
    if bound is not None and h is not None and bound >= h.peak_reserved:
        return bound, "churn in the trace"
    need = max(h.peak_reserved if h else 0, sum(s.total_size for s in snapshot.device_segments(device)))
    for gib, name in sorted(COMMON_DEVICES_GIB.items()):
        if gib * GiB >= need:
            return int(gib * GiB), f"assumed: {name}"
    return need, "assumed: the recorded reserve"


def _churn_bound(snapshot: Snapshot, device: int) -> int | None:
    """The capacity a recorded release-and-retry implies: cudaMalloc of the segment that followed
    the burst failed with the reserve before it, so the device held less than that reserve plus the
    segment; the replay takes one byte less (the largest capacity consistent with every burst)."""
    trace = snapshot.device_traces[device]
    h = snapshot.histories.get(device)
    if h is None:
        return None
    by_program = {first for first, _ in program_releases(trace)}  # (empty_cache: no cudaMalloc failed)
    reserved, bound, i, n = h.start_reserved, None, 0, len(trace)
    while i < n:
        e = trace[i]
        if e.action in (SEGMENT_FREE, SEGMENT_UNMAP):
            before, first = reserved, i
            while i < n and trace[i].action in (SEGMENT_FREE, SEGMENT_UNMAP):
                reserved -= trace[i].size
                i += 1
            if i < n and trace[i].action in (SEGMENT_ALLOC, SEGMENT_MAP) and first not in by_program:
                b = before + trace[i].size - 1
                bound = b if bound is None else min(bound, b)
            continue
        if e.action in (SEGMENT_ALLOC, SEGMENT_MAP):
            reserved += e.size
        i += 1
    return bound


def what_if_configs(base: AllocatorConfig, split_mb: int | None) -> list[tuple[AllocatorConfig, str]]:
    """The settings tried: expandable segments, max_split_size_mb values, a garbage collection
    threshold (under a memory fraction of 1.0) and power-of-two rounding, each over `base`."""
    confs = ["expandable_segments:True"]
    for mb in sorted({m for m in (split_mb, *_SPLIT_MB) if m}):
        confs.append(f"max_split_size_mb:{mb}")
    confs += ["garbage_collection_threshold:0.8", "roundup_power2_divisions:4"]
    out = []
    for conf in confs:
        cfg = parse_alloc_conf(conf, base)
        if cfg == base:
            continue
        note = ""
        if cfg.garbage_collection_threshold > 0 and cfg.memory_fraction is None:
            cfg = msgspec.structs.replace(cfg, memory_fraction=1.0)
            note = GC_NOTE
        out.append((cfg, note))
    return out


def _releases(snapshot: Snapshot, device: int) -> list[Release]:
    """The program's empty_cache() calls in the trace (replay.program_releases), each with what the
    allocator cudaMalloc'd again after it."""
    trace = snapshot.device_traces[device]
    bursts = program_releases(trace)
    out = []
    for k, (first, end) in enumerate(bursts):
        until = bursts[k + 1][0] if k + 1 < len(bursts) else len(trace)
        grown = [e.size for e in trace[end:until] if e.action in (SEGMENT_ALLOC, SEGMENT_MAP)]
        e = trace[first]
        owner = e.owner
        out.append(Release(index=first, segments_freed=end - first, bytes_freed=sum(x.size for x in trace[first:end]),
                           segments_regrown=len(grown), bytes_regrown=sum(grown), time_us=e.time_us,
                           file=owner.filename if owner else "", line=owner.line if owner else 0,
                           function=owner.name if owner else ""))
    return out


def _recorded_churn(snapshot: Snapshot, device: int) -> list[Churn]:
    """Each oom entry, and each burst of segment_free / segment_unmap that a segment_alloc /
    segment_map follows directly: the cache freed to make room for a request (release_cached_blocks,
    or release_available_cached_blocks under max_split_size). The program's own empty_cache() calls
    are not churn of the allocator's making (see _releases)."""
    trace = snapshot.device_traces[device]
    out: list[Churn] = []
    by_program = {first for first, _ in program_releases(trace)}
    i, n = 0, len(trace)
    while i < n:
        e = trace[i]
        if e.action == OOM_ACTION:
            out.append(_churn(trace, i, e.size, e.stream, 0, 0))
            i += 1
            continue
        if e.action in (SEGMENT_FREE, SEGMENT_UNMAP):
            j, freed = i, 0
            while j < n and trace[j].action in (SEGMENT_FREE, SEGMENT_UNMAP):
                freed += trace[j].size
                j += 1
            if j < n and trace[j].action in (SEGMENT_ALLOC, SEGMENT_MAP) and i not in by_program:
                k = j
                while k < n and trace[k].action != ALLOC:
                    k += 1
                req = trace[k] if k < n else trace[j]
                out.append(_churn(trace, k if k < n else j, req.size if k < n else trace[j].size,
                                  req.stream, j - i, freed))
            i = j
            continue
        i += 1
    return out


def _churn(trace: list, index: int, size: int, stream: int, segments: int, freed: int, recorded: bool = True) -> Churn:
    e = trace[index] if 0 <= index < len(trace) else None
    owner = e.owner if e is not None else None
    return Churn(index=index, requested_bytes=size, stream=stream, segments_freed=segments, bytes_freed=freed,
                 time_us=e.time_us if e is not None else None, file=owner.filename if owner else "",
                 line=owner.line if owner else 0, function=owner.name if owner else "", recorded=recorded)


def _simulated_churn(snapshot: Snapshot, device: int, events: list[tuple[int, str, int, int, int]]) -> list[Churn]:
    trace = snapshot.device_traces[device]
    out = []
    for k, (index, kind, size, stream, _) in enumerate(events):
        if kind != RETRY:
            continue
        freed = [ev for ev in events[k + 1:] if ev[0] == index and ev[1] in (SEGMENT_FREE, SEGMENT_UNMAP)]
        out.append(_churn(trace, index, size, stream, len(freed), sum(ev[2] for ev in freed), recorded=False))
    return out


def analyze(snapshot: Snapshot, device: int, capacity: int | None = None, what_ifs: bool = True,
            split_mb: int | None = None, recorded: tuple[int, str] | None = None) -> AllocatorReport:
    """The report for one device of a snapshot with history (snapshot.histories[device]);
    `recorded`: the run's own device capacity (device_capacity)."""
    settings = snapshot.allocator_settings
    base = settings.config if settings is not None else AllocatorConfig()
    cap, source = capacity_for(snapshot, device, capacity, recorded)
    notes = []
    if settings is None:
        notes.append("no allocator_settings in the snapshot: replayed under the defaults")
    if snapshot.expandable:
        notes.append("expandable segments: the segments reserved before the trace are seeded as plain segments")
    base_run = replay(snapshot, device, base, cap, keep_series=True)
    recorded = recorded_figures(snapshot, device)
    replayed = base_run.figures()
    requests = [e.action in (ALLOC, FREE_REQUESTED, FREE_COMPLETED) for e in snapshot.device_traces[device]]
    error = replay_error(recorded, recorded_series(snapshot, device), replayed, base_run.series or [], requests)
    churn = _recorded_churn(snapshot, device)
    if not churn and not source.startswith("assumed"):
        churn = _simulated_churn(snapshot, device, base_run.sim.events)
    per_step = step_peaks(snapshot, device, base_run.series or [])
    report = AllocatorReport(device=device, capacity_bytes=cap, capacity_source=source, alloc_conf=base.alloc_conf(),
                             entries=len(snapshot.device_traces[device]), seeded_segments=base_run.seeded_segments,
                             seeded_blocks=base_run.seeded_blocks, recorded=recorded, replayed=replayed, error=error,
                             churn=churn, per_step=per_step, replay_ms=round(base_run.ms, 1), notes=notes)
    report.releases = _releases(snapshot, device)
    if report.releases:
        report.without_releases = replay(snapshot, device, base, cap, releases=False).figures()
    if what_ifs:
        for cfg, note in what_if_configs(base, split_mb):
            r = replay(snapshot, device, cfg, cap)
            f = r.figures()
            report.what_if.append(WhatIf(alloc_conf=cfg.alloc_conf(), reserved_peak_bytes=f.reserved_peak_bytes,
                                         segment_allocs=f.segment_allocs, segment_frees=f.segment_frees,
                                         largest_free_block_bytes=r.sim.largest_free_block(),
                                         retries=r.sim.retries, ooms=r.sim.ooms, note=note))
    return report


_CACHE: dict[tuple[int, int, str], tuple[Snapshot, WhatIf]] = {}


def simulate_conf(snapshot: Snapshot, device: int, conf: str) -> WhatIf | None:
    """The device's requests under the recorded settings overlaid with `conf` (a
    PYTORCH_CUDA_ALLOC_CONF), on the device capacity_for finds; None without a history or when
    `conf` is one the allocator would refuse. Cached per snapshot object."""
    if device not in snapshot.histories:
        return None
    key = (id(snapshot), device, conf)
    hit = _CACHE.get(key)
    if hit is not None and hit[0] is snapshot:
        return hit[1]
    settings = snapshot.allocator_settings
    base = settings.config if settings is not None else AllocatorConfig()
    try:
        cfg = parse_alloc_conf(conf, base)
    except ValueError:
        return None
    note = ""
    if cfg.garbage_collection_threshold > 0 and cfg.memory_fraction is None:
        cfg, note = msgspec.structs.replace(cfg, memory_fraction=1.0), GC_NOTE
    r = replay(snapshot, device, cfg, capacity_for(snapshot, device)[0])
    f = r.figures()
    out = WhatIf(alloc_conf=conf, reserved_peak_bytes=f.reserved_peak_bytes, segment_allocs=f.segment_allocs,
                 segment_frees=f.segment_frees, largest_free_block_bytes=r.sim.largest_free_block(),
                 retries=r.sim.retries, ooms=r.sim.ooms, note=note)
    if len(_CACHE) > 64:
        _CACHE.clear()
    _CACHE[key] = (snapshot, out)
    return out


def helps(recorded: Figures, w: WhatIf, recorded_retries: int = 0) -> bool:
    """The setting lowers the reserve's peak, the cudaFree count, or the flush-and-retry count."""
    return (w.reserved_peak_bytes < recorded.reserved_peak_bytes or w.segment_frees < recorded.segment_frees
            or w.retries < recorded_retries)


def saving_text(recorded: Figures, w: WhatIf) -> str:
    """"reserved peak 22.6 -> 21.1 GiB, 354 -> 0 segment frees" (the simulated change)."""
    return (f"reserved peak {bytes_pair(recorded.reserved_peak_bytes, w.reserved_peak_bytes)}, "
            f"{recorded.segment_frees} -> {w.segment_frees} segment frees")


def bytes_pair(a: int, b: int) -> str:
    """"56.9 -> 51.8 GiB": two sizes in the unit of the larger."""
    top = max(a, b)
    unit, scale = next(((u, s) for u, s in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1024)) if top >= s), ("B", 1))
    return f"{a / scale:.1f} -> {b / scale:.1f} {unit}" if scale > 1 else f"{a} -> {b} B"


def retries_and_ooms(report: AllocatorReport) -> tuple[int, int]:
    return sum(1 for c in report.churn if c.segments_freed), sum(1 for c in report.churn if not c.segments_freed)


def reports_for(evidence: Any, capacity: int | None = None) -> list[AllocatorReport]:
    """Allocator reports of every snapshot with history the evidence holds (see snapshot_reports)."""
    return [r for _, r in snapshot_reports(evidence, capacity)]


def _entries(snapshot: Snapshot, device: int) -> list[tuple]:
    return [(e.action, e.addr, e.size, e.stream, e.time_us) for e in snapshot.device_traces[device]]


def snapshot_reports(evidence: Any, capacity: int | None = None) -> list[tuple[Snapshot, AllocatorReport]]:
    """(snapshot, report) for each device history the evidence holds, computed once and kept on the
    evidence (runtime attribute `allocator_reports`, never serialised). One recording is reported
    once: the OOM snapshot and the profiled window's history snapshot dumped after the same OOM hold
    the same trace (the window's may go on past it), so a history whose entries begin another's, or
    are begun by it, is left out; the snapshot with the OOM observer's record is kept (it knows the
    device's capacity). The capacity is the evidence's `device_memory_bytes` runtime attribute when
    set (--device-memory)."""
    cached = evidence.__dict__.get("allocator_reports")
    if cached is not None:
        return cached
    from auditor.evidence.allocator.splits import split_mb_for
    capacity = capacity or evidence.__dict__.get("device_memory_bytes")
    out = []
    seen: dict[int, list[list[tuple]]] = {}
    for snap in sorted(evidence.snapshot_data, key=lambda s: s.oom is None):
        for device in sorted(snap.histories):
            entries = _entries(snap, device)
            if any(entries[:len(other)] == other[:len(entries)] for other in seen.get(device, [])):
                continue
            seen.setdefault(device, []).append(entries)
            out.append((snap, analyze(snap, device, capacity, split_mb=split_mb_for(snap, device),
                                      recorded=device_capacity(evidence, device))))
    evidence.__dict__["allocator_reports"] = out
    return out


__all__ = ["analyze", "capacity_for", "device_capacity", "reports_for", "snapshot_reports", "what_if_configs", "OOM", "RETRY"]
