"""oom-risk: GPU memory at or near the device's capacity, and which lines own it."""
from __future__ import annotations

import os
from bisect import bisect_left
from typing import Any, Iterable, NamedTuple

import msgspec

from auditor.evidence.allocator.analysis import helps, saving_text, simulate_conf, step_ends
from auditor.evidence.allocator.growth import growing_lines
from auditor.evidence.oom_record import REHEARSAL_FORECAST
from auditor.evidence.allocator.replay import recorded_figures
from auditor.evidence.allocator.devices import COMMON_CAPACITIES_GIB, COMMON_DEVICES_GIB
from auditor.evidence.model import Evidence
from auditor.evidence.snapshot import (GiB, MemoryFigures, OomRecord, Owner, Snapshot, StackFrame,
                                       format_bytes, live_at, live_requested, owners, reserved_at)
from auditor.rules._support.holders import holder_key, holder_location
from auditor.rules._support.alloc_conf import ALLOC_CONF, merge_conf
from auditor.rules.base import Option, Options, SnapshotRule
from auditor.findings import Finding, Fix, Location
from auditor.evidence import source_access

# (the common devices' memory is shared with the allocator replay: auditor.evidence.allocator.devices)


def source_line(file: str, line: int) -> str:
    """The source text at file:line when that file exists here (snapshots often come from elsewhere)."""
    if line <= 0 or not os.path.isfile(file):
        return ""
    return source_access.getline(file, line).strip()


def has_source(frame: StackFrame | None) -> bool:
    """A frame that names a real source line (synthetic owners like "<autograd>" do not)."""
    return frame is not None and frame.line > 0 and not frame.filename.startswith("<")


def _label(frame: StackFrame | None) -> str:
    if frame is None:
        return "allocated before recording began (no stack)"
    if not has_source(frame):
        return frame.name
    return f"{os.path.basename(frame.filename)}:{frame.line} {frame.name}".rstrip()


def _owner_rows(top: list[Owner]) -> list[dict[str, Any]]:
    return [{"file": o.frame.filename if o.frame else None, "line": o.frame.line if o.frame else None,
             "function": o.frame.name if o.frame else None, "label": _label(o.frame), "bytes": o.bytes,
             "count": o.count} for o in top]


def _owners_text(top: list[Owner]) -> str:
    return ", ".join(f"{_label(o.frame)} {format_bytes(o.bytes)} ({o.count} allocation{'s' if o.count != 1 else ''})"
                     for o in top)


def _locations(frames: Iterable[StackFrame | None]) -> list[Location]:
    seen: set[tuple[str, int]] = set()
    out: list[Location] = []
    for f in frames:
        if has_source(f) and (f.filename, f.line) not in seen:
            assert f is not None
            seen.add((f.filename, f.line))
            out.append(Location(file=f.filename, line=f.line, code=source_line(f.filename, f.line)))
    return out


def _cause(requested: int, cached: int, total: int | None) -> str:
    if total and requested > total:
        return (f"The request alone is larger than the whole device ({format_bytes(total)}): "
                "no allocator setting can serve it.")
    if cached >= requested:
        return (f"The cache held {format_bytes(cached)} reserved but unallocated, more than the request: "
                "fragmentation, not a full device, failed it.")
    return "The device was really full: the live tensors alone left no room."


def _oom_lead(requested: int, cached: int, total: int | None, would: bool = False) -> str:
    """The OOM message's opening sentence: what failed, and what to do, by the cause _cause names."""
    fragmented = not (total and requested > total) and cached >= requested
    todo = ("shrink a request bigger than the device" if total and requested > total else
            "lower the peak" if fragmented else "lower the peak it holds")
    return (f"The GPU {'would run' if would else 'ran'} out of memory{' in a fragmented cache' if fragmented else ''}: "
            f"{todo}. ")


