"""allocator-churn: the caching allocator hit the device's limit and freed its cache to retry."""
from __future__ import annotations

import os
from collections import Counter
from typing import Iterable

import msgspec

from auditor.evidence.allocator.analysis import bytes_pair, saving_text, snapshot_reports, step_ends
from auditor.evidence.allocator.records import AllocatorReport
from auditor.evidence.model import Evidence
from auditor.evidence.oom_record import REHEARSAL_FORECAST
from auditor.evidence.snapshot import Snapshot, format_bytes
from auditor.rules._support.alloc_conf import ALLOC_CONF, merge_conf
from auditor.rules.base import Option, Options, Rule
from auditor.findings import Finding, Fix, Location


def step_of(snap: Snapshot, time_us: int | None) -> tuple[int | None, float | None]:
    """(step, position in it 0..1) from the optimizer-step annotations the snapshot carries: a
    step ends where an `Optimizer.step` annotation ends. (None, None) without annotations or time."""
    ends = step_ends(snap)
    if time_us is None or not ends:
        return None, None
    step = sum(1 for t in ends if t < time_us)
    lo = ends[step - 1] if step else None
    hi = ends[step] if step < len(ends) else None
    if lo is None or hi is None or hi <= lo:
        return step, None
    return step, (time_us - lo) / (hi - lo)