def _config_fix(snap: Snapshot, cached: int, what: str, owners_known: bool) -> Fix:
    """expandable_segments recovers memory the cache holds but cannot hand out; the rest must shrink."""
    reduce = (("reduce what the owning lines hold" if owners_known else "reduce the peak")
              + ": activation checkpointing, a smaller batch or sequence, bf16 autocast, or sharding "
                "optimizer state (FSDP/ZeRO)")
    if snap.expandable or cached <= 0:
        return Fix(summary=f"The allocator cache is not the problem here; {reduce}.")
    existing = snap.allocator_settings.alloc_conf if snap.allocator_settings else ""
    value = merge_conf(existing, expandable_segments="True")
    simulated = ""
    device = next(iter(snap.histories), None) if len(snap.histories) == 1 else None
    if device is not None:  # replay the recorded requests: recommend it only if the simulation says it helps
        w = simulate_conf(snap, device, value)
        recorded = recorded_figures(snap, device)
        if w is not None and not helps(recorded, w):
            return Fix(summary=(f"{value} would not help here: on the recorded requests the simulated allocator "
                                f"gives {saving_text(recorded, w)}; {reduce}."))
        if w is not None:
            simulated = f" (simulated on the recorded requests: {saving_text(recorded, w)})"
    return Fix(summary=(f"Set {ALLOC_CONF}={value} so the {format_bytes(cached)} reserved but not allocated {what} "
                        f"can serve requests of any size{simulated}; beyond that, {reduce}."),
               config={ALLOC_CONF: value})


class Peak(NamedTuple):
    """Where a device's live allocations peaked, in requested bytes throughout (see peak_of)."""

    reserved: int  # the most bytes reserved (segments), whenever that was
    allocated: int  # requested bytes live at the peak
    now: int  # requested bytes live when the snapshot was taken: never above `allocated`
    index: int | None  # trace index of the peak (-1: when recording began); None: the snapshot's state
    reserved_then: int  # bytes reserved at the peak
    owners: list[Owner]  # the live bytes at the peak, by owning line
    text: str  # the message's account of it


_BASIS = "requested bytes, before the allocator rounds them up to its blocks"


def peak_of(snap: Snapshot, device: int) -> Peak:
    """The peak of live allocations and the snapshot's own moment, in one basis. The history
    records what callers requested, not the blocks it was rounded up to, so the state is read in
    requested bytes too (live_requested): a peak in one basis set against the state in the other
    could read below the present. A history that never reaches the state's figure (cut short, or
    inconsistent) yields the state as the peak, so the peak is never below the snapshot."""
    fig = snap.devices[device]
    history = snap.histories.get(device)
    now = live_requested(snap, device)
    if history is not None and history.peak_allocated >= now:
        index = history.peak_allocated_index
        when = (f"event {index + 1:,} of {history.entries:,} in the recorded history" if index >= 0
                else "the start of the recorded history")
        return Peak(max(history.peak_reserved, fig.reserved), history.peak_allocated, now, index,
                    reserved_at(snap, device, index), owners(live_at(snap, device, index)),
                    f"allocations peaked at {format_bytes(history.peak_allocated)} at {when} and held "
                    f"{format_bytes(now)} when the snapshot was taken ({_BASIS})")
    live = owners(b for s in snap.device_segments(device) for b in s.blocks if b.live)
    why = ("state only: no history, so this is the peak as far as it shows" if history is None
           else "the recorded history never held more")
    return Peak(max(history.peak_reserved, fig.reserved) if history else fig.reserved, now, now, None,
                fig.reserved, live, f"allocations held {format_bytes(now)} at the snapshot ({_BASIS}; {why})")


class Capacity(NamedTuple):
    """A device's memory as oom-risk judges against it, and where that figure came from."""

    total: int  # bytes
    source: str  # "device-capacity-gib" (the option), "oom-record", "device-properties" or "assumed"
    said: str  # how the message names the source
    origin: str | None = None  # the file it was read from, or "environment" (the run's own)
    card: str | None = None  # an assumed capacity's device ("80 GB A100/H100")


def known_capacities(evidence: Evidence) -> dict[int, Capacity]:
    """Device index -> the capacity the evidence states, best source first: an OOM observer's record
    (the device total the allocator itself reported, which is the per-process limit when
    set_per_process_memory_fraction lowered it), then the run's environment (torch.cuda.
    get_device_properties in `audit run` on CUDA), then a profiler trace's deviceProperties
    (totalGlobalMem; the first trace that lists the device). Every input given together is taken
    to come from the same machine."""
    known: dict[int, Capacity] = {}
    for trace in evidence.trace_data:
        for p in getattr(trace, "device_properties", []):
            index, total = p.get("id"), p.get("totalGlobalMem")
            if isinstance(index, int) and isinstance(total, int) and total > 0 and index not in known:
                name = f"{p['name']}, " if isinstance(p.get("name"), str) and p["name"] else ""
                known[index] = Capacity(total, "device-properties",
                                        f"{name}from the profiler trace's deviceProperties", str(trace.path))
    for d in evidence.environment.cuda_devices:
        index, total = d.get("index"), d.get("total_memory")
        if isinstance(index, int) and isinstance(total, int) and total > 0:
            name = f"{d['name']}, " if isinstance(d.get("name"), str) and d["name"] else ""
            # the per-process fraction the program set caps what the allocator may take
            fraction = d.get("memory_fraction")
            limited = isinstance(fraction, (int, float)) and 0 < fraction < 1
            known[index] = Capacity(int(total * fraction) if limited else total, "device-properties",
                                    f"{name}as torch.cuda.get_device_properties reported it in the run"
                                    + (f", per-process fraction {fraction:g}" if limited else ""),
                                    "environment")
    for snap in evidence.snapshot_data:
        rec = snap.oom
        if rec is not None and rec.device_total:
            known[rec.device] = Capacity(rec.device_total, "oom-record",
                                         "the device total the allocator reported when it ran out of memory",
                                         rec.path)
    return known