class AllocatorChurn(Rule):
    """
    What it detects:
        In a CUDA memory snapshot with history: the caching allocator found no cached block for a
        request, cudaMalloc failed because the device was full, and the allocator synchronised the
        device, cudaFree'd its cached segments and tried again (a burst of segment_free followed by
        segment_alloc in the trace), or gave up (an `oom` entry). Counted per step (the snapshot's
        optimizer-step annotations), with where in the step and the requests that triggered it;
        when the device's capacity is known, the simulated allocator finds the same retries.
        Also (info) the program's own torch.cuda.empty_cache() calls in the trace (their stacks
        name it): the segments returned to CUDA, the cudaMallocs that made them again, and the
        replay without the call.

    Why it costs:
        Each retry is a device-wide synchronisation followed by a storm of cudaFree and cudaMalloc
        calls, each itself synchronous: the step stalls for milliseconds to seconds, and the cache it
        built is gone, so the next steps cudaMalloc again. torch counts them as `num_alloc_retries`.

    Example:
        bad:   a 1 GiB device caching 600 MiB it cannot reuse for a 700 MiB request: free, sync, retry
        good:  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: the same pages serve both requests

    Fix:
        The allocator setting whose simulation removes the retries on the same requests (quoted with
        its simulated reserve and segment counts); when no setting does, lower the peak (activation
        checkpointing, smaller batch, sharded optimizer state).

    Evidence needed:
        A CUDA memory snapshot with history (`torch.cuda.memory._record_memory_history()`).
    """

    id = "allocator-churn"
    title = "The allocator hit the device's limit and freed its cache to retry"
    severity = "warning"
    category = "memory"
    needs = frozenset({"snapshot"})
    options = (Option("min-retries", 1, "flag when at least this many retries (or OOMs) are in the trace", low=1),
               Option("top-requests", 3, "how many triggering lines to name", low=1))

    def check(self, evidence: Evidence, options: Options) -> Iterable[Finding]:
        for snap, r in snapshot_reports(evidence):  # (one recording held by two snapshots: once)
            if _forecast(snap) and not any(c.segments_freed for c in r.churn):
                continue  # a rehearsal's forecast OOMs, and no retry: oom-risk reports them
            if len(r.churn) >= options.min_retries:
                yield self._finding(snap, r, options)
            if r.releases:
                yield self._releases_finding(snap, r)

    def _releases_finding(self, snap: Snapshot, r: AllocatorReport) -> Finding:
        """The program's own empty_cache() calls: the cache they returned and the cudaMallocs that
        made it again, against the replay without them."""
        rel = r.releases
        sites = Counter((x.file, x.line, x.function) for x in rel if x.file)
        where = ", ".join(f"{f.rsplit('/', 1)[-1]}:{ln}" + (f" ({n} calls)" if n > 1 else "")
                          for (f, ln, _), n in sites.most_common(3))
        freed = sum(x.segments_freed for x in rel)
        regrown = sum(x.segments_regrown for x in rel)
        text = ("The GPU cache is emptied, then filled again: drop empty_cache(). "
                f"On cuda:{r.device} the program's torch.cuda.empty_cache() "
                + (f"at {where} " if where else "") + f"returned {freed} cached segment(s), "
                f"{format_bytes(sum(x.bytes_freed for x in rel))}, to CUDA ({len(rel)} call(s), recorded), and the "
                f"requests after it cudaMalloc'd {regrown} segment(s), {format_bytes(sum(x.bytes_regrown for x in rel))}, "
                "again: each cudaFree and cudaMalloc a synchronous call.")
        w = r.without_releases
        if w is not None:
            text += (f" Replayed without the call, the same requests reuse the cache: segment allocs "
                     f"{r.replayed.segment_allocs} -> {w.segment_allocs}, frees {r.replayed.segment_frees} -> "
                     f"{w.segment_frees}, reserved peak {bytes_pair(r.replayed.reserved_peak_bytes, w.reserved_peak_bytes)}.")
        locs = [Location(file=f, line=ln) for (f, ln, _), _ in sites.most_common(3) if ln > 0 and not f.startswith("<")]
        return self.finding(
            text, severity="info", title="The program emptied the allocator's cache, and the allocator filled it again",
            locations=locs,
            fix=Fix(summary="Call torch.cuda.empty_cache() only where another process needs the memory back; between "
                            "steps or phases of one program the allocator reuses its cache without it."),
            evidence={"snapshot": snap.path, "device": r.device,
                      "releases": [msgspec.to_builtins(x) for x in rel[:50]],
                      "replayed": msgspec.to_builtins(r.replayed),
                      "without_releases": msgspec.to_builtins(w) if w is not None else None})

    def _finding(self, snap: Snapshot, r: AllocatorReport, options: Options) -> Finding:
        churn = r.churn
        steps = [step_of(snap, c.time_us) for c in churn]
        per_step = Counter(s for s, _ in steps if s is not None)
        where = [p for _, p in steps if p is not None]
        lines = Counter((c.file, c.line, c.function) for c in churn if c.file)
        top = lines.most_common(int(options.top_requests))
        kind = ("forecast by the CUDA rehearsal" if _forecast(snap) else "recorded" if churn[0].recorded
                else "simulated on the given capacity")
        freed = sum(c.bytes_freed for c in churn)
        retries = sum(1 for c in churn if c.segments_freed)
        ooms = len(churn) - retries
        what = " and ".join(x for x in (f"freed its cache to retry a request {retries} time(s)" if retries else "",
                                        f"failed {ooms} request(s) even after freeing it (OOM)" if ooms else "") if x)
        text = (f"On cuda:{r.device} the allocator hit the device's limit and {what} ({kind}): "
                f"{sum(c.segments_freed for c in churn)} segment(s), {format_bytes(freed)}, returned to CUDA, each "
                f"time after a device-wide synchronisation. Requests: "
                + ", ".join(f"{format_bytes(c.requested_bytes)} at entry {c.index}" for c in churn[:5])
                + (f" (+{len(churn) - 5} more)" if len(churn) > 5 else "") + ".")
        if per_step:
            text += " Per step: " + ", ".join(f"step {s}: {n}" for s, n in sorted(per_step.items())) + "."
        if where:
            text += f" Where in the step: {', '.join(f'{p:.0%}' for p in where[:5])} of the way through."
        if top:
            text += " Triggered by: " + ", ".join(f"{f.rsplit('/', 1)[-1]}:{ln} {fn} ({n})" for (f, ln, fn), n in top) + "."
        existing = snap.allocator_settings.alloc_conf if snap.allocator_settings else ""
        removes = [w for w in r.what_if if w.retries == 0 and w.ooms == 0 and w.segment_frees < r.recorded.segment_frees]
        if removes:
            best = min(removes, key=lambda w: (w.segment_frees, w.reserved_peak_bytes))
            value = merge_conf(existing, **dict(p.split(":", 1) for p in best.alloc_conf.split(",")))
            fix = Fix(summary=(f"Set {ALLOC_CONF}={value}: on the same requests the simulated allocator never "
                               f"retries ({saving_text(r.recorded, best)})."
                               + (f" It {best.note}." if best.note else "")),
                      config={ALLOC_CONF: value})
        else:
            fix = Fix(summary=("No allocator setting removes the retries in simulation: the live tensors alone fill "
                               "the device; lower the peak (activation checkpointing, a smaller batch, bf16 autocast, "
                               "sharded optimizer state)."))
        locs = [Location(file=f, line=ln) for (f, ln, _), _ in top if ln > 0 and not f.startswith("<")]
        lead = ("The allocator runs out and retries: change its settings. " if removes else
                "The allocator runs out and retries: lower the peak. ")
        return self.finding(
            lead + text, locations=locs, fix=fix,
            evidence={"snapshot": snap.path, "device": r.device, "retries": len(churn),
                      "capacity": r.capacity_bytes, "capacity_source": r.capacity_source,
                      "per_step": {str(k): v for k, v in sorted(per_step.items())},
                      "churn": [{"index": c.index, "requested": c.requested_bytes, "segments_freed": c.segments_freed,
                                 "bytes_freed": c.bytes_freed, "time_us": c.time_us, "file": c.file, "line": c.line,
                                 "recorded": c.recorded} for c in churn[:50]],
                      "removed_by": [w.alloc_conf for w in removes]})


def _forecast(snap: Snapshot) -> bool:
    """Whether `snap` is the snapshot a CUDA rehearsal with --device-memory forecast (its requests
    replayed on the rehearsed device), not one a GPU recorded."""
    return os.path.basename(str(snap.path)) == REHEARSAL_FORECAST