class OomRisk(SnapshotRule):
    """
    What it detects:
        GPU memory that reached, or came close to, the device's capacity in a CUDA memory snapshot:
        the peak reserved bytes against the capacity, and the lines owning the memory at the peak
        (with a history: the live allocations at the replayed peak, by the first Python frame
        outside torch and installed packages; the backward pass's, which have no Python stack, by
        autograd node). A run that ran out of memory gets a post-mortem instead, once per OOM: the
        request that failed, what CUDA still had free, what was live then by owning line (from the
        history's OOM record, or from what `audit run`'s OOM observer saved beside the snapshot),
        and what keeps it alive (the run's graph and tensor scans: a global, a module's state, a
        local, a closure's variable, the line that fills it and its bytes; failing one, the line
        whose allocations stay alive at every step's end). A CUDA rehearsal with `--device-memory`
        forecasts it: the snapshot a GPU would have written at the first step that outgrows it.

    Why it costs:
        A step that hits the limit dies with "CUDA out of memory", often hours into a run, or is
        slowed by the allocator flushing its cache and retrying cudaMalloc (a device-wide sync)
        just below it. Input sizes vary, so a run that peaks within a few percent of the capacity
        fails on the first longer batch.

    Example:
        bad:   peak 56.9 GiB reserved on a 60 GiB device; the optimizer state allocated at
               optimizers.py:82 and :84 (exp_avg, exp_avg_sq) holds 25.4 GiB, gradients 12.6 GiB
        good:  keep the peak below ~90% of the device, e.g. with activation checkpointing, bf16,
               or optimizer state sharded across ranks

    Fix:
        Reduce what the owning lines hold. `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` is
        offered when the cache held reserved-but-unallocated memory at the peak or the OOM, as
        torch's own OOM message advises.

    Evidence needed:
        A CUDA memory snapshot; the owners and the post-mortem need a history
        (`torch.cuda.memory._record_memory_history()`) or the OOM snapshot `audit run` writes with
        the observer's record. The capacity comes from (`capacity_source`): the
        `device-capacity-gib` option; an OOM observer's record; the device's properties (the run's
        environment, or a profiler trace given with the snapshot); else the smallest common device
        that holds the peak, at the memory CUDA reports for it ("assumed": reported as info).
        Allocated bytes are those callers requested (`allocated_basis`), the basis a history
        records; the allocator's rounded blocks hold a little more.
    """

    id = "oom-risk"
    title = "GPU memory at or near the device's capacity"
    severity = "warning"
    category = "memory"
    options = (
        Option("device-capacity-gib", 0.0,
               "memory of the device the snapshot was taken on, in GiB; 0: unknown (see Evidence needed)"),
        Option("near-share", 0.9, "flag when the peak reserved bytes reach this share of the capacity"),
        Option("common-capacities-gib", COMMON_CAPACITIES_GIB,
               "device memory in GiB as CUDA reports it (an 80 GB A100: 79.15) to assume from, the smallest that holds the peak, when the capacity is unknown"),
        Option("top-owners", 5, "how many owning lines to report", low=1),
    )

    # ------------------------------------------------------------------------------------------
    def check(self, evidence: Evidence, options: Options) -> Iterable[Finding]:
        # A snapshot with the observer's record first: it is the OOM's own, and a history snapshot
        # dumped after the same OOM (the profiled window's, when the OOM ends the window) repeats
        # its "oom" entry. One OOM is one finding.
        seen: set[tuple[Any, ...]] = set()
        known = known_capacities(evidence)
        for snap in sorted(evidence.snapshot_data, key=lambda s: s.oom is None):
            devices = list(snap.devices)
            if snap.oom is not None and snap.oom.device not in snap.devices:
                devices.append(snap.oom.device)  # the very first allocation on that device failed
            forecast = os.path.basename(str(snap.path)) == REHEARSAL_FORECAST
            for device in devices:
                for f in self.check_device(snap, device, options, known):
                    e = f.evidence
                    if "requested" in e:
                        key = (e["device"], e["requested"], e["device_free"], e["time_us"])
                        if key in seen:
                            continue
                        seen.add(key)
                        f = _with_holder(f, evidence, snap, device, forecast)
                    yield f
                    if forecast and "requested" in e:
                        break  # a GPU run dies at its first OOM: the forecast's later ones never happen

    def check_device(self, snap: Snapshot, device: int, options: Options,
                     known: dict[int, Capacity] | None = None) -> Iterable[Finding]:
        history = snap.histories.get(device)
        top_n = int(options.top_owners)
        record = snap.oom if snap.oom is not None and snap.oom.device == device else None
        if history is not None and history.oom_indices:
            for index in history.oom_indices:
                oom = snap.device_traces[device][index]
                # the observer's record is of the last OOM; its free bytes are the same figure
                same = record if record is not None and record.device_free == oom.device_free else None
                yield self._post_mortem(snap, device, index, top_n, same)
            return  # the OOM says more than "near capacity" could
        if record is not None:  # an OOM outside the recorded history (or with none recorded)
            yield self._observer_post_mortem(snap, device, record, top_n)
            return

        peak = peak_of(snap, device)
        peak_reserved, index = peak.reserved, peak.index
        cap = self._capacity(peak_reserved, options, (known or {}).get(device))
        if cap is None:
            return
        capacity, source = cap.total, cap.source
        share = peak_reserved / capacity
        if share < options.near_share:
            return
        shown = peak.owners[:top_n]
        owners_known = any(x.frame is not None for x in shown)
        assumed = source == "assumed"
        cap_text = (f"the {capacity / GiB:.2f} GiB of an assumed {cap.card or 'device'} (the smallest common device that "
                    f"holds it; set device-capacity-gib)" if assumed else
                    f"the {format_bytes(capacity)} device ({cap.said})")
        caveat = ""
        if share > 1:
            caveat = (" That is more than the device's memory as the evidence states it: was the snapshot taken "
                      "on another device? Set device-capacity-gib." if source == "device-properties" else
                      " That is more than the stated capacity: check device-capacity-gib.")
        owners_text = f" Owners at that moment: {_owners_text(shown)}." if owners_known else (
            " No allocation stacks were recorded, so the owning lines are unknown "
            "(record a history with torch.cuda.memory._record_memory_history()).")
        cached = peak.reserved_then - peak.allocated
        yield self.finding(
            ("GPU memory peaks near an assumed device's limit: lower the peak. " if assumed else
             "GPU memory peaks near the device's limit: lower the peak. ")
            + f"Peak reserved GPU memory on cuda:{device} was {format_bytes(peak_reserved)}, {share:.0%} of "
            f"{cap_text}; {peak.text}.{caveat}{owners_text}",
            severity="info" if assumed else None,
            locations=_locations(x.frame for x in shown),
            evidence={"snapshot": snap.path, "device": device, "capacity": capacity, "capacity_source": source,
                      "capacity_from": cap.origin, "assumed_device": cap.card, "peak_reserved": peak_reserved,
                      "peak_allocated": peak.allocated, "allocated_now": peak.now, "allocated_basis": "requested",
                      "reserved_unallocated": cached, "share": round(share, 4),
                      "peak_index": index, "history_entries": history.entries if history else 0,
                      "peak_time_us": (snap.device_traces[device][index].time_us
                                       if index is not None and index >= 0 else None),
                      "owners": _owner_rows(shown)},
            fix=_config_fix(snap, cached, "at the peak", owners_known))

    @staticmethod
    def _capacity(peak_reserved: int, options: Options, known: Capacity | None) -> Capacity | None:
        """The option, else what the evidence says (see known_capacities), else assumed."""
        if options.device_capacity_gib and options.device_capacity_gib > 0:
            return Capacity(int(options.device_capacity_gib * GiB), "device-capacity-gib", "device-capacity-gib")
        if known is not None:
            return known
        fits = [c for c in sorted(options.common_capacities_gib) if c * GiB >= peak_reserved]
        if not fits:
            return None
        return Capacity(int(fits[0] * GiB), "assumed", "assumed", card=COMMON_DEVICES_GIB.get(fits[0]))

    def _post_mortem(self, snap: Snapshot, device: int, index: int, top_n: int,
                     record: OomRecord | None = None) -> Finding:
        """What was live when the allocator raised OOM, and what had been asked for."""
        oom = snap.device_traces[device][index]
        live = live_at(snap, device, index)
        return self._oom_finding(
            snap, device, top_n, live, requested=oom.size, device_free=oom.device_free or 0,
            total=record.device_total if record is not None else None,
            asked=oom.owner if oom.owner is not None else record.owner if record is not None else None,
            allocated=sum(a.size for a in live), reserved=reserved_at(snap, device, index), counted="live allocations",
            title="CUDA out of memory (post-mortem from the snapshot's history)", note="",
            head={"source": "history", "oom_index": index},
            tail={"time_us": oom.time_us, "stream": oom.stream,
                  "oom_record": record.path if record is not None else None})

    def _observer_post_mortem(self, snap: Snapshot, device: int, rec: OomRecord, top_n: int) -> Finding:
        """The post-mortem of an OOM the history did not record (it happened before or after the
        recorded steps): the request and the free memory are what the allocator told the observer,
        what was live is the snapshot's state, taken by the observer at that moment."""
        fig = snap.devices.get(device) or MemoryFigures()
        return self._oom_finding(
            snap, device, top_n, [b for s in snap.device_segments(device) for b in s.blocks if b.live],
            requested=rec.requested, device_free=rec.device_free, total=rec.device_total, asked=rec.owner,
            allocated=fig.allocated, reserved=fig.reserved, counted="live blocks",
            title="CUDA out of memory (post-mortem from the OOM observer)",
            note=" (No allocator history covers that moment, so the request and the free memory are what the "
                 "allocator told the OOM observer, and what was live is the snapshot taken then.)",
            head={"source": "oom-observer", "oom_index": None},
            tail={"time_us": rec.time_us, "ooms": rec.ooms, "oom_record": rec.path})

    def _oom_finding(self, snap: Snapshot, device: int, top_n: int, live: list, *, requested: int,
                     device_free: int, total: int | None, asked: StackFrame | None, allocated: int, reserved: int,
                     counted: str, title: str, note: str, head: dict[str, Any], tail: dict[str, Any]) -> Finding:
        """The post-mortem finding, whichever evidence told of the OOM (history or observer)."""
        top = owners(live)[:top_n]
        known = any(x.frame is not None for x in top)
        cached = max(0, reserved - allocated)
        at_least = reserved + device_free
        asked_at = f" at {_label(asked)}" if asked is not None else ""
        holds = (f"of the device's {format_bytes(total)}" if total else
                 f"so the device holds at least {format_bytes(at_least)}")
        message = (
            _oom_lead(requested, cached, total)
            + f"CUDA out of memory on cuda:{device}: a request for {format_bytes(requested)}{asked_at} failed "
            f"with {format_bytes(device_free)} free on the device. At that moment {format_bytes(allocated)} was "
            f"allocated in {len(live):,} {counted} and {format_bytes(reserved)} reserved, {holds}. "
            f"{_cause(requested, cached, total)}"
            + (f" Largest owners: {_owners_text(top)}." if known else "") + note)
        return self.finding(
            message, severity="error", title=title,
            locations=_locations([asked, *(x.frame for x in top)]),
            evidence={"snapshot": snap.path, "device": device, **head,
                      "requested": requested, "device_free": device_free, "device_total": total,
                      "allocated": allocated, "reserved": reserved, "reserved_unallocated": cached,
                      "live_allocations": len(live), "capacity_at_least": at_least, **tail,
                      "requested_at": _owner_rows([Owner(frame=asked, bytes=requested, count=1)])[0],
                      "owners": _owner_rows(top)},
            fix=_config_fix(snap, cached, "when it failed", known))


MiB = 1 << 20


def _oom_step(evidence: Evidence, snap: Snapshot, device: int, index: Any) -> int | None:
    """The audited step an OOM in the snapshot's history fell in: the optimizer steps that ended
    before it (the history's step annotations), less the steps the audit skipped."""
    ends = step_ends(snap)
    if not ends or not isinstance(index, int):
        return None
    t = snap.device_traces[device][index].time_us
    if t is None:
        return None
    return bisect_left(ends, t) - (evidence.program.skipped if evidence.program else 0)


def _keepers(evidence: Evidence, step: int | None, allocated: int) -> tuple[Any, list[dict[str, Any]]]:
    """(the scan, the holders in it that keep GPU memory alive, most bytes first) at the OOM: the
    scan made after the failing step (a rehearsal scans each step that comes near the device's
    memory), else the one after the next step (a rehearsal's forecast is written and scanned at the
    end of the step whose requests outgrew the device, which the simulated allocator, rounding
    requests up to its blocks, may have filled a step sooner), else the last before it. A holder
    whose bytes grew since the first scan comes first; one that holds under 1 MiB is none, and so
    is one that did not grow and holds under a tenth of the `allocated` bytes (the data a program
    keeps on purpose)."""
    scans = sorted(evidence.graph_scans, key=lambda sc: (sc.after_step, sc.failed))
    if step is not None:
        upto = [sc for sc in scans if sc.after_step <= step + 1] or scans
        at = [sc for sc in upto if sc.after_step <= step]
        scans = at if at and at[-1].after_step == step else upto
    if not scans:
        return None, []
    scan, first = scans[-1], {holder_key(h): h for h in scans[0].holders}
    gpu = any(h.get("device_bytes") for h in scan.holders)

    def held(h: dict[str, Any]) -> int:
        return (h.get("device_bytes", 0) if gpu else h.get("bytes", 0)) + h.get("graph_bytes", 0)

    def grew(h: dict[str, Any]) -> int:
        was = first.get(holder_key(h))
        return held(h) - held(was) if was is not None and scans[0] is not scan else 0

    out = [{**h, "held": held(h), "grew": grew(h), "since": scans[0].after_step} for h in scan.holders
           if held(h) >= MiB and (grew(h) > 0 or held(h) >= allocated / 10)]
    return scan, sorted(out, key=lambda h: (h["grew"] <= 0, -h["held"]))


def _with_holder(f: Finding, evidence: Evidence, snap: Snapshot, device: int, forecast: bool) -> Finding:
    """The OOM finding with what keeps the live memory alive, from the run's graph and tensor scans:
    the holder, the line that fills it and the bytes it holds (the finding's location is that
    line); for a rehearsal's forecast, the step the device would be full in."""
    e = f.evidence
    step = _oom_step(evidence, snap, device, e.get("oom_index"))
    scan, keepers = _keepers(evidence, step, e.get("allocated") or 0)
    message, title, locations = f.message, f.title, list(f.locations)
    extra: dict[str, Any] = {}
    if forecast:
        when = f" in step {step}" if step is not None else ""
        lead = (e.get("requested") or 0, e.get("reserved_unallocated") or 0, e.get("device_total"))
        message = (_oom_lead(*lead, would=True)
                   + f"Forecast by the CUDA rehearsal (--device-memory): the program would run out of GPU memory{when}. "
                   + message.removeprefix(_oom_lead(*lead)))
        title = "CUDA out of memory (forecast by the rehearsal)"
        extra["forecast_step"] = step
    if keepers:
        h = keepers[0]
        at = holder_location(h)
        about = ", ".join([h["kind"], *([f"a variable of `{h['function']}()` that a closure it made keeps"
                                         if h.get("closure") else f"a local of `{h['function']}()`"]
                                        if h.get("function") else []),
                           *([f"filled at {os.path.basename(at.file)}:{at.line}"] if at else [])])
        rate = ""
        if h["grew"] > 0 and scan.after_step > h["since"]:
            rate = (f", {format_bytes(h['grew'] // (scan.after_step - h['since']))} more per step since step "
                    f"{h['since']}")
        message += (f" What keeps the live memory alive: `{h['name']}` ({about}) holds "
                    f"{format_bytes(h['held'])} in {h['tensors']:,} tensor{'s' if h['tensors'] != 1 else ''} after "
                    f"step {scan.after_step}{rate}.")
        if at is not None:
            locations = [at] + [loc for loc in locations if (loc.file, loc.line) != (at.file, at.line)]
        extra["holder"] = {"name": h["name"], "function": h.get("function") or None, "kind": h["kind"],
                           "bytes": h["held"], "tensors": h["tensors"], "growth_bytes": h["grew"],
                           "after_step": scan.after_step, "file": at.file if at else None,
                           "line": at.line if at else None}
    else:  # no name the scans reach holds it: the line whose allocations the history saw pile up
        grown = max((g for g in growing_lines(snap) if g.device == device), key=lambda g: g.live[-1] - g.live[0],
                    default=None)
        if grown is not None:
            at = Location(file=grown.frame.filename, line=grown.frame.line,
                          code=source_access.getline(grown.frame.filename, grown.frame.line).strip())
            per = (grown.live[-1] - grown.live[0]) // (len(grown.live) - 1)
            message += (f" What keeps the live memory alive is no name the graph scans reach: the allocations made "
                        f"at {os.path.basename(at.file)}:{at.line} stayed alive, {format_bytes(per)} more at each "
                        f"step's end ({format_bytes(grown.live[-1])} after {len(grown.live)} steps).")
            locations = [at] + [loc for loc in locations if (loc.file, loc.line) != (at.file, at.line)]
            extra["growing_allocation"] = {"file": at.file, "line": at.line, "bytes": grown.live[-1],
                                           "per_step": per, "steps": len(grown.live)}
    if not extra and message == f.message:
        return f
    return msgspec.structs.replace(f, message=message, title=title, locations=locations,
                                   evidence={**e, **extra})
